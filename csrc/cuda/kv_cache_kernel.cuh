// Framework-free CUDA kernel of the KV-cache write of
// apply_rope_with_kv_cache_: one thread per element of a head row of k
// (rotated in place just before, on the same stream) and of v (MLA's v rows
// may be narrower or wider than k's). Each thread's body is
// __host__ __device__, so a CPU test runs the whole grid with no GPU.
#pragma once

#include "params/kv_params.h"

#include <cstdint>

namespace rotary {
namespace kernel {

inline int64_t kv_cache_threads(const KVCacheParams& p) {
  return p.rope.batch * p.rope.seq * p.rope.k.heads * kv_row_dim(p);
}

// Thread i: element d (fastest, so a warp writes neighbouring bytes) of head
// h of token t = b * seq + s. A token whose slot is -1 or out of range
// (device-side values are not checked before the launch) writes nothing.
template <typename T, typename Cache>
ROTARY_HOST_DEVICE void kv_cache_thread(const KVCacheParams& p, int64_t i) {
  const int64_t dim = kv_row_dim(p);
  const int64_t d = i % dim;
  const int64_t h = (i / dim) % p.rope.k.heads;
  const int64_t t = i / (dim * p.rope.k.heads);
  const int64_t b = t / p.rope.seq, s = t % p.rope.seq;
  int64_t outer = 0, inner = 0;
  if (!cache_row(p, b, s, outer, inner)) return;
  write_kv_element<T, Cache>(p, kv_row(p, b, s, outer, inner), h, d);
}

#if defined(__CUDACC__)
template <typename T, typename Cache>
__global__ void kv_cache_kernel(const KVCacheParams p, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    kv_cache_thread<T, Cache>(p, i);
  }
}
#endif

}  // namespace kernel
}  // namespace rotary
