// Framework-free CUDA kernel for RoPE: raw pointers, int64 strides, a stream.
// No torch headers, so this compiles in seconds with nvcc and, for the
// host-emulation test, with g++ (rope_thread is __host__ __device__).
//
// Work split: a token row (b, s) is owned by `lanes` threads of one block,
// which rotate every q and k head of it. A thread holds one pair group
// (16 bytes of pairs) and walks kHeads heads at a time: the first heads'
// loads go out before the cos/sin read (one memory round trip per row), cos
// and sin are read once per (row, group), and all kHeads loads are issued
// before any store (in and out may alias, so the compiler cannot reorder
// them itself). q and k stream through the caches, the table is kept in L2.
// With the loads of a row go L2 prefetches of the thread's next row: two
// rows of bytes in flight per thread, one of them in no register.
// Blocks hold whole rows and grid-stride over rows; the launch sizes the
// grid to resident blocks, rows spread evenly over its passes (even_grid).
// tests/sass/contract.py checks the result in SASS.
#pragma once

#include "params/rope_params.h"
#include "rope_grid.cuh"
#include "rope_rotations.cuh"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// The kernel's stores (16-byte vectors stream) and L2 prefetches; the
// host-emulation tests swap in ones that count writes and record prefetches.
struct DirectStore {
  template <typename V>
  ROTARY_HOST_DEVICE static void put(V* at, const V& v) {
    *at = v;
  }
  ROTARY_HOST_DEVICE static void put(Vector* at, const Vector& v) { store_stream(at, v); }
  ROTARY_HOST_DEVICE static void prefetch(const void* at) { prefetch_l2(at); }
};

// Where a row's rotated k goes besides k: nowhere in a plain launch. The
// fused KV-cache launch passes a CacheSink (rope_kv_kernel.cuh), which also
// takes each rotated k vector and copies the row's other cache dims.
struct NoSink {
  static constexpr bool kOn = false;
};

// Base pointers of one row (b, s) of q and k; head h adds h * stride[1].
template <typename T, typename Index>
struct RowPointers {
  const T* in[2];
  T* out[2];
  Index in_head[2], out_head[2], in_elem[2], out_elem[2];
  Index q_heads;

  ROTARY_HOST_DEVICE RowPointers(const RopeParams& p, Index b, Index s) : q_heads(static_cast<Index>(p.q.heads)) {
    set(0, p.q, b, s);
    set(1, p.k, b, s);
  }
  ROTARY_HOST_DEVICE void set(int i, const HeadTensor& t, Index b, Index s) {
    // An absent k (single-tensor op) keeps null pointers: no head reaches it.
    in[i] = t.heads == 0 ? nullptr
                         : static_cast<const T*>(t.in) +
            (b * static_cast<Index>(t.in_stride[0]) + s * static_cast<Index>(t.in_stride[2]));
    out[i] = t.heads == 0 ? nullptr
                          : static_cast<T*>(t.out) +
            (b * static_cast<Index>(t.out_stride[0]) + s * static_cast<Index>(t.out_stride[2]));
    in_head[i] = static_cast<Index>(t.in_stride[1]);
    out_head[i] = static_cast<Index>(t.out_stride[1]);
    in_elem[i] = static_cast<Index>(t.in_stride[3]);
    out_elem[i] = static_cast<Index>(t.out_stride[3]);
  }
  // Head h of q (h < q_heads) or of k (the rest).
  ROTARY_HOST_DEVICE const T* src(Index h) const {
    return h < q_heads ? in[0] + h * in_head[0] : in[1] + (h - q_heads) * in_head[1];
  }
  ROTARY_HOST_DEVICE T* dst(Index h) const {
    return h < q_heads ? out[0] + h * out_head[0] : out[1] + (h - q_heads) * out_head[1];
  }
  ROTARY_HOST_DEVICE Index src_elem(Index h) const { return h < q_heads ? in_elem[0] : in_elem[1]; }
  ROTARY_HOST_DEVICE Index dst_elem(Index h) const { return h < q_heads ? out_elem[0] : out_elem[1]; }
};

// A thread's next row (its grid-stride successor) as element offsets from
// this row in q and in k; `on` when there is one and the launch prefetches.
template <typename Index>
struct NextRow {
  Index delta_q = 0, delta_k = 0;  // two scalars: an array indexed at run time would live in local memory
  bool on = false;

