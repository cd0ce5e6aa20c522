// Host entry into the prologue's CUDA kernel (norm_rope_kernel.cuh).
#pragma once

#include "params/kv_params.h"
#include "params/norm_params.h"

#include <cuda_runtime_api.h>

namespace rotary {
namespace cuda {

// Enqueues the one launch that normalizes and rotates q and k (kv.rope) on
// `stream`. With a Cache (T, or uint8_t for float8_e4m3fn caches; void:
// none) the same launch writes k and v into kv's caches, row by row.
// T is float, double, __half or __nv_bfloat16.
template <typename T, typename Cache>
void launch_norm_rope(const kernel::KVCacheParams& kv, const kernel::NormParams& n, cudaStream_t stream);

}  // namespace cuda
}  // namespace rotary
