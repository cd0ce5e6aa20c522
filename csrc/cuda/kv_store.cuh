// 16-byte vectors of k and v into a KV cache as its chunks (a copy, or fp8
// bytes): the fused KV-cache launch and the prologue's vector cache write.
// Device and host-emulation code; no torch headers.
#pragma once

#include "params/fp8.h"
#include "rope_kv_grid.cuh"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// The fp8 bytes of x's elements as the cache's chunk word, each element's
// quantize_fp8.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE typename CacheChunk<T, Cache>::type fp8_chunk(
    const Vector& x, const Fp8Scale<typename Acc<T>::type>& scale) {
  using acc_t = typename Acc<T>::type;
  using W = typename CacheChunk<T, Cache>::type;
  W word = 0;
#pragma unroll
  for (int k = 0; k < CacheChunk<T, Cache>::kElems / 2; ++k) {
    acc_t a, b;
    Pairs<T>::get(x, k, a, b);
    word |= fp8_pair<W>(k, a, b, scale);
  }
  return word;
}

// x into the cache at `at`: a copy, or quantize_fp8 of each element by the
// scale's value (`scaled` false: none), the same bits as the element-wise
// write (which reads k after its rounding to T); on the GPU without a
// division or a branch per element.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_chunk(Cache* at, const Vector& x, float scale, bool scaled) {
  if constexpr (std::is_same_v<T, Cache>) {
    store_vector(reinterpret_cast<Vector*>(at), x);
  } else {
    *reinterpret_cast<typename CacheChunk<T, Cache>::type*>(at) =
        fp8_chunk<T, Cache>(x, Fp8Scale<typename Acc<T>::type>(scale, scaled));
  }
}
// The same, the scale read here (null: none; a same-dtype cache reads none).
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_chunk(Cache* at, const Vector& x, const float* scale) {
  store_chunk<T, Cache>(at, x, std::is_same_v<T, Cache> || scale == nullptr ? 1.0f : *scale, scale != nullptr);
}

}  // namespace kernel
}  // namespace rotary
