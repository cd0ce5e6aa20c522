// The launch description of the CUDA RoPE kernel: the work split (Tile),
// the grid (Grid, make_grid), the index width and vectorization choices, and
// the LaunchShape the launch model reads. Host code only, no device code and
// no torch headers: the launch, the host emulation and rotary._C's launch
// model all include it.
#pragma once

#include "params/launch_switches.h"
#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

constexpr int kMaxBlockThreads = 256;

// True when the cos/sin of `pairs` pairs from an even pair index are one
// aligned float4 read per two pairs (load_rotations' fast path).
inline bool table_rows_vector(const RopeParams& p, int pairs) {
  return pairs % 2 == 0 && p.freqs_stride_pair == 1 && p.freqs_stride_pos % 2 == 0 &&
      reinterpret_cast<uintptr_t>(p.freqs) % 16 == 0;
}

// One pair group of one head as loaded: a vector (interleaved), a vector
// from each half (half split), or one pair (strided path).
template <typename T, bool kInterleaved, bool kVectorized>
struct Tile {
  static constexpr int kElems = kVectorBytes / static_cast<int>(sizeof(T));
  static constexpr int kPairs = !kVectorized ? 1 : (kInterleaved ? kElems / 2 : kElems);
  static constexpr int kCopyElems = kVectorized ? kElems : 1;  // per pass-through group
  // Heads a thread has in flight: 128 bytes of loads on the vector paths.
  static constexpr int kHeads = !kVectorized ? 4 : (kInterleaved ? 8 : 4);
  // The vector paths prefetch the next row, but for float64 interleaved:
  // eight heads of it fill the register cap, and the next row's offsets
  // spill its int64-index instantiation.
  static constexpr bool kPrefetch = kVectorized && !(sizeof(T) == 8 && kInterleaved);
};

// The operands of one pair group of up to kHeads heads, as a thread loads
// them: a vector (interleaved) or a vector from each half (half split), or
// one pair.
template <typename T, bool kInterleaved, bool kVectorized>
struct HeadLoads {
  using Elem = std::conditional_t<kVectorized, Vector, T>;
  static constexpr int kSlots = kVectorized && kInterleaved ? 1 : 2;
  Elem x[Tile<T, kInterleaved, kVectorized>::kHeads][kSlots];
};

// Launch shape, computed once on the host. Threads of a row: `group_threads`
// across pair groups (fastest, so neighbours touch neighbouring bytes) times
// `chunks` across heads. Groups [0, rotary_groups) rotate; the rest copy the
// pass-through dims around [rotary_offset, rotary_offset + rotary_dim) (none
// in place).
struct Grid {
  int32_t rotary_groups = 0;
  int32_t groups = 0;
  int32_t group_threads = 0;
  int32_t chunks = 0;
  int32_t lanes = 0;  // group_threads * chunks
  int32_t rows_per_block = 0;
  int32_t block_threads = 0;  // rows_per_block * lanes
  int32_t heads = 0;          // q heads + k heads
  int64_t rows = 0;           // batch * seq
  int64_t row_blocks = 0;     // ceil(rows / rows_per_block)
  bool table_vector = false;  // a row of the table is readable as aligned float4
  // Set by launched() (make_grid: one block per row block): the blocks and
  // the (b, s) step of the grid-stride loop, so a thread advances without
  // dividing.
  int64_t blocks = 0;
  int64_t step_b = 0;
  int64_t step_s = 0;
  // Whether a thread asks L2 for its next row's q/k lines while it loads
  // this row's (vector paths, when l2_prefetch() and the grid strides).
  bool prefetch = false;
};

// Blocks of a launch over row_blocks with `resident` blocks resident at once:
// the passes of the grid-stride loop that `resident` blocks would take, with
// the row blocks spread evenly over them (no last pass with a third of the
// blocks, bytes in flight for a third of the bandwidth).
inline int64_t even_grid(int64_t row_blocks, int64_t resident) {
  if (row_blocks <= resident) return row_blocks;
  const int64_t passes = (row_blocks + resident - 1) / resident;
  return (row_blocks + passes - 1) / passes;
}

// Grid g of p as launched with `blocks` blocks (1 to row_blocks), prefetching
// each thread's next row or not.
inline Grid launched(const RopeParams& p, Grid g, int64_t blocks, bool prefetch = false) {
  g.blocks = blocks;
  g.prefetch = prefetch && blocks < g.row_blocks;
  const int64_t step = blocks * g.rows_per_block;
  g.step_b = p.seq > 0 ? step / p.seq : 0;
  g.step_s = step - g.step_b * p.seq;
  return g;
}

