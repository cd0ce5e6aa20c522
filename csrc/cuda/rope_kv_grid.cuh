// The launch description of the fused KV-cache launch: which (T, Cache)
// pairs have a fused kernel, the cache's chunk per 16-byte vector of data,
// and whether a call's caches can be vector-addressed. Host code, no torch
// headers: the launch, the host emulation and the launch model include it.
#pragma once

#include "params/kv_params.h"
#include "rope_grid.cuh"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// One 16-byte vector of T as the cache holds it: the same vector, or its
// kElems float8_e4m3fn bytes as one word.
template <typename T, typename Cache>
struct CacheChunk {
  static constexpr int kElems = kVectorBytes / static_cast<int>(sizeof(T));
  static constexpr int kBytes = kElems * static_cast<int>(sizeof(Cache));
  using type = std::conditional_t<
      std::is_same_v<T, Cache>, Vector,
      std::conditional_t<kBytes == 8, uint64_t, std::conditional_t<kBytes == 4, uint32_t, uint16_t>>>;
};

// The copy blocks of a fused launch: the cache vectors a row's rotation
// does not write (k's pass-through dims, then v), split over their own
// threads as the rope grid splits pair groups and heads (`group_threads`
// across the row's chunks, `chunks` across k heads), one row per thread.
// A launch whose rows all fit in one wave adds them after its rope blocks,
// so a row's v copy runs beside its rotation instead of after it: a decode
// step is one memory round trip, not three. `blocks` is 0 when the rope
// rows copy their own (use_copy_blocks).
struct CopyGrid {
  int64_t row_chunks = 0;  // pass-through and v chunks of a k head row
  int32_t group_threads = 0;
  int32_t chunks = 0;
  int32_t lanes = 0;  // group_threads * chunks
  int32_t rows_per_block = 0;
  int64_t rows = 0;
  int64_t row_blocks = 0;
  int64_t blocks = 0;
};

// The copy split for k head rows of `pass` pass-through and `v_chunks` v
// chunks, in blocks of g.block_threads (the launch's block).
inline CopyGrid copy_grid(const Grid& g, int64_t k_heads, int64_t pass, int64_t v_chunks) {
  CopyGrid c;
  const int64_t total = pass + v_chunks;
  c.row_chunks = total;
  if (g.block_threads == 0 || total == 0 || k_heads == 0 || g.rows == 0) return c;
  c.group_threads = static_cast<int32_t>(total < g.block_threads ? total : g.block_threads);
  const int64_t max_chunks = g.block_threads / c.group_threads;
  c.chunks = static_cast<int32_t>(k_heads < max_chunks ? k_heads : max_chunks);
  c.lanes = c.group_threads * c.chunks;
  c.rows_per_block = g.block_threads / c.lanes;
  c.rows = g.rows;
  c.row_blocks = (g.rows + c.rows_per_block - 1) / c.rows_per_block;
  return c;
}

template <typename T, typename Cache>
inline CopyGrid copy_grid(const KVCacheParams& p, const Grid& g) {
  constexpr int64_t kElems = CacheChunk<T, Cache>::kElems;
  return copy_grid(g, p.rope.k.heads, (p.rope.head_dim - p.rope.rotary_dim) / kElems, p.v_dim / kElems);
}

// c with its blocks launched when the rope blocks (g as launched, of shape
// s) and the copy blocks fit in one wave of `resident` blocks: no rope block
// strides, and no copy block waits for a rope block to leave. Only an int32
// index has a copy-block kernel (a grid that small has one unless its
// strides pass 2^31); copy_blocks() switches them off.
inline CopyGrid use_copy_blocks(const LaunchShape& s, const Grid& g, CopyGrid c, int64_t resident) {
  const bool fits = g.blocks == g.row_blocks && g.blocks + c.row_blocks <= resident;
  c.blocks = s.int32 && c.row_blocks > 0 && fits && copy_blocks() ? c.row_blocks : 0;
  return c;
}

// Whether a fused kernel is built for (T, Cache): all but a float64 model
// with an fp8 cache, whose 2-element chunks would spill (it keeps the two
// launches).
template <typename T, typename Cache>
constexpr bool kFusedCache = !(sizeof(T) == 8 && sizeof(Cache) == 1);

// True when a kernel for (T, Cache) is built and p's cache and v rows are
// vector-addressable (the fused launch's and the prologue's vector cache
// write's condition; k's rows are the caller's to check).
template <typename T, typename Cache>
inline bool caches_vector_addressable(const KVCacheParams& p) {
  constexpr int64_t kElems = CacheChunk<T, Cache>::kElems;
  if (!kFusedCache<T, Cache>) return false;
  if (p.v_dim % kElems != 0) return false;
  auto addressable = [](const void* base, const int64_t* stride, int64_t elem_bytes, int64_t chunk) {
    if (stride[3] != 1 || reinterpret_cast<uintptr_t>(base) % chunk != 0) return false;
    for (int d = 0; d < 3; ++d) {
      if ((stride[d] * elem_bytes) % chunk != 0) return false;
    }
    return true;
  };
  constexpr int64_t kChunk = CacheChunk<T, Cache>::kBytes;
  return addressable(p.k_cache, p.kc_stride, sizeof(Cache), kChunk) &&
      addressable(p.v_cache, p.vc_stride, sizeof(Cache), kChunk) &&
      addressable(p.v, p.v_stride, sizeof(T), kVectorBytes);
}

// True when the fused launch serves p, whose RoPE launch is s
// (launch_shape<T>(p.rope)): a kernel for (T, Cache), the RoPE vector path,
// a grid with pair groups, and every cache and v row vector-addressable
// (unit element stride, chunk-aligned bases and strides, v_dim a whole
// number of vectors).
template <typename T, typename Cache>
inline bool can_fuse_cache(const KVCacheParams& p, const LaunchShape& s) {
  if (!s.vectorized || s.grid.row_blocks == 0 || s.grid.rotary_groups == 0 || p.rope.k.heads == 0) return false;
  return caches_vector_addressable<T, Cache>(p);
}

}  // namespace kernel
}  // namespace rotary
