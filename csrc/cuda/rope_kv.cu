#include "kv_cache_launch.h"
#include "occupancy.cuh"
#include "rope_kv_kernel.cuh"
#include "rope_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace rotary {
namespace cuda {
namespace {

// The rope blocks as launch_rows sizes them, then copy blocks when both fit
// in one wave (use_copy_blocks: int32-index launches only).
template <typename T, bool kInterleaved, typename Cache, typename Index>
void launch_fused(const kernel::KVCacheParams& p, const kernel::LaunchShape& s, cudaStream_t stream) {
  constexpr auto kRows = &kernel::rope_kv_kernel<T, kInterleaved, Cache, Index, false>;
  int64_t wave = 0;
  const kernel::Grid g = launch_grid<kRows>(p.rope, s, wave);
  if constexpr (std::is_same_v<Index, int32_t>) {
    const kernel::CopyGrid copy = kernel::use_copy_blocks(s, g, kernel::copy_grid<T, Cache>(p, g), wave);
    if (copy.blocks > 0) {
      kernel::rope_kv_kernel<T, kInterleaved, Cache, Index, true>
          <<<static_cast<unsigned>(g.blocks + copy.blocks), g.block_threads, 0, stream>>>(p, g, copy);
      return;
    }
  }
  kRows<<<static_cast<unsigned>(g.blocks), g.block_threads, 0, stream>>>(p, g, kernel::CopyGrid());
}

template <typename T, bool kInterleaved, typename Cache>
void launch(const kernel::KVCacheParams& p, const kernel::LaunchShape& s, cudaStream_t stream) {
  s.int32 ? launch_fused<T, kInterleaved, Cache, int32_t>(p, s, stream)
          : launch_fused<T, kInterleaved, Cache, int64_t>(p, s, stream);
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