  NextRow() = default;  // none
  // The next row after row (., s) of row block rb of p under grid g.
  ROTARY_HOST_DEVICE NextRow(const RopeParams& p, const Grid& g, int64_t rb, int32_t row_in_block, Index s) {
    const int64_t next = rb + g.blocks;
    if (!g.prefetch || next >= g.row_blocks || next * g.rows_per_block + row_in_block >= g.rows) return;
    int64_t db = g.step_b, ds = g.step_s;
    if (s + ds >= p.seq) {  // the step is below seq: one wrap at most
      ds -= p.seq;
      ++db;
    }
    // The difference of two offsets inside the tensor: it fits in Index.
    delta_q = static_cast<Index>(db * p.q.in_stride[0] + ds * p.q.in_stride[2]);
    delta_k = static_cast<Index>(db * p.k.in_stride[0] + ds * p.k.in_stride[2]);
    on = true;
  }
  ROTARY_HOST_DEVICE Index of(bool q) const { return q ? delta_q : delta_k; }
};

// Asks L2 for the line of the vector at `at` of the next row, once per line:
// by the thread whose vector opens it (a line a span starts inside of is
// read from DRAM when loaded, as without prefetch).
template <typename Store, typename T>
ROTARY_HOST_DEVICE void prefetch_vector(const T* at) {
  if (reinterpret_cast<uintptr_t>(at) % kLineBytes < static_cast<uintptr_t>(kVectorBytes)) Store::prefetch(at);
}

// Loads pair group (a0, a1) of heads h0, h0 + step, ... below `heads`; a0 and
// a1 are the element offsets of its first and second members. With `next`
// on, the vector paths also prefetch the same group of the next row.
template <typename T, bool kInterleaved, bool kVectorized, typename Index, typename Store>
ROTARY_HOST_DEVICE void load_heads(
    const RowPointers<T, Index>& row, const NextRow<Index>& next, Index h0, Index step, Index heads, Index a0,
    Index a1, HeadLoads<T, kInterleaved, kVectorized>& l) {
#pragma unroll
  for (int i = 0; i < Tile<T, kInterleaved, kVectorized>::kHeads; ++i) {
    const Index h = h0 + i * step;
    if (h < heads) {
      const T* src = row.src(h);
      if constexpr (kVectorized) {
        l.x[i][0] = load_stream(reinterpret_cast<const Vector*>(src + a0));
        if constexpr (!kInterleaved) l.x[i][1] = load_stream(reinterpret_cast<const Vector*>(src + a1));
        if (next.on) {
          const T* ahead = src + next.of(h < row.q_heads);
          prefetch_vector<Store>(ahead + a0);
          if constexpr (!kInterleaved) prefetch_vector<Store>(ahead + a1);
        }
      } else {
        const Index e = row.src_elem(h);
        l.x[i][0] = src[a0 * e];
        l.x[i][1] = src[a1 * e];
      }
    }
  }
}

// Rotates what load_heads loaded and stores it: every load of the group was
// issued before the first store (in and out may alias, so the compiler could
// not reorder them itself).
template <typename T, bool kInterleaved, bool kVectorized, typename Index, typename Store, typename Sink>
ROTARY_HOST_DEVICE void rotate_store(
    const RowPointers<T, Index>& row, Index h0, Index step, Index heads, Index a0, Index a1,
    const HeadLoads<T, kInterleaved, kVectorized>& l, const Sink& sink,
    const typename Acc<T>::type (&c)[Tile<T, kInterleaved, kVectorized>::kPairs],
    const typename Acc<T>::type (&sn)[Tile<T, kInterleaved, kVectorized>::kPairs]) {
  using acc_t = typename Acc<T>::type;
  constexpr int kPairs = Tile<T, kInterleaved, kVectorized>::kPairs;
#pragma unroll
  for (int i = 0; i < Tile<T, kInterleaved, kVectorized>::kHeads; ++i) {
    const Index h = h0 + i * step;
    if (h >= heads) continue;
    T* dst = row.dst(h);
    if constexpr (kVectorized && kInterleaved) {  // pair j is elements (2j, 2j+1) of the vector
      Vector y;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        acc_t x0, x1, y0, y1;
        Pairs<T>::get(l.x[i][0], j, x0, x1);
        rotate_pair<acc_t>(x0, x1, c[j], sn[j], y0, y1);
        Pairs<T>::put(y, j, y0, y1);
      }
      Store::put(reinterpret_cast<Vector*>(dst + a0), y);
      if constexpr (Sink::kOn) {
        if (h >= row.q_heads) sink.put_k(h - row.q_heads, a0, y);
      }
    } else if constexpr (kVectorized) {  // pair j is element j of the low and of the high vector
      Vector ylo, yhi;
#pragma unroll
      for (int j = 0; j < kPairs; j += 2) {
        acc_t lo0, lo1, hi0, hi1, ylo0, ylo1, yhi0, yhi1;
        Pairs<T>::get(l.x[i][0], j / 2, lo0, lo1);
        Pairs<T>::get(l.x[i][1], j / 2, hi0, hi1);
        rotate_pair<acc_t>(lo0, hi0, c[j], sn[j], ylo0, yhi0);
        rotate_pair<acc_t>(lo1, hi1, c[j + 1], sn[j + 1], ylo1, yhi1);
        Pairs<T>::put(ylo, j / 2, ylo0, ylo1);
        Pairs<T>::put(yhi, j / 2, yhi0, yhi1);
      }
      Store::put(reinterpret_cast<Vector*>(dst + a0), ylo);
      Store::put(reinterpret_cast<Vector*>(dst + a1), yhi);
      if constexpr (Sink::kOn) {
        if (h >= row.q_heads) {
          sink.put_k(h - row.q_heads, a0, ylo);
          sink.put_k(h - row.q_heads, a1, yhi);
        }
      }
    } else {
      static_assert(!Sink::kOn, "the fused cache write needs the vector path");
      acc_t y0, y1;
      rotate_pair<acc_t>(to_acc(l.x[i][0]), to_acc(l.x[i][1]), c[0], sn[0], y0, y1);
      const Index e = row.dst_elem(h);
      Store::put(dst + a0 * e, from_acc<T>(y0));
      Store::put(dst + a1 * e, from_acc<T>(y1));
    }
  }
}

