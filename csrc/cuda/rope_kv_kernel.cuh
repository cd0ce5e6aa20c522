// The fused KV-cache launch of apply_rope_with_kv_cache_: the RoPE kernel's
// rope_thread with a CacheSink, so one launch rotates q and k in place and
// writes k and v into their caches. Per row, the cache row is found once
// (slot or position); each rotated k vector goes to k and to the cache from
// the same registers (16-byte stores, kElems bytes for an fp8 cache); after
// the rotation the row's threads copy k's pass-through dims and v, heads
// kHeads at a time, loads before stores. Framework-free: the host emulation
// runs it over the whole grid. Caches that cannot be vector-addressed keep
// the two launches (can_fuse_cache, rope_kv_grid.cuh).
#pragma once

#include "kv_store.cuh"
#include "params/kv_params.h"
#include "rope_kernel.cuh"
#include "rope_kv_grid.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

template <typename T, typename Cache>
struct CacheSink {
  static constexpr bool kOn = true;
  static constexpr int kElems = CacheChunk<T, Cache>::kElems;
  const KVCacheParams& p;
  // This row's k cache row at head 0, null when the token is not written.
  // Only it lives through the rotation (copy_row finds the v side again):
  // more would spill on the fp8 paths.
  Cache* kc = nullptr;

  ROTARY_HOST_DEVICE explicit CacheSink(const KVCacheParams& params) : p(params) {}

  ROTARY_HOST_DEVICE void start_row(int64_t b, int64_t s, const TokenPlace& place) {
    int64_t outer = 0, inner = 0;
    kc = cache_row(p, b, s, place, outer, inner)
        ? static_cast<Cache*>(p.k_cache) + (outer * p.kc_stride[0] + inner * p.kc_stride[2])
        : nullptr;
  }

  // Rotated vector y of k head h at element offset `at`.
  ROTARY_HOST_DEVICE void put_k(int64_t h, int64_t at, const Vector& y) const {
    if (kc == nullptr) return;
    store_chunk<T, Cache>(kc + (h * p.kc_stride[1] + at), y, cache_scale(p, false, h));
  }

  // The row's other cache vectors: chunks [0, pass) are k's pass-through
  // dims ([0, rotary_offset), then past the span), the rest v's. The row's
  // threads split them as they split pair groups and heads. The cache row
  // is looked up again (keeping start_row's live through the rotation would
  // spill).
  template <int kHeads, typename Index>
  ROTARY_HOST_DEVICE void copy_row(const RowPointers<T, Index>& row, int64_t b, int64_t s, int32_t group0,
                                   int32_t group_threads, Index chunk, Index chunks) const {
    int64_t outer = 0, inner = 0;
    if (kc == nullptr || !cache_row(p, b, s, outer, inner)) return;
    Cache* const vc = static_cast<Cache*>(p.v_cache) + (outer * p.vc_stride[0] + inner * p.vc_stride[2]);
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
      // One source and one destination per chunk, chosen before the head
      // loop (two store sites let the compiler split the 16-byte stores).
      const T* src = (is_v ? v : row.in[1]) + at;
      const int64_t src_head = is_v ? p.v_stride[1] : static_cast<int64_t>(row.in_head[1]);
      Cache* dst = (is_v ? vc : kc) + at;
      const int64_t dst_head = is_v ? p.vc_stride[1] : p.kc_stride[1];
      const float* scale = is_v ? p.v_scale : p.k_scale;
      const int64_t scale_head = is_v ? p.v_scale_stride : p.k_scale_stride;
#pragma unroll 1
      for (int64_t h0 = chunk; h0 < heads; h0 += kHeads * static_cast<int64_t>(chunks)) {
        Vector x[kHeads];
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const int64_t h = h0 + i * static_cast<int64_t>(chunks);
          if (h < heads) x[i] = load_stream(reinterpret_cast<const Vector*>(src + h * src_head));
        }
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const int64_t h = h0 + i * static_cast<int64_t>(chunks);
          if (h >= heads) continue;
          store_chunk<T, Cache>(dst + h * dst_head, x[i], scale != nullptr ? scale + h * scale_head : nullptr);
        }
      }
    }
  }
};

#if defined(__CUDACC__)
template <typename T, bool kInterleaved, typename Cache, typename Index>
__global__ void __launch_bounds__(kMaxBlockThreads, kMinBlocks)
    rope_kv_kernel(const __grid_constant__ KVCacheParams p, const Grid g) {
  rope_thread<T, kInterleaved, true, Index, DirectStore, CacheSink<T, Cache>>(
      p.rope, g, blockIdx.x, static_cast<int32_t>(threadIdx.x), CacheSink<T, Cache>(p));
}
#endif

}  // namespace kernel
}  // namespace rotary
