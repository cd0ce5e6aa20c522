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

// The fp8 bytes of x's elements as the cache's chunk word; each element's
// quantize_fp8 with `scale` (an Fp8Scale, or its pointer).
template <typename T, typename Cache, typename Scale>
ROTARY_HOST_DEVICE typename CacheChunk<T, Cache>::type fp8_chunk(const Vector& x, const Scale& scale) {
  using acc_t = typename Acc<T>::type;
  using W = typename CacheChunk<T, Cache>::type;
  W word = 0;
#pragma unroll
  for (int k = 0; k < CacheChunk<T, Cache>::kElems / 2; ++k) {
    acc_t a, b;
    Pairs<T>::get(x, k, a, b);
    word |= static_cast<W>(static_cast<W>(quantize_fp8<acc_t>(a, scale)) << (16 * k));
    word |= static_cast<W>(static_cast<W>(quantize_fp8<acc_t>(b, scale)) << (16 * k + 8));
  }
  return word;
}

// x into the cache at `at`: a copy, or quantize_fp8 of each element (the same
// bits as the element-wise write, which reads k after its rounding to T),
// the chunk's scale read once.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_chunk(Cache* at, const Vector& x, const float* scale) {
  using Chunk = CacheChunk<T, Cache>;
  if constexpr (std::is_same_v<T, Cache>) {
    store_vector(reinterpret_cast<Vector*>(at), x);
  } else {
    // A scale outside Fp8Scale's reciprocal range divides each element, on a
    // branch of its own: the hot path holds no division.
    const Fp8Scale<typename Acc<T>::type> divisor(scale);
    *reinterpret_cast<typename Chunk::type*>(at) =
        divisor.reciprocal ? fp8_chunk<T, Cache>(x, divisor) : fp8_chunk<T, Cache>(x, scale);
  }
}

}  // namespace kernel
}  // namespace rotary
