// One validator and one launch-description builder, shared by every backend,
// so a bad input gets the same message on CPU, CUDA and Meta.
#pragma once

#include "rope_params.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace rotary {
namespace detail {

// Shape, dtype and device checks that need no tensor values (Meta-safe).
// k may be null for the single-tensor op.
void check_rope_inputs(
    const char* op,
    const at::Tensor& q,
    const at::Tensor* k,
    const at::Tensor& freqs,
    const std::optional<at::Tensor>& positions);

// Where the kernel writes: same dtype, shape and (for dense inputs) layout as
// the input. The Meta kernel calls this too, so fake and real strides agree.
at::Tensor make_output(const at::Tensor& x);

struct PreparedRope {
  at::Tensor out_q;
  at::Tensor out_k;  // undefined for the single-tensor op
  kernel::RopeParams params;
};

// Validates everything that can be checked on the host without a device
// sync (positions living on the CPU are range-checked here too), allocates
// the outputs and fills the framework-free launch description.
PreparedRope prepare_rope(
    const char* op,
    const at::Tensor& q,
    const at::Tensor* k,
    const at::Tensor& freqs,
    int64_t start_pos,
    const std::optional<at::Tensor>& positions,
    bool interleaved,
    bool inverse);

}  // namespace detail
}  // namespace rotary
