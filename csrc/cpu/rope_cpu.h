// Direct entry into the CPU kernel, below the dispatcher: no checks, no
// allocation, no autograd. For benchmarks and tests that build a
// kernel::RopeParams themselves (or with detail::prepare_rope).
#pragma once

#include "../rope_params.h"

#include <c10/core/ScalarType.h>

namespace rotary {
namespace cpu {

// Rotates p.q (and p.k when p.k.heads > 0) as described by p. dtype is the
// element type of the q/k tensors: float, double, half or bfloat16. The caller
// guarantees valid pointers, strides and in-range positions.
void rope_cpu(const kernel::RopeParams& p, at::ScalarType dtype);

}  // namespace cpu
}  // namespace rotary
