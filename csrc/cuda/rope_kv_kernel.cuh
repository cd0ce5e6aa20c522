// The fused KV-cache launch of apply_rope_with_kv_cache_: the RoPE kernel's
// rope_thread with a CacheSink, so one launch rotates q and k in place and
// writes k and v into their caches. Per row, the cache row is found once
// (slot or position); each rotated k vector goes to k and to the cache from
// the same registers (16-byte stores, kElems bytes for an fp8 cache). The
// rest of a row (k's pass-through dims, v) is copied kHeads heads at a time,
// loads before stores: after the rotation by the row's own threads, or,
// when every row fits in one wave (decode), by copy blocks beside it.
// Framework-free: the host emulation runs it over the whole grid. Caches
// that cannot be vector-addressed keep the two launches (can_fuse_cache,
// rope_kv_grid.cuh).
#pragma once

#include "kv_store.cuh"
#include "params/kv_params.h"
#include "rope_kernel.cuh"
#include "rope_kv_grid.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// Row (b, s)'s cache rows as element offsets; false when the token is not
// written.
ROTARY_HOST_DEVICE bool cache_rows(const KVCacheParams& p, int64_t b, int64_t s, int64_t& kc, int64_t& vc) {
  int64_t outer = 0, inner = 0;
  if (!cache_row(p, b, s, outer, inner)) return false;
  const KVRow row = kv_row(p, b, s, outer, inner);
  kc = row.kc;
  vc = row.vc;
  return true;
}

// Copies row (b, s)'s cache vectors that its rotation does not write:
// chunks [0, pass) are k's pass-through dims ([0, rotary_offset), then past
// the span) read from k_row (head stride k_head), the rest v's. The row's
// threads split them as they split pair groups and heads. kLoadsFirst (copy
// blocks): the first loads go out before the cache row is looked up, so
// the slot read shares their round trip; a rope row, whose registers hold
// its rotation's state, looks it up first (else it spills).
template <typename T, typename Cache, int kHeads, bool kLoadsFirst, typename Index>
ROTARY_HOST_DEVICE void copy_cache_row(const KVCacheParams& p, const T* k_row, Index k_head, int64_t b, int64_t s,
                                       int32_t group0, int32_t group_threads, Index chunk, Index chunks) {
  constexpr int kElems = CacheChunk<T, Cache>::kElems;
  int64_t kc = 0, vc = 0;
  bool found = !kLoadsFirst && cache_rows(p, b, s, kc, vc);
  if (!kLoadsFirst && !found) return;
  const T* const v = static_cast<const T*>(p.v) + (b * p.v_stride[0] + s * p.v_stride[2]);
  const RopeParams& r = p.rope;
  const int64_t heads = r.k.heads;
  const int64_t pass = (r.head_dim - r.rotary_dim) / kElems;
  const int64_t total = pass + p.v_dim / kElems;
#pragma unroll 1
  for (int64_t c = group0; c < total; c += group_threads) {
    const bool is_v = c >= pass;
    const int64_t from = (is_v ? c - pass : c) * kElems;
    const int64_t at = is_v || from < r.rotary_offset ? from : from + r.rotary_dim;
    // One source and one destination per chunk, chosen before the head loop
    // (two store sites let the compiler split the 16-byte stores).
    const T* src = (is_v ? v : k_row) + at;
    const int64_t src_head = is_v ? p.v_stride[1] : static_cast<int64_t>(k_head);
    Cache* const base = static_cast<Cache*>(is_v ? p.v_cache : p.k_cache) + at;
    const int64_t dst_head = is_v ? p.vc_stride[1] : p.kc_stride[1];
    const float* scale = is_v ? p.v_scale : p.k_scale;
    const int64_t scale_head = is_v ? p.v_scale_stride : p.k_scale_stride;
#pragma unroll 1
    for (int64_t h0 = chunk; h0 < heads; h0 += kHeads * static_cast<int64_t>(chunks)) {
      Vector x[kHeads];
      float scales[kHeads];  // copy blocks' fp8 scales, read with the data (not a trip after it)
#pragma unroll
      for (int i = 0; i < kHeads; ++i) {
        const int64_t h = h0 + i * static_cast<int64_t>(chunks);
        if (h < heads) {
          x[i] = load_stream(reinterpret_cast<const Vector*>(src + h * src_head));
          if constexpr (kLoadsFirst && !std::is_same_v<T, Cache>) scales[i] = scale ? scale[h * scale_head] : 1.0f;
        }
      }
      if (!found) {
        if (!cache_rows(p, b, s, kc, vc)) return;
        found = true;
      }
      Cache* const dst = base + (is_v ? vc : kc);
#pragma unroll
      for (int i = 0; i < kHeads; ++i) {
        const int64_t h = h0 + i * static_cast<int64_t>(chunks);
        if (h >= heads) continue;
        if constexpr (kLoadsFirst && !std::is_same_v<T, Cache>) {
          store_chunk<T, Cache>(dst + h * dst_head, x[i], scales[i], scale != nullptr);
        } else {
          store_chunk<T, Cache>(dst + h * dst_head, x[i], scale != nullptr ? scale + h * scale_head : nullptr);
        }
      }
    }
  }
}

