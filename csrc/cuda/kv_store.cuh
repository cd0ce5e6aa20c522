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

// x into the cache at `at`: a copy, or quantize_fp8 of each element (the same
// bits as the element-wise write, which reads k after its rounding to T).
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void store_chunk(Cache* at, const Vector& x, const float* scale) {
  using Chunk = CacheChunk<T, Cache>;
  if constexpr (std::is_same_v<T, Cache>) {
    store_vector(reinterpret_cast<Vector*>(at), x);
  } else {
    using acc_t = typename Acc<T>::type;
    using W = typename Chunk::type;
    const bool scaled = scale != nullptr;
    const float value = scaled ? *scale : 1.0f;
    W word = 0;
#pragma unroll
    for (int k = 0; k < Chunk::kElems / 2; ++k) {
      acc_t a, b;
      Pairs<T>::get(x, k, a, b);
      word |= static_cast<W>(static_cast<W>(quantize_fp8<acc_t>(a, scaled, value)) << (16 * k));
      word |= static_cast<W>(static_cast<W>(quantize_fp8<acc_t>(b, scaled, value)) << (16 * k + 8));
    }
    *reinterpret_cast<W*>(at) = word;
  }
}

}  // namespace kernel
}  // namespace rotary
