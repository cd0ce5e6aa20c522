#include "rope_kernel.cuh"
#include "occupancy.cuh"
#include "rope_launch.h"

namespace rotary {
namespace cuda {
namespace {

// The instantiation launch_shape chose, with its grid.
template <typename T, bool kInterleaved, bool kVectorized>
void launch(const kernel::RopeParams& p, const kernel::LaunchShape& s, cudaStream_t stream) {
  launch_rows<&kernel::rope_kernel<T, kInterleaved, kVectorized, int32_t>,
              &kernel::rope_kernel<T, kInterleaved, kVectorized, int64_t>>(p, p, s, stream);
}

}  // namespace

template <typename T>
void launch_rope(const kernel::RopeParams& p, cudaStream_t stream) {
  const kernel::LaunchShape s = kernel::launch_shape<T>(p);
  if (s.grid.row_blocks == 0) return;
  if (p.interleaved) {
    s.vectorized ? launch<T, true, true>(p, s, stream) : launch<T, true, false>(p, s, stream);
  } else {
    s.vectorized ? launch<T, false, true>(p, s, stream) : launch<T, false, false>(p, s, stream);
  }
}

#define ROTARY_ROPE_INSTANTIATE(T) template void launch_rope<T>(const kernel::RopeParams&, cudaStream_t);
ROTARY_CUDA_STORAGE_TYPES(ROTARY_ROPE_INSTANTIATE)

}  // namespace cuda
}  // namespace rotary