template <typename T, bool kInterleaved, bool kVectorized>
inline Grid make_grid(const RopeParams& p) {
  using TileT = Tile<T, kInterleaved, kVectorized>;
  Grid g;
  g.rotary_groups = static_cast<int32_t>((p.rotary_dim / 2) / TileT::kPairs);
  g.groups = g.rotary_groups + static_cast<int32_t>(p.in_place ? 0 : (p.head_dim - p.rotary_dim) / TileT::kCopyElems);
  g.heads = static_cast<int32_t>(p.q.heads + p.k.heads);
  g.rows = p.batch * p.seq;
  if (g.groups == 0 || g.heads == 0 || g.rows == 0) return g;
  g.group_threads = g.groups < kMaxBlockThreads ? g.groups : kMaxBlockThreads;
  const int32_t want_chunks = (g.heads + TileT::kHeads - 1) / TileT::kHeads;
  const int32_t max_chunks = kMaxBlockThreads / g.group_threads;
  g.chunks = want_chunks < max_chunks ? want_chunks : max_chunks;
  g.lanes = g.group_threads * g.chunks;
  // Rows per block: the count that wastes the fewest threads in partial warps
  // (ties: more rows).
  int32_t best = 1;
  int64_t best_waste = 1 << 30;
  for (int32_t r = 1; r * g.lanes <= kMaxBlockThreads && r <= g.rows; ++r) {
    const int32_t t = r * g.lanes;
    const int64_t waste = static_cast<int64_t>((t + 31) / 32 * 32 - t) * 1024 / t;
    if (waste <= best_waste) {
      best = r;
      best_waste = waste;
    }
  }
  g.rows_per_block = best;
  g.block_threads = best * g.lanes;
  g.row_blocks = (g.rows + best - 1) / best;
  g.table_vector = table_rows_vector(p, TileT::kPairs);
  return launched(p, g, g.row_blocks);  // one block per row block until a launch says otherwise
}

// True when every element offset of q and k (in and out), every row index and
// every thread index of the grid fits in int32: the kernel then does its
// index math in 32 bits.
inline bool fits_int32(const RopeParams& p, const Grid& g) {
  constexpr int64_t kMax = (int64_t{1} << 31) - 1;
  auto span = [&](const int64_t* stride, int64_t heads) {
    const int64_t sizes[4] = {p.batch, heads, p.seq, p.head_dim};
    int64_t last = 0;
    for (int d = 0; d < 4; ++d) {
      const int64_t st = stride[d] < 0 ? -stride[d] : stride[d];
      if (sizes[d] > 0) last += (sizes[d] - 1) * st;
    }
    return last;
  };
  for (const HeadTensor* t : {&p.q, &p.k}) {
    if (t->heads == 0) continue;
    if (span(t->in_stride, t->heads) > kMax || span(t->out_stride, t->heads) > kMax) return false;
  }
  return g.rows < kMax / 2;
}

// True when every load and store of q and k, of elements of elem_bytes, can
// be one aligned 16-byte vector.
inline bool can_vectorize(const RopeParams& p, int64_t elem_bytes) {
  const int64_t kElems = kVectorBytes / elem_bytes;
  const int64_t span = p.interleaved ? p.rotary_dim : p.rotary_dim / 2;
  if (span % kElems != 0 || (p.head_dim - p.rotary_dim) % kElems != 0 || p.rotary_offset % kElems != 0) return false;
  auto aligned = [elem_bytes](const HeadTensor& t) {
    if (t.heads == 0) return true;
    if (t.in_stride[3] != 1 || t.out_stride[3] != 1) return false;
    if (reinterpret_cast<uintptr_t>(t.in) % kVectorBytes != 0) return false;
    if (reinterpret_cast<uintptr_t>(t.out) % kVectorBytes != 0) return false;
    for (int d = 0; d < 3; ++d) {
      if ((t.in_stride[d] * elem_bytes) % kVectorBytes != 0) return false;
      if ((t.out_stride[d] * elem_bytes) % kVectorBytes != 0) return false;
    }
    return true;
  };
  return aligned(p.q) && aligned(p.k);
}
template <typename T>
inline bool can_vectorize(const RopeParams& p) {
  return can_vectorize(p, sizeof(T));
}

// What one call launches: the instantiation and its grid. The launch
// (rope_cuda.cu) runs what it says, and the launch model
// (benchmarks/launch_model.py) reads it through rotary._C.
struct LaunchShape {
  bool vectorized = false;
  bool int32 = false;
  bool prefetch = false;   // the instantiation prefetches next rows (Tile::kPrefetch) and l2_prefetch() is on
  int32_t load_bytes = 0;  // q/k bytes one thread has in flight per round trip
  Grid grid;
};

template <typename T, bool kInterleaved, bool kVectorized>
inline LaunchShape shape_of(const RopeParams& p) {
  LaunchShape s;
  s.vectorized = kVectorized;
  s.prefetch = Tile<T, kInterleaved, kVectorized>::kPrefetch && l2_prefetch();
  s.grid = make_grid<T, kInterleaved, kVectorized>(p);
  s.int32 = fits_int32(p, s.grid);
  s.load_bytes = static_cast<int32_t>(sizeof(HeadLoads<T, kInterleaved, kVectorized>));
  return s;
}

template <typename T>
inline LaunchShape launch_shape(const RopeParams& p) {
  const bool vectorized = can_vectorize<T>(p);
  if (p.interleaved) return vectorized ? shape_of<T, true, true>(p) : shape_of<T, true, false>(p);
  return vectorized ? shape_of<T, false, true>(p) : shape_of<T, false, false>(p);
}

}  // namespace kernel
}  // namespace rotary