// Copies one pass-through chunk (a vector, or one element) at offset `at` of
// heads h0, h0 + step, ...: loads first, then stores.
template <typename T, bool kVectorized, int kHeads, typename Index, typename Store>
ROTARY_HOST_DEVICE void copy_heads(const RowPointers<T, Index>& row, const NextRow<Index>& next, Index h0, Index step,
                                   Index heads, Index at) {
  using Chunk = std::conditional_t<kVectorized, Vector, T>;
  Chunk x[kHeads];
#pragma unroll
  for (int i = 0; i < kHeads; ++i) {
    const Index h = h0 + i * step;
    if (h >= heads) continue;
    if constexpr (kVectorized) {
      x[i] = load_stream(reinterpret_cast<const Vector*>(row.src(h) + at));
      if (next.on) prefetch_vector<Store>(row.src(h) + next.of(h < row.q_heads) + at);
    } else {
      x[i] = row.src(h)[at * row.src_elem(h)];
    }
  }
#pragma unroll
  for (int i = 0; i < kHeads; ++i) {
    const Index h = h0 + i * step;
    if (h < heads) Store::put(reinterpret_cast<Chunk*>(row.dst(h) + (kVectorized ? at : at * row.dst_elem(h))), x[i]);
  }
}

// A row's sequence as the next row's search start (-1: none).
ROTARY_HOST_DEVICE int32_t hint_of(const TokenPlace& place) {
  return place.sequence <= INT32_MAX ? static_cast<int32_t>(place.sequence) : -1;
}

// The body of one CUDA thread (thread `tid` of block `block` of grid g, as
// launched()), as a plain function of its indices so that a CPU test can
// run the whole grid and check the indexing without a GPU. Index is int32_t
// when fits_int32() holds, int64_t otherwise. A CacheSink makes it the fused
// KV-cache launch: per row, the cache row is found once, rotated k vectors go
// to it as they are stored, and the rest of the row (k's pass-through dims,
// v) is copied after the rotation.
template <typename T, bool kInterleaved, bool kVectorized, typename Index, typename Store = DirectStore,
          typename Sink = NoSink>
