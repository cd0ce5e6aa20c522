// A CPU tensor that the table builders fill through its data pointer.
// Allocated below the dispatcher: at::empty inside torch.func.grad / jvp (or
// a Python mode) would return a wrapper with no storage to write. The
// tensor is an inference tensor under inference mode, as at::empty's is.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

namespace rotary {
namespace detail {

inline at::Tensor host_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(sizes, dtype));
}

}  // namespace detail
}  // namespace rotary
