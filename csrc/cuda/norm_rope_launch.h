// Host entry into the prologue's CUDA kernel (norm_rope_kernel.cuh).
#pragma once

#include "params/norm_params.h"
#include "params/rope_params.h"

#include <cuda_runtime_api.h>

namespace rotary {
namespace cuda {

// Enqueues the one launch that normalizes and rotates q and k on `stream`.
// T is float, double, __half or __nv_bfloat16.
template <typename T>
void launch_norm_rope(const kernel::RopeParams& p, const kernel::NormParams& n, cudaStream_t stream);

}  // namespace cuda
}  // namespace rotary
