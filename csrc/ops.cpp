// Op schemas and the C++ entry points that call them through the dispatcher.
#include <rotary/ops.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace rotary {

at::Tensor apply_rope(
    const at::Tensor& x,
    const at::Tensor& freqs,
    c10::SymInt start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("rotary::apply_rope", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, c10::SymInt, bool,
                           const std::optional<at::Tensor>&, bool)>();
  return op.call(x, freqs, std::move(start_pos), interleaved, positions, inverse);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    c10::SymInt start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("rotary::apply_rope_qk", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt, bool,
                           const std::optional<at::Tensor>&, bool)>();
  return op.call(q, k, freqs, std::move(start_pos), interleaved, positions, inverse);
}

TORCH_LIBRARY(rotary, m) {
  m.def(
      "apply_rope(Tensor x, Tensor freqs, SymInt start_pos=0, bool interleaved=True, *, "
      "Tensor? positions=None, bool inverse=False) -> Tensor");
  m.def(
      "apply_rope_qk(Tensor q, Tensor k, Tensor freqs, SymInt start_pos=0, bool interleaved=True, *, "
      "Tensor? positions=None, bool inverse=False) -> (Tensor, Tensor)");
}

}  // namespace rotary
