#include "norm_rope_kernel.cuh"
#include "norm_rope_launch.h"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace cuda {

template <typename T, typename Cache>
void launch_norm_rope(const kernel::KVCacheParams& kv, const kernel::NormParams& n, cudaStream_t stream) {
  const int64_t rows = kv.rope.batch * kv.rope.seq;
  if (rows == 0) return;
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 1;
  }
  const int64_t blocks = kernel::norm_blocks(rows, sms);
  const kernel::NormGrid g = kernel::norm_grid_for<T, Cache>(kv, n, blocks);
  const dim3 block(32, kernel::kNormWarps);
  const unsigned grid = static_cast<unsigned>(blocks);
  if constexpr (std::is_void_v<Cache>) {  // fp8 q is out of place, so never with a cache
    if (n.q_scale != nullptr) {  // never the vector path (norm_grid)
      kernel::norm_rope_kernel<T, true, void, false><<<grid, block, 0, stream>>>(kv, n, g);
      return;
    }
  }
  if constexpr (!std::is_same_v<T, double>) {  // fp64: never the vector path (norm_grid)
    if (g.items > 0) {
      kernel::norm_rope_kernel<T, false, Cache, true><<<grid, block, 0, stream>>>(kv, n, g);
      return;
    }
  }
  kernel::norm_rope_kernel<T, false, Cache, false><<<grid, block, 0, stream>>>(kv, n, g);
}

#define ROTARY_NORM_INSTANTIATE(T)                                                                              \
  template void launch_norm_rope<T, void>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t); \
  template void launch_norm_rope<T, T>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t);    \
  template void launch_norm_rope<T, uint8_t>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_NORM_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
