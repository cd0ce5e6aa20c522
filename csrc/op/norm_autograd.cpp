// Autograd of the prologue op, y = R(N(x)) with N the RMSNorm scaled by
// w + weight_offset and R the rotation. The backward turns the gradient back
// through R (the inverse rotation, run by the RoPE op) and then runs N's
// backward in torch ops in the accumulation type; every step is
// differentiable, so double backward works as well.
#include "checks/norm_checks.h"
#include "func_node.h"
#include "rope_state.h"
#include <rotary/op_args.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace rotary {
namespace {

using detail::RopeState;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct NormState {
  bool heads = false;  // norm "heads": over the heads axis and head_dim
  double eps = 0;
  double weight_offset = 0;
  int64_t heads_axis = 1;
};

std::vector<int64_t> norm_dims(const NormState& n) {
  return n.heads ? std::vector<int64_t>{n.heads_axis, -1} : std::vector<int64_t>{-1};
}

// w in acc, shaped to broadcast against x.
at::Tensor shaped_weight(const at::Tensor& w, const at::Tensor& x, const NormState& n, at::ScalarType acc) {
  if (!n.heads) return w.to(acc);
  std::vector<int64_t> shape(x.dim(), 1);
  shape[n.heads_axis] = x.size(n.heads_axis);
  shape.back() = x.size(-1);
  return w.to(acc).view(shape);
}

// weight + weight_offset in acc, shaped to broadcast against x.
at::Tensor effective_weight(const at::Tensor& w, const at::Tensor& x, const NormState& n, at::ScalarType acc) {
  if (!w.defined()) return at::scalar_tensor(1.0 + n.weight_offset, x.options().dtype(acc));
  return shaped_weight(w, x, n, acc) + n.weight_offset;
}

// N's forward-mode derivative for one tensor: the tangent of N(x) given
// x's tangent tx and its weight's tw (undefined: zero), in x's dtype.
at::Tensor norm_jvp(const at::Tensor& x, const at::Tensor& w, const at::Tensor& tx, const at::Tensor& tw,
                    const NormState& n) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto dims = norm_dims(n);
  const at::Tensor xf = x.to(acc);
  const at::Tensor rstd = at::rsqrt(xf.pow(2).mean(dims, /*keepdim=*/true) + n.eps);
  const at::Tensor nh = xf * rstd;
  at::Tensor t = at::zeros_like(xf);
  if (tx.defined()) {
    const at::Tensor txf = tx.to(acc);
    t = rstd * (txf - nh * (nh * txf).mean(dims, /*keepdim=*/true)) * effective_weight(w, x, n, acc);
  }
  if (tw.defined()) t = t + nh * shaped_weight(tw, x, n, acc);
  return t.to(x.scalar_type());
}

// N's backward for one tensor: the gradients of x and of its weight, given
// the gradient gn of N(x).
std::pair<at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& gn, const NormState& n) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto dims = norm_dims(n);
  const at::Tensor xf = x.to(acc);
  const at::Tensor rstd = at::rsqrt(xf.pow(2).mean(dims, /*keepdim=*/true) + n.eps);
  const at::Tensor nh = xf * rstd;
  const at::Tensor g = gn.to(acc);
  const at::Tensor gnh = g * effective_weight(w, x, n, acc);
  const at::Tensor gx = rstd * (gnh - nh * (gnh * nh).mean(dims, /*keepdim=*/true));
  at::Tensor gw;
  if (w.defined() && w.requires_grad()) {
    std::vector<int64_t> summed;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (!(n.heads && d == n.heads_axis)) summed.push_back(d);
    }
    gw = (g * nh).sum(summed).reshape(w.sizes()).to(w.scalar_type());
  }
  return {gx.to(x.scalar_type()), gw};
}

// Whether q's side (q or its weight) and k's side need a gradient: only
// those tensors are saved, so a later in-place change to the other side's
// (k reused as a buffer) does not fail q's backward.
std::pair<bool, bool> sides_needing_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
                                         const at::Tensor& kw) {
  auto needs = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  return {needs(q) || needs(qw), needs(k) || needs(kw)};
}

