// Autograd in C++, so C++ users get gradients too. RoPE is linear in q and k
// and its Jacobian is a rotation: the backward pass is the inverse rotation,
// run through the same op, which makes double backward work as well; the
// forward mode's tangent is the same rotation of the input's. Dims past
// rotary_dim pass through, and so do their gradients.
#include <rotary/ops.h>

#include "func_node.h"
#include "rope_state.h"
#include <rotary/op_args.h>

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <functional>
#include <string>

namespace rotary {
namespace {

using detail::check_no_grad;
using detail::check_no_grad_tables;
using detail::check_no_tangent;
using detail::load_state;
using detail::or_null;
using detail::OptTensor;
using detail::RopeState;
using detail::save_state;
using detail::state_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const RopeState& s) {
    save_state(ctx, s);
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_rope(x, s.freqs, s.start_pos, s.interleaved, s.offsets, s.position_ids, s.inverse, s.cu_seqlens, s.inv_freq, s.layout, s.rotary_offset, s.axes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {load_state(ctx, ctx->get_saved_variables()).backward(grads[0]), at::Tensor()};
  }
};

class RopeQKFunction : public torch::autograd::Function<RopeQKFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const RopeState& s) {
    // An output with no gradient stays undefined (input_grads skips it): materialized zeros would be plain
    // tensors beside DTensor (or other subclass) gradients.
    ctx->set_materialize_grads(false);
    save_state(ctx, s);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out_q, out_k] = apply_rope_qk(
        q, k, s.freqs, s.start_pos, s.interleaved, s.offsets, s.position_ids, s.inverse, s.cu_seqlens, s.inv_freq, s.layout, s.rotary_offset, s.axes());
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_q, grad_k] = load_state(ctx, ctx->get_saved_variables()).input_grads(grads[0], grads[1]);
    return {grad_q, grad_k, at::Tensor()};
  }
};

// Under torch.func's transforms (func_node.h), the same backward as a node.
variable_list record_rope(const RopeState& state, const variable_list& inputs,
                          const std::function<variable_list()>& forward) {
  const size_t n = inputs.size();
  return detail::record_node("rotary::RopeBackward", inputs, [s = detail::SavedRopeState(state), n](
                                                                 const variable_list& grads) {
    auto [grad_q, grad_k] = s.get().input_grads(grads[0], n > 1 ? grads[1] : at::Tensor());
    return n > 1 ? variable_list{grad_q, grad_k} : variable_list{grad_q};
  }, forward);
}

// Forward mode: the op is linear in q and k, so an output's tangent is the
// same rotation of the input's tangent (a zero one where the input has
// none). The tables' tangents are refused, like their gradients.
using detail::any_tangent;
using detail::primal_of;
using detail::tangent_of;

at::Tensor apply_rope_autograd(const at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_tangent("apply_rope", {{"freqs", &freqs}, {"inv_freq", or_null(inv_freq)}});
  at::Tensor out;
  if (!torch::autograd::compute_requires_grad(x, freqs, inv_freq.value_or(at::Tensor()))) {  // inference and decode: no graph to record
    at::AutoDispatchBelowADInplaceOrView guard;
    out = apply_rope(x, freqs ROTARY_ROPE_NAMES);
  } else if (detail::under_func_transforms()) {
    out = record_rope(state_of(freqs ROTARY_ROPE_NAMES), {x}, [&] {
      return variable_list{apply_rope(primal_of(x), freqs ROTARY_ROPE_NAMES)};
    })[0];
  } else {
    out = RopeFunction::apply(primal_of(x), state_of(freqs ROTARY_ROPE_NAMES));
  }
  if (any_tangent({&x})) out._set_fw_grad(apply_rope(tangent_of(x), freqs ROTARY_ROPE_NAMES), 0, false);
  return out;
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_tangent("apply_rope_qk", {{"freqs", &freqs}, {"inv_freq", or_null(inv_freq)}});
  std::tuple<at::Tensor, at::Tensor> out;
  if (!torch::autograd::compute_requires_grad(q, k, freqs, inv_freq.value_or(at::Tensor()))) {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = apply_rope_qk(q, k, freqs ROTARY_ROPE_NAMES);
  } else {
    const auto both = detail::under_func_transforms()
        ? record_rope(state_of(freqs ROTARY_ROPE_NAMES), {q, k}, [&] {
            auto [oq, ok] = apply_rope_qk(primal_of(q), primal_of(k), freqs ROTARY_ROPE_NAMES);
            return variable_list{oq, ok};
          })
        : RopeQKFunction::apply(primal_of(q), primal_of(k), state_of(freqs ROTARY_ROPE_NAMES));
    out = {both[0], both[1]};
  }
  if (any_tangent({&q, &k})) {
    auto [oq, ok] = apply_rope_qk(detail::tangent_or_zeros(q), detail::tangent_or_zeros(k), freqs ROTARY_ROPE_NAMES);
    std::get<0>(out)._set_fw_grad(oq, 0, false);
    std::get<1>(out)._set_fw_grad(ok, 0, false);
  }
  return out;
}

// In place, the tangents are rotated first, by the same op on copies of
// them (its errors name it), then the primal (a refusal of either leaves
// both as they were); the copies are written into the tangents the tensors
// have.
void apply_rope_inplace_autograd(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_tangent("apply_rope_", {{"freqs", &freqs}, {"inv_freq", or_null(inv_freq)}});
  check_no_grad("apply_rope_", "x", x);
  check_no_grad_tables(freqs, inv_freq);
  at::Tensor tx = any_tangent({&x}) ? tangent_of(x).clone() : at::Tensor();
  if (tx.defined()) apply_rope_(tx, freqs ROTARY_ROPE_NAMES);
  {
    at::AutoDispatchBelowAutograd guard;  // inplace_or_view.cpp bumps the versions
    apply_rope_(x, freqs ROTARY_ROPE_NAMES);
  }
  if (tx.defined()) detail::set_in_place_tangent(x, tx);
}

void apply_rope_qk_inplace_autograd(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  check_no_tangent("apply_rope_qk_", {{"freqs", &freqs}, {"inv_freq", or_null(inv_freq)}});
  check_no_grad("apply_rope_qk_", "q", q);
  check_no_grad("apply_rope_qk_", "k", k);
  check_no_grad_tables(freqs, inv_freq);
  at::Tensor tq, tk;
  if (any_tangent({&q, &k})) {
    tq = detail::tangent_or_zeros(q).clone();
    tk = detail::tangent_or_zeros(k).clone();
    apply_rope_qk_(tq, tk, freqs ROTARY_ROPE_NAMES);
  }
  {
    at::AutoDispatchBelowAutograd guard;  // inplace_or_view.cpp bumps the versions
    apply_rope_qk_(q, k, freqs ROTARY_ROPE_NAMES);
  }
  if (tq.defined()) {
    detail::set_in_place_tangent(q, tq);
    detail::set_in_place_tangent(k, tk);
  }
}

void apply_rope_with_kv_cache_autograd(ROTARY_KV_TENSORS ROTARY_KV_PARAMS) {
  const char* op = "apply_rope_with_kv_cache_";
  detail::check_no_grad_kv(op, q, k, v, k_cache, v_cache, freqs, inv_freq);
  detail::check_no_grad_scales(op, {{"k_scale", k_scale}, {"v_scale", v_scale}});
  {
    at::AutoDispatchBelowAutograd guard;  // inplace_or_view.cpp bumps the versions
    apply_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Autograd, m) {
  ROTARY_IMPL_ALL(m, autograd, );
}

}  // namespace rotary
