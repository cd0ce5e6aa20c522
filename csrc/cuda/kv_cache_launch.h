// Host entry into the KV-cache write kernels (kv_cache_kernel.cuh and the
// fused rope_kv_kernel.cuh).
#pragma once

#include "params/kv_params.h"

#include <cuda_runtime_api.h>

namespace rotary {
namespace cuda {

// Enqueues the cache write of p on `stream`. T is float, double, __half or
// __nv_bfloat16; Cache is T, or uint8_t for float8_e4m3fn caches.
template <typename T, typename Cache>
void launch_kv_cache(const kernel::KVCacheParams& p, cudaStream_t stream);

// The whole of apply_rope_with_kv_cache_ on `stream`: one launch that
// rotates q and k and writes both caches when can_fuse_cache holds
// (rope_kv_kernel.cuh), else the RoPE launch then launch_kv_cache.
template <typename T, typename Cache>
void launch_rope_with_kv_cache(const kernel::KVCacheParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace rotary