void save_norm(AutogradContext* ctx, const NormState& n) {
  ctx->saved_data["norm_heads"] = n.heads;
  ctx->saved_data["eps"] = n.eps;
  ctx->saved_data["weight_offset"] = n.weight_offset;
  ctx->saved_data["heads_axis"] = n.heads_axis;
}

NormState load_norm(AutogradContext* ctx) {
  return {ctx->saved_data["norm_heads"].toBool(), ctx->saved_data["eps"].toDouble(),
          ctx->saved_data["weight_offset"].toDouble(), ctx->saved_data["heads_axis"].toInt()};
}

// The forward-mode tangents of q, k and the weights, kept for a backward run
// inside the same dual level (forward over reverse): the norm's backward
// reads q and its weight, so the gradient's tangent needs theirs.
struct Tangents {
  at::Tensor of[4];
};

class NormRopeFunction : public torch::autograd::Function<NormRopeFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& qw,
      const std::optional<at::Tensor>& kw, const RopeState& s, const NormState& n, const Tangents& tangents) {
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined (as in RopeQKFunction)
    const auto [q_side, k_side] = sides_needing_grad(q, k, qw.value_or(at::Tensor()), kw.value_or(at::Tensor()));
    detail::save_state(ctx, s, {q_side ? q : at::Tensor(), k_side ? k : at::Tensor(),
                                q_side ? qw.value_or(at::Tensor()) : at::Tensor(),
                                k_side ? kw.value_or(at::Tensor()) : at::Tensor()});
    save_norm(ctx, n);
    for (int i = 0; i < 4; ++i) {
      if (tangents.of[i].defined()) ctx->saved_data["tangent" + std::to_string(i)] = tangents.of[i];
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out_q, out_k] = apply_qk_norm_rope(
        q, k, s.freqs, s.start_pos, s.interleaved, s.offsets, s.position_ids, s.inverse, s.cu_seqlens, s.inv_freq,
        s.layout, s.rotary_offset, s.axes(), qw, kw, n.eps,
        n.heads ? "heads" : "head", n.weight_offset);
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    if (torch::autograd::ForwardADLevel::try_get_by_idx(0)) {  // the dual level is still open
      for (int i = 0; i < 4; ++i) {
        const auto it = ctx->saved_data.find("tangent" + std::to_string(i));
        at::Tensor& t = saved[detail::kSavedRope + i];
        if (it == ctx->saved_data.end() || !t.defined()) continue;
        t = t.clone();  // a dual of its own: the saved tensor stays as it was
        t._set_fw_grad(it->second.toTensor(), /*level=*/0, /*is_inplace_op=*/false);
      }
    }
    auto g = input_grads(detail::load_state(ctx, saved), load_norm(ctx), saved[detail::kSavedRope],
                         saved[detail::kSavedRope + 1], saved[detail::kSavedRope + 2], saved[detail::kSavedRope + 3],
                         grads[0], grads[1]);
    g.insert(g.end(), {at::Tensor(), at::Tensor(), at::Tensor()});  // the states' and the tangents'
    return g;
  }

  // q's, k's and the weights' gradients from the outputs' (undefined where
  // none came): back through R (the inverse rotation), then N's backward.
  static variable_list input_grads(const RopeState& s, const NormState& n, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& qw, const at::Tensor& kw, const at::Tensor& out_gq,
                                   const at::Tensor& out_gk) {
    auto [gq, gk] = s.input_grads(out_gq, out_gk);
    at::Tensor grad_q, grad_k, grad_qw, grad_kw;
    if (gq.defined() && q.defined()) std::tie(grad_q, grad_qw) = norm_backward(q, qw, gq, n);  // q: saved when needed
    if (gk.defined() && k.defined()) std::tie(grad_k, grad_kw) = norm_backward(k, kw, gk, n);
    return {grad_q, grad_k, grad_qw, grad_kw};
  }
};

// Forward mode: the tangents of R(N(q)) and R(N(k)), R of N's derivative
// (R is linear), from the primals as they are now.
std::tuple<at::Tensor, at::Tensor> norm_rope_tangents(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw, const NormState& n,
    const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  using detail::primal_of;
  using detail::tangent_of;
  return apply_rope_qk(norm_jvp(primal_of(q), primal_of(qw), tangent_of(q), tangent_of(qw), n),
                       norm_jvp(primal_of(k), primal_of(kw), tangent_of(k), tangent_of(kw), n),
                       freqs ROTARY_ROPE_NAMES);
}

