// The launch description of the prologue's CUDA kernel
// (norm_rope_kernel.cuh): block shape, batch, grid, its stride in (b, s),
// the vector path's split of a head, and the (head, index) walk the kernel
// steps by. No torch headers and nothing that needs nvcc: the launch, the
// host emulation and rotary._C's launch model all include it.
#pragma once

#include "params/kv_params.h"
#include "params/launch_switches.h"
#include "params/norm_params.h"
#include "params/rope_params.h"
#include "rope_grid.cuh"
#include "rope_kv_grid.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

constexpr int kNormWarps = 4;
constexpr int kNormThreads = 32 * kNormWarps;
// Loads a thread issues before it uses any of them (the sum of squares, the
// cache write).
constexpr int kNormBatch = 8;
// Heads a lane of the vector path has in flight (its item of each, with
// the table reads they share).
constexpr int kNormLaneHeads = 2;

// The launch: one block per row, at most kNormBlocksPerSm per SM, which
// then grid-stride over the rows (16 resident per SM cover the latency).
constexpr int64_t kNormBlocksPerSm = 16;
inline int64_t norm_blocks(int64_t rows, int64_t sms) {
  return rows < kNormBlocksPerSm * sms ? rows : kNormBlocksPerSm * sms;
}

// The launch's grid stride over token rows (its block count) as a step in
// (b, s), found once on the host (norm_grid) so that the kernel reads it
// from its parameters and divides nothing per row. The vector path (16- and
// 32-bit data, either norm, every q/k access an aligned 16-byte vector and
// every table row read as aligned float4s, or, with N-D positions, a pair
// at a time from its axis's row): a head
// is `items` items, the first `rotated` of them two vectors of pairs
// (adjacent when interleaved, one from each half of the span for
// rotate_half), the rest one pass-through vector each. A segment of
// 2^lanes_log2 lanes of a warp takes kNormLaneHeads heads, one item of each
// per lane, and reduces within the segment. items 0: the element path.
struct NormGrid {
  int64_t step_b, step_s;
  int32_t items, rotated, lanes_log2;
  bool cache_vector;  // the vector path's cache write (norm_grid_for)
  // The vector path's L2 prefetch of a block's next row: 2^prefetch_log2
  // line slots (128 bytes each) per head; -1: none (the element path, or
  // the launch's switch, l2_prefetch(), off).
  int32_t prefetch_log2;
};

// Elements of elem_bytes per vector (the vector path's unit).
inline int32_t norm_vector_elems(int64_t elem_bytes) { return static_cast<int32_t>(kVectorBytes / elem_bytes); }

inline NormGrid norm_grid(const RopeParams& p, int64_t blocks, int64_t elem_bytes) {
  NormGrid g;
  g.step_b = p.seq > 0 ? blocks / p.seq : 0;
  g.step_s = blocks - g.step_b * p.seq;
  g.items = g.rotated = g.lanes_log2 = 0;
  g.cache_vector = false;
  g.prefetch_log2 = -1;
  const int64_t v = norm_vector_elems(elem_bytes);
  // fp64 stays on the element path: its vector instantiations spill.
  if (elem_bytes > 4 || !can_vectorize(p, elem_bytes) ||
      p.rotary_dim % (2 * v) != 0 || !table_rows_vector(p, static_cast<int>(v))) {
    return g;
  }
  const int64_t rotated = p.rotary_dim / (2 * v);  // items of v pairs
  const int64_t items = rotated + (p.head_dim - p.rotary_dim) / v;
  if (items < 1 || items > 32) return g;  // a head wider than a warp's vectors: the element path
  g.items = static_cast<int32_t>(items);
  g.rotated = static_cast<int32_t>(rotated);
  while ((int64_t{1} << g.lanes_log2) < items) ++g.lanes_log2;
  if (l2_prefetch()) {
    const int64_t lines = (p.head_dim * elem_bytes + kLineBytes - 1) / kLineBytes;
    g.prefetch_log2 = 0;
    while ((int64_t{1} << g.prefetch_log2) < lines) ++g.prefetch_log2;
    // The kernel counts a row's line slots in 32 bits: past them, no prefetch.
    if (((p.q.heads + p.k.heads) << g.prefetch_log2) > INT32_MAX) g.prefetch_log2 = -1;
  }
  return g;
}

// The launch's grid for elements T and a Cache (void: none): norm_grid, and
// with a cache on the vector path, whether the write moves 16-byte vectors
// of k's finished rows and v's (their caches vector-addressable).
template <typename T, typename Cache>
inline NormGrid norm_grid_for(const KVCacheParams& kv, int64_t blocks) {
  NormGrid g = norm_grid(kv.rope, blocks, sizeof(T));
  if constexpr (!std::is_void_v<Cache>) g.cache_vector = g.items > 0 && caches_vector_addressable<T, Cache>(kv);
  return g;
}

// The instantiation of norm_rope_kernel a launch of T with a Cache runs,
// passed to f as its kFp8Q and kVector (std::bool_constant): q as fp8
// (never with a cache), the vector path (NormGrid.items > 0; never fp64),
// each with or without the other, or the element path alone. The launch and
// the host emulation both choose through it.
template <typename T, typename Cache, typename F>
inline void with_norm_kernel(const NormParams& n, const NormGrid& g, F&& f) {
  const auto with_fp8 = [&](auto fp8_q) {
    if constexpr (!std::is_same_v<T, double>) {
      if (g.items > 0) return f(fp8_q, std::true_type());
    }
    f(fp8_q, std::false_type());
  };
  if constexpr (std::is_void_v<Cache>) {
    if (n.q_scale != nullptr) return with_fp8(std::true_type());
  }
  with_fp8(std::false_type());
}

// (head, index) of flat item `first` of rows of `width` items, and the step
// to the next item `stride` on: subtraction only.
struct HeadWalk {
  int32_t h, i;
  ROTARY_HOST_DEVICE HeadWalk(int32_t first, int32_t width) : h(0), i(first) { wrap(width); }
  ROTARY_HOST_DEVICE void next(int32_t stride, int32_t width) {
    i += stride;
    wrap(width);
  }
  ROTARY_HOST_DEVICE void wrap(int32_t width) {
    while (i >= width) {
      i -= width;
      ++h;
    }
  }
};

}  // namespace kernel
}  // namespace rotary
