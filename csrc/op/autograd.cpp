// Autograd in C++, so C++ users get gradients too. RoPE is linear in q and k
// and its Jacobian is a rotation: the backward pass is the inverse rotation,
// run through the same op, which makes double backward work as well. Dims
// past rotary_dim pass through, and so do their gradients.
#include <rotary/ops.h>

#include <rotary/op_args.h>

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

namespace rotary {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// Everything but q and k, as the backward pass needs it.
struct RopeState {
  at::Tensor freqs;
  OptTensor offsets, position_ids, cu_seqlens, inv_freq;
  c10::SymInt start_pos;
  bool interleaved;
  bool inverse;
  std::string layout;
  int64_t rotary_offset;
  std::optional<std::vector<int64_t>> pair_axes;

  at::OptionalIntArrayRef axes() const {
    return pair_axes ? at::OptionalIntArrayRef(*pair_axes) : at::OptionalIntArrayRef();
  }

  at::Tensor backward(const at::Tensor& grad) const {
    return apply_rope(grad, freqs, start_pos, interleaved, offsets, position_ids, !inverse, cu_seqlens, inv_freq, layout, rotary_offset, axes());
  }
  std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& gq, const at::Tensor& gk) const {
    return apply_rope_qk(gq, gk, freqs, start_pos, interleaved, offsets, position_ids, !inverse, cu_seqlens, inv_freq, layout, rotary_offset, axes());
  }
};

RopeState state_of(const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  return {freqs, offsets, position_ids, cu_seqlens, inv_freq, std::move(start_pos), interleaved, inverse,
          std::string(layout), rotary_offset,
          pair_axes ? std::optional<std::vector<int64_t>>(pair_axes->vec()) : std::nullopt};
}

OptTensor defined_or_none(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

void check_freqs_no_grad(const at::Tensor& freqs) {
  TORCH_CHECK_VALUE(
      !freqs.requires_grad(),
      "rotary: freqs requires grad, but gradients with respect to the frequency table are not ",
      "supported; pass freqs.detach() or register it as a buffer");
}

void save_state(AutogradContext* ctx, const RopeState& s) {
  check_freqs_no_grad(s.freqs);
  ctx->save_for_backward({s.freqs, s.offsets.value_or(at::Tensor()), s.position_ids.value_or(at::Tensor()),
                          s.cu_seqlens.value_or(at::Tensor()), s.inv_freq.value_or(at::Tensor())});
  ctx->saved_data["start_pos"] = s.start_pos;
  ctx->saved_data["interleaved"] = s.interleaved;
  ctx->saved_data["inverse"] = s.inverse;
  ctx->saved_data["layout"] = s.layout;
  ctx->saved_data["rotary_offset"] = s.rotary_offset;
  if (s.pair_axes) ctx->saved_data["pair_axes"] = *s.pair_axes;
}

RopeState load_state(AutogradContext* ctx) {
  auto saved = ctx->get_saved_variables();
  return {saved[0],
          defined_or_none(saved[1]),
          defined_or_none(saved[2]),
          defined_or_none(saved[3]),
          defined_or_none(saved[4]),
          ctx->saved_data["start_pos"].toSymInt(),
          ctx->saved_data["interleaved"].toBool(),
          ctx->saved_data["inverse"].toBool(),
          ctx->saved_data["layout"].toStringRef(),
          ctx->saved_data["rotary_offset"].toInt(),
          ctx->saved_data.count("pair_axes") ? std::optional<std::vector<int64_t>>(ctx->saved_data["pair_axes"].toIntVector())
                                             : std::nullopt};
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const RopeState& s) {
    save_state(ctx, s);
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_rope(x, s.freqs, s.start_pos, s.interleaved, s.offsets, s.position_ids, s.inverse, s.cu_seqlens, s.inv_freq, s.layout, s.rotary_offset, s.axes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {load_state(ctx).backward(grads[0]), at::Tensor()};
  }
};

class RopeQKFunction : public torch::autograd::Function<RopeQKFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const RopeState& s) {
    save_state(ctx, s);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out_q, out_k] = apply_rope_qk(
        q, k, s.freqs, s.start_pos, s.interleaved, s.offsets, s.position_ids, s.inverse, s.cu_seqlens, s.inv_freq, s.layout, s.rotary_offset, s.axes());
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = load_state(ctx);
    const auto& gq = grads[0];
    const auto& gk = grads[1];
    at::Tensor grad_q, grad_k;
    if (gq.defined() && gk.defined()) {
      std::tie(grad_q, grad_k) = s.backward(gq, gk);
    } else if (gq.defined()) {
      grad_q = s.backward(gq);
    } else if (gk.defined()) {
      grad_k = s.backward(gk);
    }
    return {grad_q, grad_k, at::Tensor()};
  }
};

at::Tensor apply_rope_autograd(const at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  if (!torch::autograd::compute_requires_grad(x, freqs)) {  // inference and decode: no graph to record
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_rope(x, freqs ROTARY_ROPE_NAMES);
  }
  const RopeState s = state_of(freqs ROTARY_ROPE_NAMES);
  return RopeFunction::apply(x, s);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  if (!torch::autograd::compute_requires_grad(q, k, freqs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_rope_qk(q, k, freqs ROTARY_ROPE_NAMES);
  }
  const RopeState s = state_of(freqs ROTARY_ROPE_NAMES);
  auto out = RopeQKFunction::apply(q, k, s);
  return {out[0], out[1]};
}

// The in-place ops are not differentiable: they would overwrite a tensor that
// autograd may need. They refuse such inputs and otherwise only bump the
// version counter, so a later misuse of a saved tensor is caught.
void check_no_grad(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      !(at::GradMode::is_enabled() && t.requires_grad()), op, ": ", name,
      " requires grad; in-place rotation is not differentiable. Use the out-of-place op, or run under ",
      "torch.no_grad() / inference mode");
}

// In place, a freqs that requires grad would silently get no gradient.
void check_no_grad_freqs(const at::Tensor& freqs) {
  if (at::GradMode::is_enabled()) check_freqs_no_grad(freqs);
}

void apply_rope_inplace_autograd(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_grad("apply_rope_", "x", x);
  check_no_grad_freqs(freqs);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_(x, freqs ROTARY_ROPE_NAMES);
  }
  torch::autograd::impl::bump_version(x);
}

void apply_rope_qk_inplace_autograd(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_grad("apply_rope_qk_", "q", q);
  check_no_grad("apply_rope_qk_", "k", k);
  check_no_grad_freqs(freqs);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_qk_(q, k, freqs ROTARY_ROPE_NAMES);
  }
  torch::autograd::impl::bump_version(q);
  torch::autograd::impl::bump_version(k);
}

void apply_rope_with_kv_cache_autograd(ROTARY_KV_TENSORS ROTARY_KV_PARAMS) {
  const char* op = "apply_rope_with_kv_cache_";
  check_no_grad(op, "q", q);
  check_no_grad(op, "k", k);
  check_no_grad(op, "k_cache", k_cache);
  check_no_grad(op, "v_cache", v_cache);
  check_no_grad_freqs(freqs);
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES);
  }
  for (at::Tensor* t : {&q, &k, &k_cache, &v_cache}) torch::autograd::impl::bump_version(*t);
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Autograd, m) {
  ROTARY_IMPL_ALL(m, autograd);
}

}  // namespace rotary