// The norm's state of a call (norm refused here by name when unknown).
NormState norm_state(const char* op, c10::string_view norm, double eps, double weight_offset,
                     c10::string_view layout, bool varlen) {
  const bool heads = detail::parse_norm(op, norm) == kernel::NormKind::kHeads;
  return NormState{heads, eps, weight_offset, heads_axis(parse_layout(layout), varlen)};
}

std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  const at::Tensor qw = q_weight.value_or(at::Tensor()), kw = k_weight.value_or(at::Tensor());
  const at::Tensor inv = inv_freq.value_or(at::Tensor());
  detail::check_no_tangent("apply_qk_norm_rope", {{"freqs", &freqs}, {"inv_freq", &inv}});
  const bool tangent = detail::any_tangent({&q, &k, &qw, &kw});
  const bool grad = torch::autograd::compute_requires_grad(q, k, qw, kw, freqs, inv);
  TORCH_CHECK_VALUE(
      !((grad || tangent) && q_fp8_scale), "apply_qk_norm_rope: q_fp8_scale returns q as float8_e4m3fn, which is ",
      "not differentiable; ",
      tangent ? "an input carries a forward-mode tangent (torch.no_grad() does not remove it): pass the primals "
                "(torch.autograd.forward_ad.unpack_dual(t).primal), or drop q_fp8_scale"
              : "call under torch.no_grad() / inference mode, or drop q_fp8_scale");
  detail::check_no_grad_scales("apply_qk_norm_rope", {{"q_fp8_scale", q_fp8_scale}});
  if (!grad && !tangent) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_qk_norm_rope(q, k, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
  }
  // The graph's forward passes norm as a bool: parsed (refused) here. An
  // unknown layout is refused by the op inside forward.
  const NormState n = norm_state("apply_qk_norm_rope", norm, eps, weight_offset, layout, cu_seqlens.has_value());
  // The primals: a custom Function refuses tangents (they are set below).
  const at::Tensor pq = detail::primal_of(q), pk = detail::primal_of(k);
  const at::Tensor pqw = detail::primal_of(qw), pkw = detail::primal_of(kw);
  // The norm's backward reads q and its weight where q's side needs a
  // gradient, k and its weight where k's does.
  const auto [q_side, k_side] = sides_needing_grad(pq, pk, pqw, pkw);
  if (grad) {
    for (const auto& [name, t, side] : {std::tuple<const char*, const at::Tensor*, bool>{"q", &pq, q_side},
                                        {"k", &pk, k_side}, {"q_weight", &pqw, q_side}, {"k_weight", &pkw, k_side}}) {
      if (side) detail::check_savable(name, *t);
    }
  }
  std::tuple<at::Tensor, at::Tensor> out;
  if (!grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = apply_qk_norm_rope(pq, pk, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
  } else if (detail::under_func_transforms()) {  // the same backward as a node (func_node.h)
    // q, k and the weights as saved tensors: a later in-place change to one is caught, not read.
    auto saved = std::make_shared<std::vector<torch::autograd::SavedVariable>>();
    for (const auto& [t, side] : {std::pair<const at::Tensor&, bool>{pq, q_side}, {pk, k_side}, {pqw, q_side},
                                  {pkw, k_side}}) {
      saved->emplace_back(side ? t : at::Tensor(), /*is_output=*/false);
    }
    const auto both = detail::record_node(
        "rotary::NormRopeBackward", {pq, pk, pqw, pkw},
        [held = detail::SavedRopeState(detail::state_of(freqs ROTARY_ROPE_NAMES)), n,
         saved](const variable_list& grads) {
          const auto& v = *saved;
          return NormRopeFunction::input_grads(held.get(), n, v[0].unpack(), v[1].unpack(), v[2].unpack(),
                                               v[3].unpack(), grads[0], grads[1]);
        },
        [&] {
          auto [oq, ok] = apply_qk_norm_rope(pq, pk, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
          return variable_list{oq, ok};
        });
    out = {both[0], both[1]};
  } else {
    // Optional weights: an absent one is no input of the graph (Function::apply).
    const auto both = NormRopeFunction::apply(
        pq, pk, q_weight ? std::optional<at::Tensor>(pqw) : std::nullopt,
        k_weight ? std::optional<at::Tensor>(pkw) : std::nullopt, detail::state_of(freqs ROTARY_ROPE_NAMES), n,
        tangent ? Tangents{{detail::tangent_of(q), detail::tangent_of(k), detail::tangent_of(qw), detail::tangent_of(kw)}}
                : Tangents{});
    out = {both[0], both[1]};
  }
  if (tangent) {
    auto [tq, tk] = norm_rope_tangents(q, k, qw, kw, n, freqs ROTARY_ROPE_NAMES);
    std::get<0>(out)._set_fw_grad(tq, 0, false);
    std::get<1>(out)._set_fw_grad(tk, 0, false);
  }
  return out;
}

void apply_qk_norm_rope_inplace_autograd(
    at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  const char* op = "apply_qk_norm_rope_";
  const at::Tensor qw = q_weight.value_or(at::Tensor()), kw = k_weight.value_or(at::Tensor());
  const at::Tensor inv = inv_freq.value_or(at::Tensor());
  detail::check_no_tangent(op, {{"freqs", &freqs}, {"inv_freq", &inv}});
  detail::check_no_grad(op, "q", q);
  detail::check_no_grad(op, "k", k);
  if (q_weight) detail::check_no_grad(op, "q_weight", *q_weight, "the in-place norm and rotation");
  if (k_weight) detail::check_no_grad(op, "k_weight", *k_weight, "the in-place norm and rotation");
  detail::check_no_grad_tables(freqs, inv_freq);
  // Forward mode: the tangents from the primals before they are written.
  // The op first runs on copies of q and k, so that every argument is
  // checked, and named, by it; a refusal leaves primals and tangents.
  at::Tensor tq, tk;
  if (detail::any_tangent({&q, &k, &qw, &kw})) {
    at::Tensor cq = detail::primal_of(q).clone(), ck = detail::primal_of(k).clone();
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      apply_qk_norm_rope_(cq, ck, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
    }
    const NormState n = norm_state(op, norm, eps, weight_offset, layout, cu_seqlens.has_value());
    std::tie(tq, tk) = norm_rope_tangents(q, k, qw, kw, n, freqs ROTARY_ROPE_NAMES);
  }
  {
    at::AutoDispatchBelowAutograd guard;  // inplace_or_view.cpp bumps the versions
    apply_qk_norm_rope_(q, k, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
  }
  if (tq.defined()) {
    detail::set_in_place_tangent(q, tq);
    detail::set_in_place_tangent(k, tk);
  }
}

void apply_qk_norm_rope_with_kv_cache_autograd(ROTARY_KV_TENSORS ROTARY_KV_PARAMS ROTARY_NORM_PARAMS) {
  const char* op = "apply_qk_norm_rope_with_kv_cache_";
  const at::Tensor qw = q_weight.value_or(at::Tensor()), kw = k_weight.value_or(at::Tensor());
  detail::check_no_tangent(op, {{"q_weight", &qw}, {"k_weight", &kw}});
  detail::check_no_grad_kv(op, q, k, v, k_cache, v_cache, freqs, inv_freq);
  detail::check_no_grad_scales(op, {{"k_scale", k_scale}, {"v_scale", v_scale}, {"q_fp8_scale", q_fp8_scale}});
  if (q_weight) detail::check_no_grad(op, "q_weight", *q_weight, "the in-place norm and rotation", false);
  if (k_weight) detail::check_no_grad(op, "k_weight", *k_weight, "the in-place norm and rotation", false);
  {
    at::AutoDispatchBelowAutograd guard;  // inplace_or_view.cpp bumps the versions
    apply_qk_norm_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES ROTARY_NORM_NAMES);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Autograd, m) {
  ROTARY_IMPL_NORM(m, autograd, );
}

}  // namespace rotary
