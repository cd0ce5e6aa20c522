#include "norm_rope_kernel.cuh"
#include "norm_rope_launch.h"

#include <algorithm>

namespace rotary {
namespace cuda {

template <typename T>
void launch_norm_rope(const kernel::RopeParams& p, const kernel::NormParams& n, cudaStream_t stream) {
  const int64_t rows = p.batch * p.seq;
  if (rows == 0) return;
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
    cudaGetLastError();
    sms = 1;
  }
  // Blocks grid-stride over rows; 16 resident per SM covers the latency.
  const int64_t blocks = std::min<int64_t>(rows, int64_t{16} * sms);
  const dim3 block(32, kernel::kNormWarps);
  if (n.q_scale != nullptr) {
    kernel::norm_rope_kernel<T, true><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p, n);
  } else {
    kernel::norm_rope_kernel<T, false><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p, n);
  }
}

#define ROTARY_NORM_INSTANTIATE(T) \
  template void launch_norm_rope<T>(const kernel::RopeParams&, const kernel::NormParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_NORM_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
