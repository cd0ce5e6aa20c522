// Meta kernels: shapes and dtypes only, so torch.compile and export trace the
// ops without running them and without a Python fake implementation.
#include "checks.h"

#include <torch/library.h>

namespace rotary {
namespace {

at::Tensor apply_rope_meta(
    const at::Tensor& x,
    const at::Tensor& freqs,
    c10::SymInt /*start_pos*/,
    bool /*interleaved*/,
    const std::optional<at::Tensor>& positions,
    bool /*inverse*/) {
  detail::check_rope_inputs("apply_rope", x, nullptr, freqs, positions);
  return detail::make_output(x);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_meta(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    c10::SymInt /*start_pos*/,
    bool /*interleaved*/,
    const std::optional<at::Tensor>& positions,
    bool /*inverse*/) {
  detail::check_rope_inputs("apply_rope_qk", q, &k, freqs, positions);
  return {detail::make_output(q), detail::make_output(k)};
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Meta, m) {
  m.impl("apply_rope", &apply_rope_meta);
  m.impl("apply_rope_qk", &apply_rope_qk_meta);
}

}  // namespace rotary