// kRowsCopy: the rope rows copy the rest of their cache rows (else copy
// blocks do, copy_thread).
template <typename T, typename Cache, bool kRowsCopy = true>
struct CacheSink {
  static constexpr bool kOn = true;
  const KVCacheParams& p;
  // This row's k cache row at head 0, null when the token is not written.
  // Only it lives through the rotation (copy_row finds the rest again):
  // more would spill on the fp8 paths.
  Cache* kc = nullptr;
  // With copy blocks (no copy in the row, registers to spare), a per-tensor
  // fp8 scale read with the row's data, not a memory trip after the rotation.
  float k_scale = 1.0f;
  static constexpr bool kEarlyScale = !kRowsCopy && !std::is_same_v<T, Cache>;

  ROTARY_HOST_DEVICE explicit CacheSink(const KVCacheParams& params) : p(params) {}

  ROTARY_HOST_DEVICE void start_row(int64_t b, int64_t s, const TokenPlace& place) {
    int64_t outer = 0, inner = 0;
    kc = cache_row(p, b, s, place, outer, inner) ? static_cast<Cache*>(p.k_cache) + kv_row(p, b, s, outer, inner).kc
                                                 : nullptr;
    if constexpr (kEarlyScale) {
      if (p.k_scale != nullptr && p.k_scale_stride == 0) k_scale = *p.k_scale;
    }
  }

  // Rotated vector y of k head h at element offset `at`.
  ROTARY_HOST_DEVICE void put_k(int64_t h, int64_t at, const Vector& y) const {
    if (kc == nullptr) return;
    if constexpr (kEarlyScale) {
      if (p.k_scale_stride == 0) {
        store_chunk<T, Cache>(kc + (h * p.kc_stride[1] + at), y, k_scale, p.k_scale != nullptr);
        return;
      }
    }
    store_chunk<T, Cache>(kc + (h * p.kc_stride[1] + at), y, cache_scale(p, false, h));
  }

  // The rest of the row, after its rotation (nothing when copy blocks do it).
  template <int kHeads, typename Index>
  ROTARY_HOST_DEVICE void copy_row(const RowPointers<T, Index>& row, int64_t b, int64_t s, int32_t group0,
                                   int32_t group_threads, Index chunk, Index chunks) const {
    if (kRowsCopy && kc != nullptr) {
      copy_cache_row<T, Cache, kHeads, false>(p, row.in[1], row.in_head[1], b, s, group0, group_threads, chunk, chunks);
    }
  }
};

// Thread `tid` of copy block `block` of c: its row's share of
// copy_cache_row (one row per thread, no grid stride).
template <typename T, typename Cache, int kHeads>
ROTARY_HOST_DEVICE void copy_thread(const KVCacheParams& p, const CopyGrid& c, int64_t block, int32_t tid) {
  const int32_t row_in_block = tid / c.lanes;
  const int64_t r = block * c.rows_per_block + row_in_block;
  if (row_in_block >= c.rows_per_block || r >= c.rows) return;
  const int32_t lane = tid - row_in_block * c.lanes;
  const int64_t b = r / p.rope.seq, s = r - b * p.rope.seq;
  const HeadTensor& k = p.rope.k;
  const T* k_row = static_cast<const T*>(k.in) + (b * k.in_stride[0] + s * k.in_stride[2]);
  copy_cache_row<T, Cache, kHeads, true, int64_t>(p, k_row, k.in_stride[1], b, s, lane % c.group_threads,
                                            c.group_threads, lane / c.group_threads, c.chunks);
}

#if defined(__CUDACC__)
// Blocks [0, g.blocks) rotate and write k's cache rows. kCopyBlocks: the
// c.blocks after them copy the rest of the rows (use_copy_blocks); else the
// rope rows do. Two instantiations, not a run-time choice: a copy branch
// beside the row loop moved its register allocation (spills).
template <typename T, bool kInterleaved, typename Cache, typename Index, bool kCopyBlocks>
__global__ void __launch_bounds__(kMaxBlockThreads, kMinBlocks)
    rope_kv_kernel(const __grid_constant__ KVCacheParams p, const Grid g, const CopyGrid c) {
  const int32_t tid = static_cast<int32_t>(threadIdx.x);
  if constexpr (kCopyBlocks) {
    if (blockIdx.x >= g.blocks) {
      copy_thread<T, Cache, Tile<T, kInterleaved, true>::kHeads>(p, c, blockIdx.x - g.blocks, tid);
      return;
    }
  }
  rope_thread<T, kInterleaved, true, Index, DirectStore, CacheSink<T, Cache, !kCopyBlocks>>(
      p.rope, g, blockIdx.x, tid, CacheSink<T, Cache, !kCopyBlocks>(p));
}
#endif

}  // namespace kernel
}  // namespace rotary
