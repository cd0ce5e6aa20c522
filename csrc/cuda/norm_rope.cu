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
  const kernel::NormGrid g = kernel::norm_grid_for<T, Cache>(kv, blocks);
  const dim3 block(32, kernel::kNormWarps);
  const unsigned grid = static_cast<unsigned>(blocks);
  kernel::with_norm_kernel<T, Cache>(n, g, [&](auto fp8_q, auto vector) {
    kernel::norm_rope_kernel<T, decltype(fp8_q)::value, Cache, decltype(vector)::value>
        <<<grid, block, 0, stream>>>(kv, n, g);
  });
}

#define ROTARY_NORM_INSTANTIATE(T)                                                                              \
  template void launch_norm_rope<T, void>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t); \
  template void launch_norm_rope<T, T>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t);    \
  template void launch_norm_rope<T, uint8_t>(const kernel::KVCacheParams&, const kernel::NormParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_NORM_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
