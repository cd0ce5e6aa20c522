#include "kv_cache_launch.h"
#include "occupancy.cuh"
#include "rope_kv_kernel.cuh"
#include "rope_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rotary {
namespace cuda {
namespace {

template <typename T, bool kInterleaved, typename Cache>
void launch(const kernel::KVCacheParams& p, const kernel::LaunchShape& s, cudaStream_t stream) {
  launch_rows<&kernel::rope_kv_kernel<T, kInterleaved, Cache, int32_t>,
              &kernel::rope_kv_kernel<T, kInterleaved, Cache, int64_t>>(p, p.rope, s, stream);
}

}  // namespace

template <typename T, typename Cache>
void launch_rope_with_kv_cache(const kernel::KVCacheParams& p, cudaStream_t stream) {
  if constexpr (kernel::kFusedCache<T, Cache>) {
    const kernel::LaunchShape s = kernel::launch_shape<T>(p.rope);
    if (kernel::can_fuse_cache<T, Cache>(p, s)) {
      p.rope.interleaved ? launch<T, true, Cache>(p, s, stream) : launch<T, false, Cache>(p, s, stream);
      return;
    }
  }
  launch_rope<T>(p.rope, stream);
  launch_kv_cache<T, Cache>(p, stream);
}

#define ROTARY_ROPE_KV_INSTANTIATE(T)                                                              \
  template void launch_rope_with_kv_cache<T, T>(const kernel::KVCacheParams&, cudaStream_t);       \
  template void launch_rope_with_kv_cache<T, uint8_t>(const kernel::KVCacheParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_ROPE_KV_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
