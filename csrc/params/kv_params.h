// Framework-free description of the KV-cache write that follows the rotation
// in rotary::apply_rope_with_kv_cache_. No torch headers: the CUDA kernel
// and its host-emulation test include this file.
#pragma once

#include "fp8.h"
#include "rope_params.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace rotary {
namespace kernel {

struct KVCacheParams {
  // Token positions, varlen boundaries and the head counts of the call;
  // rope.k describes k after its in-place rotation.
  RopeParams rope;
  // v read as [batch, heads, seq, v_dim], like k but for its head_dim (MLA's
  // v_head_dim); the v cache's rows are v_dim wide.
  const void* v = nullptr;
  int64_t v_stride[4] = {0, 0, 0, 0};
  int64_t v_dim = 0;
  // Caches seen as [outer, heads, inner, head_dim]: contiguous caches are
  // [batch, heads, S_max, D] (outer = sequence, inner = position), paged ones
  // [num_blocks, heads, block_size, D] (slot = outer * block_size + inner).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t kc_stride[4] = {0, 0, 0, 0};
  int64_t vc_stride[4] = {0, 0, 0, 0};
  int64_t outer = 0;
  int64_t inner = 0;
  bool paged = false;

  // Where token (b, s) goes: slot_mapping (paged) or cache_positions
  // (contiguous), int32 or int64, read at b * stride_b + s * stride_s.
  // Without one, a contiguous cache takes the token's rotary position.
  const void* dest = nullptr;
  bool dest_int32 = false;
  int64_t dest_stride_b = 0;
  int64_t dest_stride_s = 0;

  // float8_e4m3fn caches hold round_to_fp8(x / scale); scales are float32,
  // one per tensor (stride 0) or one per head; null: 1.
  bool fp8 = false;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t k_scale_stride = 0;
  int64_t v_scale_stride = 0;
};

ROTARY_HOST_DEVICE int64_t dest_entry(const KVCacheParams& p, int64_t b, int64_t s) {
  const int64_t i = b * p.dest_stride_b + s * p.dest_stride_s;
  return p.dest_int32 ? static_cast<const int32_t*>(p.dest)[i] : static_cast<const int64_t*>(p.dest)[i];
}

// The cache row of token (b, s). False when the token is not written: slot
// -1, or a device-side slot or position outside the cache (those raise on
// the host before the launch; on the device they are skipped, never written
// out of bounds).
// `place` is place_of(p.rope, b, s) (unread for paged caches).
ROTARY_HOST_DEVICE bool cache_row(const KVCacheParams& p, int64_t b, int64_t s, const TokenPlace& place,
                                  int64_t& outer, int64_t& inner) {
  if (p.paged) {
    const int64_t slot = dest_entry(p, b, s);
    if (slot < 0 || slot >= p.outer * p.inner) return false;
    outer = slot / p.inner;
    inner = slot % p.inner;
    return true;
  }
  outer = place.sequence;
  inner = p.dest != nullptr ? dest_entry(p, b, s) : place.pos;
  return outer < p.outer && inner >= 0 && inner < p.inner;
}
ROTARY_HOST_DEVICE bool cache_row(const KVCacheParams& p, int64_t b, int64_t s, int64_t& outer, int64_t& inner) {
  return cache_row(p, b, s, p.paged ? TokenPlace() : place_of(p.rope, b, s), outer, inner);
}

// One element into the cache: a copy in the same dtype, or quantize_fp8 of
// it (16-bit inputs are not rounded to their own dtype first).
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_cache(Cache* dst, const T& x, const float* scale) {
  if constexpr (sizeof(Cache) == 1 && sizeof(T) != 1) {
    using acc_t = typename std::conditional<sizeof(T) == 8, double, float>::type;
    *dst = quantize_fp8(static_cast<acc_t>(x), scale);
  } else {
    *dst = x;
  }
}

// The fp8 scale of head h of k's cache (v: of v's), null when it has none.
ROTARY_HOST_DEVICE const float* cache_scale(const KVCacheParams& p, bool v, int64_t h) {
  const float* s = v ? p.v_scale : p.k_scale;
  return s != nullptr ? s + h * (v ? p.v_scale_stride : p.k_scale_stride) : nullptr;
}

// The elements of a head row the write covers: k's head_dim and v's v_dim.
ROTARY_HOST_DEVICE int64_t kv_row_dim(const KVCacheParams& p) {
  return p.rope.head_dim > p.v_dim ? p.rope.head_dim : p.v_dim;
}

// Token (b, s)'s rows as element offsets: k (already rotated) and v where
// they are read, and their cache rows at (outer, inner) from cache_row.
// Found once per token; each head and element adds only its own strides.
struct KVRow {
  int64_t k, v, kc, vc;
};
ROTARY_HOST_DEVICE KVRow kv_row(const KVCacheParams& p, int64_t b, int64_t s, int64_t outer, int64_t inner) {
  const RopeParams& r = p.rope;
  KVRow row;
  row.k = b * r.k.out_stride[0] + s * r.k.out_stride[2];
  row.v = b * p.v_stride[0] + s * p.v_stride[2];
  row.kc = outer * p.kc_stride[0] + inner * p.kc_stride[2];
  row.vc = outer * p.vc_stride[0] + inner * p.vc_stride[2];
  return row;
}

// Element d of head h of a token's k and v rows, read where d is inside
// each row; past a row's end its first element is read instead (and not
// stored), so that a batch of these loads can go out unconditionally.
template <typename T>
struct KVValues {
  T k, v;
};
template <typename T>
ROTARY_HOST_DEVICE KVValues<T> load_kv_element(const KVCacheParams& p, const KVRow& row, int64_t h, int64_t d) {
  const RopeParams& r = p.rope;
  KVValues<T> x;
  x.k = static_cast<const T*>(r.k.out)[row.k + h * r.k.out_stride[1] + (d < r.head_dim ? d : 0) * r.k.out_stride[3]];
  x.v = p.v_dim > 0 ? static_cast<const T*>(p.v)[row.v + h * p.v_stride[1] + (d < p.v_dim ? d : 0) * p.v_stride[3]]
                    : x.k;
  return x;
}

// Those values into the caches, each where d is inside its row.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_kv_element(
    const KVCacheParams& p, const KVRow& row, int64_t h, int64_t d, const KVValues<T>& x) {
  if (d < p.rope.head_dim) {
    store_cache<T, Cache>(static_cast<Cache*>(p.k_cache) + row.kc + h * p.kc_stride[1] + d * p.kc_stride[3], x.k,
                          cache_scale(p, false, h));
  }
  if (d < p.v_dim) {
    store_cache<T, Cache>(static_cast<Cache*>(p.v_cache) + row.vc + h * p.vc_stride[1] + d * p.vc_stride[3], x.v,
                          cache_scale(p, true, h));
  }
}

// Element d of head h of a token's rows, k and v, into their caches. The
// CPU loop and the element-wise CUDA kernel call this; the prologue kernel
// loads a batch before it stores one.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void write_kv_element(const KVCacheParams& p, const KVRow& row, int64_t h, int64_t d) {
  store_kv_element<T, Cache>(p, row, h, d, load_kv_element<T>(p, row, h, d));
}

}  // namespace kernel
}  // namespace rotary
