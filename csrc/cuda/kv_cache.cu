#include "kv_cache_kernel.cuh"
#include "kv_cache_launch.h"
#include "rope_vector.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace rotary {
namespace cuda {

template <typename T, typename Cache>
void launch_kv_cache(const kernel::KVCacheParams& p, cudaStream_t stream) {
  const int64_t n = kernel::kv_cache_threads(p);
  if (n == 0) return;
  constexpr int kThreads = 256;
  // Grid-stride beyond 2^20 blocks: enough to fill any GPU.
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20);
  kernel::kv_cache_kernel<T, Cache><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, n);
}

#define ROTARY_KV_INSTANTIATE(T)                                                        \
  template void launch_kv_cache<T, T>(const kernel::KVCacheParams&, cudaStream_t);       \
  template void launch_kv_cache<T, uint8_t>(const kernel::KVCacheParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_KV_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
