#include "rope_kernel.cuh"
#include "rope_launch.h"

#include <algorithm>

namespace rotary {
namespace cuda {
namespace {

constexpr int kThreadsPerBlock = 256;
// Enough heads per thread to reuse the cos/sin a few times, few enough that
// the grid still has tens of thousands of threads at decode sizes.
constexpr int64_t kHeadsPerThread = 4;
// Grid-stride beyond this many blocks; plenty to fill an H200.
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T, bool kInterleaved, bool kVectorized>
void launch(const kernel::RopeParams& p, cudaStream_t stream) {
  const auto grid = kernel::make_grid<T, kInterleaved, kVectorized>(p, kHeadsPerThread);
  if (grid.threads == 0) return;
  const int64_t blocks = std::min(kMaxBlocks, (grid.threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
  kernel::rope_kernel<T, kInterleaved, kVectorized>
      <<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, grid);
}

}  // namespace

template <typename T>
void launch_rope(const kernel::RopeParams& p, cudaStream_t stream) {
  const bool vectorized = kernel::can_vectorize<T>(p);
  if (p.interleaved) {
    vectorized ? launch<T, true, true>(p, stream) : launch<T, true, false>(p, stream);
  } else {
    vectorized ? launch<T, false, true>(p, stream) : launch<T, false, false>(p, stream);
  }
}

template void launch_rope<float>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<double>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<__half>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<__nv_bfloat16>(const kernel::RopeParams&, cudaStream_t);

}  // namespace cuda
}  // namespace rotary
