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
