#include "rope_kernel.cuh"
#include "rope_launch.h"

#include <algorithm>
#include <atomic>

namespace rotary {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;
constexpr int kMaxWarps = kernel::kMaxBlockThreads / 32;

// SM count per device, and resident blocks per SM per (kernel, warps per
// block, device): queried once, then read lock-free (0 = not yet known).
std::atomic<int> sm_count[kMaxDevices];

int sms(int device) {
  int n = device < kMaxDevices ? sm_count[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      cudaGetLastError();  // leave no sticky error for the launch check
      n = 1;
    }
    if (device < kMaxDevices) sm_count[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// One cache per kernel instantiation (the template arguments key it).
template <typename T, bool kInterleaved, bool kVectorized, typename Index>
int resident_blocks(int device, int block_threads) {
  static std::atomic<int> cache[kMaxDevices][kMaxWarps + 1];
  auto* kernel = &kernel::rope_kernel<T, kInterleaved, kVectorized, Index>;
  const int warps = (block_threads + 31) / 32;
  int n = device < kMaxDevices ? cache[device][warps].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, warps * 32, 0) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 1;
    }
    if (device < kMaxDevices) cache[device][warps].store(n, std::memory_order_relaxed);
  }
  return n;
}

template <typename T, bool kInterleaved, bool kVectorized, typename Index>
void launch_grid(const kernel::RopeParams& p, const kernel::Grid& g, cudaStream_t stream) {
  auto* kernel = &kernel::rope_kernel<T, kInterleaved, kVectorized, Index>;
  int device = 0;
  cudaGetDevice(&device);
  // Every block resident at once (whole waves); blocks grid-stride over rows.
  const int64_t full = static_cast<int64_t>(sms(device)) * resident_blocks<T, kInterleaved, kVectorized, Index>(device, g.block_threads);
  const int64_t blocks = std::min(g.row_blocks, full);
  kernel<<<static_cast<unsigned>(blocks), g.block_threads, 0, stream>>>(p, g);
}

// The instantiation launch_shape chose, with its grid.
template <typename T, bool kInterleaved, bool kVectorized>
void launch(const kernel::RopeParams& p, const kernel::LaunchShape& s, cudaStream_t stream) {
  if (s.int32) {
    launch_grid<T, kInterleaved, kVectorized, int32_t>(p, s.grid, stream);
  } else {
    launch_grid<T, kInterleaved, kVectorized, int64_t>(p, s.grid, stream);
  }
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

template void launch_rope<float>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<double>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<__half>(const kernel::RopeParams&, cudaStream_t);
template void launch_rope<__nv_bfloat16>(const kernel::RopeParams&, cudaStream_t);

}  // namespace cuda
}  // namespace rotary
