// Phase 3 of the prologue kernel with a cache (apply_qk_norm_rope_with_kv_cache_):
// a row's cache destination, and the write of its finished k and its v into
// the caches, element by element or, on the vector path with
// vector-addressable caches, as 16-byte vectors. Device and host-emulation
// code; no torch headers.
#pragma once

#include "kv_store.cuh"
#include "norm_grid.cuh"
#include "params/kv_params.h"
#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>

namespace rotary {
namespace kernel {

// A row's cache destination: its rows (kv_row) at cache_row's, found by one
// thread of the block while the row is normalized and shared through shared
// memory (a plain struct: __shared__ takes no initializers). write is false
// when the token is not written: slot -1, or a device-side slot or position
// outside the cache.
struct CacheDest {
  KVRow row;
  bool write;
};
ROTARY_HOST_DEVICE CacheDest cache_dest(const KVCacheParams& kv, int64_t b, int64_t s, const TokenPlace& place) {
  CacheDest d;
  int64_t outer = 0, inner = 0;
  d.write = cache_row(kv, b, s, place, outer, inner);
  d.row = kv_row(kv, b, s, outer, inner);
  return d;
}

// Phase 3 (with a cache): thread tid writes its elements of the row's k and
// v head rows into their cache rows at `dest`, as the element-wise cache
// kernel does; k is the row's finished output, read back after the block's
// barrier. Like phase 1 it loads kNormBatch elements (past the end, of head
// 0, never stored) before it stores any.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void norm_cache_row(const KVCacheParams& kv, const CacheDest& dest, int32_t tid, int32_t threads) {
  if (!dest.write) return;
  const int32_t dim = static_cast<int32_t>(kv_row_dim(kv));
  const int32_t heads = static_cast<int32_t>(kv.rope.k.heads);
  HeadWalk w(tid, dim);
  while (w.h < heads) {
    KVValues<T> x[kNormBatch];
    int32_t h[kNormBatch], i[kNormBatch];
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      h[j] = w.h;
      i[j] = w.i;
      x[j] = load_kv_element<T>(kv, dest.row, w.h < heads ? w.h : 0, w.i);
      if (w.h < heads) w.next(threads, dim);
    }
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      if (h[j] < heads) store_kv_element<T, Cache>(kv, dest.row, h[j], i[j], x[j]);
    }
  }
}

// Phase 3 of the vector path when the caches are vector-addressable
// (NormGrid.cache_vector): thread tid copies its 16-byte vectors of the
// row's k head rows (the finished output, after the block's barrier) and v
// head rows into their cache rows at `dest`, each as its cache chunk
// (store_chunk: a copy, or fp8 bytes), kNormCacheBatch loads before any
// store (past the end, of the row's first vector, never stored).
constexpr int kNormCacheBatch = 4;
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void norm_cache_vectors(
    const KVCacheParams& kv, const CacheDest& dest, int32_t tid, int32_t threads) {
  if (!dest.write) return;
  constexpr int32_t kElems = kVectorBytes / static_cast<int32_t>(sizeof(T));
  const RopeParams& r = kv.rope;
  const int32_t k_vectors = static_cast<int32_t>(r.head_dim) / kElems;
  const int32_t width = k_vectors + static_cast<int32_t>(kv.v_dim) / kElems;  // vectors a head
  const int32_t heads = static_cast<int32_t>(r.k.heads);
  const T* const k = static_cast<const T*>(r.k.out) + dest.row.k;
  const T* const v = static_cast<const T*>(kv.v) + dest.row.v;
  HeadWalk w(tid, width);
  while (w.h < heads) {
    Vector x[kNormCacheBatch];
    int32_t h[kNormCacheBatch], i[kNormCacheBatch];
#pragma unroll
    for (int j = 0; j < kNormCacheBatch; ++j) {
      const bool in = w.h < heads;
      h[j] = w.h;
      i[j] = w.i;
      const int32_t hh = in ? w.h : 0, ii = in ? w.i : 0;
      const T* src = ii < k_vectors ? k + hh * r.k.out_stride[1] + ii * kElems
                                    : v + hh * kv.v_stride[1] + (ii - k_vectors) * kElems;
      x[j] = load_stream(reinterpret_cast<const Vector*>(src));
      if (in) w.next(threads, width);
    }
#pragma unroll
    for (int j = 0; j < kNormCacheBatch; ++j) {
      if (h[j] >= heads) continue;
      const bool is_k = i[j] < k_vectors;
      Cache* dst = is_k ? static_cast<Cache*>(kv.k_cache) + dest.row.kc + h[j] * kv.kc_stride[1] + i[j] * kElems
                        : static_cast<Cache*>(kv.v_cache) + dest.row.vc + h[j] * kv.vc_stride[1] +
              (i[j] - k_vectors) * kElems;
      store_chunk<T, Cache>(dst, x[j], cache_scale(kv, !is_k, h[j]));
    }
  }
}

}  // namespace kernel
}  // namespace rotary