ROTARY_HOST_DEVICE void rope_thread(const RopeParams& p, const Grid& g, int64_t block, int32_t tid,
                                    Sink sink = Sink()) {
  using acc_t = typename Acc<T>::type;
  using TileT = Tile<T, kInterleaved, kVectorized>;
  const int32_t row_in_block = tid / g.lanes;
  if (row_in_block >= g.rows_per_block) return;
  const int32_t lane = tid - row_in_block * g.lanes;
  const int32_t group0 = lane % g.group_threads;
  const Index chunk = lane / g.group_threads;
  const Index heads = g.heads;
  const Index chunks = g.chunks;
  const Index half = static_cast<Index>(p.rotary_dim / 2);
  const Index off = static_cast<Index>(p.rotary_offset);
  const Index seq = static_cast<Index>(p.seq);
  // (b, s) of the thread's first row (one division per thread), then
  // advanced by the grid's step (kernel parameters, no registers): none per
  // row.
  const int64_t r0 = block * g.rows_per_block + row_in_block;
  Index b = static_cast<Index>(r0 / p.seq);
  Index s = static_cast<Index>(r0 - static_cast<int64_t>(b) * p.seq);
  // The packed sequence of the thread's last row: rows only move forward
  // (a varlen call is one batch), so the next row's search starts there.
  // The fused KV-cache kernels, at their register cap, search from scratch
  // (one more live register spills their fp8 instantiations).
  int32_t sequence = -1;

#pragma unroll 1
  for (int64_t rb = block; rb < g.row_blocks; rb += g.blocks) {
    if (rb * g.rows_per_block + row_in_block >= g.rows) return;  // only the last row block is partial
    const RowPointers<T, Index> row(p, b, s);
    NextRow<Index> next;
    if constexpr (TileT::kPrefetch) next = NextRow<Index>(p, g, rb, row_in_block, s);
    // The row's place (position, packed sequence, cache row) is looked up
    // once its first data loads are in flight: a varlen search then overlaps
    // their round trip. Only the position stays live.
    int64_t pos = 0;
    bool placed = false;
#pragma unroll 1
    for (int32_t group = group0; group < g.groups; group += g.group_threads) {
      if (group < g.rotary_groups) {
        if (chunk >= heads) continue;
        const Index j0 = static_cast<Index>(group) * TileT::kPairs;
        const Index a0 = off + (kInterleaved ? 2 * j0 : j0);
        const Index a1 = off + (kInterleaved ? 2 * j0 + 1 : j0 + half);
        // The first heads' loads go out before the table read: a row costs
        // one memory round trip, not two. cos/sin are read once per (row,
        // pair group) and used for every head.
        HeadLoads<T, kInterleaved, kVectorized> l;
        Index h0 = chunk;
        load_heads<T, kInterleaved, kVectorized, Index, Store>(row, next, h0, chunks, heads, a0, a1, l);
        if (!placed) {
          const TokenPlace place = place_of(p, b, s, Sink::kOn ? -1 : sequence);
          if constexpr (Sink::kOn) sink.start_row(b, s, place);
          pos = place.pos;
          sequence = hint_of(place);
          placed = true;
        }
        acc_t c[TileT::kPairs], sn[TileT::kPairs];
        load_rotations<acc_t, TileT::kPairs>(p, g.table_vector, b, s, pos, j0, c, sn);
#pragma unroll 1
        for (;;) {
          rotate_store<T, kInterleaved, kVectorized, Index, Store>(row, h0, chunks, heads, a0, a1, l, sink, c, sn);
          h0 += TileT::kHeads * chunks;
          if (h0 >= heads) break;
          load_heads<T, kInterleaved, kVectorized, Index, Store>(row, next, h0, chunks, heads, a0, a1, l);
        }
      } else {
        // Pass-through dims: [0, off), then [off + rotary_dim, head_dim).
        const Index from = (group - g.rotary_groups) * TileT::kCopyElems;
        const Index at = from < off ? from : from + static_cast<Index>(p.rotary_dim);
#pragma unroll 1
        for (Index h0 = chunk; h0 < heads; h0 += TileT::kHeads * chunks) {
          copy_heads<T, kVectorized, TileT::kHeads, Index, Store>(row, next, h0, chunks, heads, at);
        }
      }
    }
    if constexpr (Sink::kOn) {
      if (!placed) sink.start_row(b, s, place_of(p, b, s));
      sink.template copy_row<TileT::kHeads>(row, b, s, group0, g.group_threads, chunk, chunks);
    }
    b += static_cast<Index>(g.step_b);
    s += static_cast<Index>(g.step_s);
    if (s >= seq) {
      s -= seq;
      ++b;
    }
  }
}

#if defined(__CUDACC__)
// __grid_constant__: p.pair_axis[j] is indexed at run time; it is read from
// the parameter space instead of copying the struct to local memory.
// Two resident blocks per SM cap registers at 128: the vector paths keep
// 128 bytes of loads in flight per thread without spilling. At three (80
// registers) they spill to local memory; the SASS contract
// (tests/sass/contract.py) checks both.
constexpr int kMinBlocks = 2;

template <typename T, bool kInterleaved, bool kVectorized, typename Index>
__global__ void __launch_bounds__(kMaxBlockThreads, kMinBlocks) rope_kernel(const __grid_constant__ RopeParams p, const Grid g) {
  rope_thread<T, kInterleaved, kVectorized, Index>(p, g, blockIdx.x, static_cast<int32_t>(threadIdx.x));
}
#endif

}  // namespace kernel
}  // namespace rotary
