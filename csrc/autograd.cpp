// Autograd in C++, so C++ users get gradients too. RoPE is linear in q and k
// and its Jacobian is a rotation: the backward pass is the inverse rotation,
// run through the same op, which makes double backward work as well.
#include <rotary/ops.h>

#include <torch/autograd.h>
#include <torch/library.h>

namespace rotary {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_rope_state(
    AutogradContext* ctx,
    const at::Tensor& freqs,
    const c10::SymInt& start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  TORCH_CHECK_VALUE(
      !freqs.requires_grad(),
      "rotary: freqs requires grad, but gradients with respect to the frequency table are not ",
      "supported; pass freqs.detach() or register it as a buffer");
  ctx->save_for_backward({freqs, positions.value_or(at::Tensor())});
  ctx->saved_data["start_pos"] = start_pos;
  ctx->saved_data["interleaved"] = interleaved;
  ctx->saved_data["inverse"] = inverse;
}

struct RopeState {
  at::Tensor freqs;
  std::optional<at::Tensor> positions;
  c10::SymInt start_pos;
  bool interleaved;
  bool inverse;
};

RopeState load_rope_state(AutogradContext* ctx) {
  auto saved = ctx->get_saved_variables();
  std::optional<at::Tensor> positions;
  if (saved[1].defined()) positions = saved[1];
  return {
      saved[0], positions, ctx->saved_data["start_pos"].toSymInt(),
      ctx->saved_data["interleaved"].toBool(), ctx->saved_data["inverse"].toBool()};
}

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      const at::Tensor& freqs,
      c10::SymInt start_pos,
      bool interleaved,
      const std::optional<at::Tensor>& positions,
      bool inverse) {
    save_rope_state(ctx, freqs, start_pos, interleaved, positions, inverse);
    at::AutoDispatchBelowADInplaceOrView guard;
    return {apply_rope(x, freqs, start_pos, interleaved, positions, inverse)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = load_rope_state(ctx);
    auto grad_x = apply_rope(grads[0], s.freqs, s.start_pos, s.interleaved, s.positions, !s.inverse);
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class RopeQKFunction : public torch::autograd::Function<RopeQKFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& q,
      const at::Tensor& k,
      const at::Tensor& freqs,
      c10::SymInt start_pos,
      bool interleaved,
      const std::optional<at::Tensor>& positions,
      bool inverse) {
    save_rope_state(ctx, freqs, start_pos, interleaved, positions, inverse);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out_q, out_k] = apply_rope_qk(q, k, freqs, start_pos, interleaved, positions, inverse);
    return {out_q, out_k};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = load_rope_state(ctx);
    const auto& gq = grads[0];
    const auto& gk = grads[1];
    at::Tensor grad_q, grad_k;
    if (gq.defined() && gk.defined()) {
      std::tie(grad_q, grad_k) =
          apply_rope_qk(gq, gk, s.freqs, s.start_pos, s.interleaved, s.positions, !s.inverse);
    } else if (gq.defined()) {
      grad_q = apply_rope(gq, s.freqs, s.start_pos, s.interleaved, s.positions, !s.inverse);
    } else if (gk.defined()) {
      grad_k = apply_rope(gk, s.freqs, s.start_pos, s.interleaved, s.positions, !s.inverse);
    }
    return {grad_q, grad_k, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor apply_rope_autograd(
    const at::Tensor& x,
    const at::Tensor& freqs,
    c10::SymInt start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  return RopeFunction::apply(x, freqs, std::move(start_pos), interleaved, positions, inverse)[0];
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_autograd(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    c10::SymInt start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  auto out = RopeQKFunction::apply(q, k, freqs, std::move(start_pos), interleaved, positions, inverse);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Autograd, m) {
  m.impl("apply_rope", &apply_rope_autograd);
  m.impl("apply_rope_qk", &apply_rope_qk_autograd);
}

}  // namespace rotary
