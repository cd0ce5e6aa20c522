// The host emulation of apply_rope_with_kv_cache_'s CUDA launch
// (launch_rope_with_kv_cache): the fused grid (cuda/rope_kv_kernel.cuh:
// the RoPE kernel's per-thread body with a CacheSink, and its copy blocks)
// when can_fuse_cache holds, else the RoPE grid then the element-wise cache
// grid (cuda/kv_cache_kernel.cuh), every thread of every block on the CPU.
// Shared by the fused launch's tests and its fuzz.
#pragma once

#include "cuda/cuda_types.h"
#include "cuda/kv_cache_kernel.cuh"
#include "cuda/rope_kv_kernel.cuh"
#include "rope_emulation.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>

namespace rotary_emulation {

using rotary::kernel::Grid;
using rotary::kernel::KVCacheParams;

constexpr int64_t kBlock = 16, kRows = 64;  // the tests' paged block size, and contiguous cache rows

// What launch_rope_with_kv_cache runs, on the CPU: the fused grid when
// can_fuse_cache holds, else the RoPE grid then the element-wise cache grid
// (run with the torch types, which share the CUDA types' bits).
// With copy_blocks, the fused launch's copy blocks (use_copy_blocks with
// room for all) copy the rows' v and pass-through dims, after the rope
// blocks ran (any order would do: they touch disjoint bytes).
template <typename T, typename Cache, bool kIl>
void run_copy_blocks(const KVCacheParams& kv) {
  const Grid g = rotary::kernel::make_grid<T, kIl, true>(kv.rope);
  rotary::kernel::CopyGrid c = rotary::kernel::copy_grid<T, Cache>(kv, g);
  c.blocks = c.row_blocks;  // as use_copy_blocks launches them
  ASSERT_GE(c.rows_per_block * c.lanes, 1);
  ASSERT_LE(c.rows_per_block * c.lanes, g.block_threads);
  for (int64_t block = 0; block < c.blocks; ++block) {
    for (int32_t tid = 0; tid < g.block_threads; ++tid) {
      rotary::kernel::copy_thread<T, Cache, rotary::kernel::Tile<T, kIl, true>::kHeads>(kv, c, block, tid);
    }
  }
}

// Returns whether the launch is the fused one.
template <typename scalar_t, typename CacheCpu>
bool emulate_kv(const KVCacheParams& kv, bool index64, int64_t max_blocks, bool copy_blocks) {
  using T = typename rotary::cuda::CudaType<scalar_t>::type;
  using Cache = std::conditional_t<std::is_same_v<CacheCpu, uint8_t>, uint8_t, T>;
  const bool fused = rotary::kernel::can_fuse_cache<T, Cache>(kv, rotary::kernel::launch_shape<T>(kv.rope));
  const Variant launch{true, index64, max_blocks, true};  // the fused launch: the vector path, prefetching
  if (fused) {
    if constexpr (rotary::kernel::kFusedCache<T, Cache>) {
      if (copy_blocks) {
        const rotary::kernel::CacheSink<T, Cache, false> sink(kv);
        kv.rope.interleaved ? emulate_grid<T, true, true>(kv.rope, launch, sink)
                            : emulate_grid<T, false, true>(kv.rope, launch, sink);
        kv.rope.interleaved ? run_copy_blocks<T, Cache, true>(kv) : run_copy_blocks<T, Cache, false>(kv);
      } else {
        const rotary::kernel::CacheSink<T, Cache> sink(kv);
        kv.rope.interleaved ? emulate_grid<T, true, true>(kv.rope, launch, sink)
                            : emulate_grid<T, false, true>(kv.rope, launch, sink);
      }
    }
    return true;
  }
  emulate<T>(kv.rope, Variant{rotary::kernel::can_vectorize<T>(kv.rope), index64, max_blocks, true});
  for (int64_t i = 0; i < rotary::kernel::kv_cache_threads(kv); ++i) {
    rotary::kernel::kv_cache_thread<scalar_t, CacheCpu>(kv, i);
  }
  return false;
}

}  // namespace rotary_emulation
