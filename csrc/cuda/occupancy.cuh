// Grid sizing and launch shared by the RoPE launches: SM count per device
// and resident blocks per SM per (kernel, warps per block, device), queried
// once and then read lock-free (0 = not yet known); a launch puts every
// block resident at once (whole waves) and its blocks grid-stride over rows.
// CUDA source: included by .cu files only.
#pragma once

#include "rope_grid.cuh"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

namespace rotary {
namespace cuda {

constexpr int kMaxDevices = 64;
constexpr int kMaxWarps = kernel::kMaxBlockThreads / 32;

inline int sm_count(int device) {
  static std::atomic<int> cache[kMaxDevices];
  int n = device < kMaxDevices ? cache[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      cudaGetLastError();  // leave no sticky error for the launch check
      n = 1;
    }
    if (device < kMaxDevices) cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// One cache per kernel (the template argument keys it).
template <auto Kernel>
int resident_blocks(int device, int block_threads) {
  static std::atomic<int> cache[kMaxDevices][kMaxWarps + 1];
  const int warps = (block_threads + 31) / 32;
  int n = device < kMaxDevices ? cache[device][warps].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, warps * 32, 0) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 1;
    }
    if (device < kMaxDevices) cache[device][warps].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Blocks for grid g of Kernel on the current device: whole waves, evenly
// loaded (even_grid).
template <auto Kernel>
unsigned resident_grid(const kernel::Grid& g) {
  int device = 0;
  cudaGetDevice(&device);
  const int64_t full = static_cast<int64_t>(sm_count(device)) * resident_blocks<Kernel>(device, g.block_threads);
  return static_cast<unsigned>(kernel::even_grid(g.row_blocks, full));
}

// Launches the instantiation of the index width s chose (Kernel32 or
// Kernel64, each taking (params, grid)) over s's grid of rows of `rope`.
template <auto Kernel32, auto Kernel64, typename Params>
void launch_rows(const Params& params, const kernel::RopeParams& rope, const kernel::LaunchShape& s,
                 cudaStream_t stream) {
  const kernel::Grid& g = s.grid;
  const bool prefetch = s.prefetch && kernel::l2_prefetch();
  if (s.int32) {
    const unsigned blocks = resident_grid<Kernel32>(g);
    Kernel32<<<blocks, g.block_threads, 0, stream>>>(params, kernel::launched(rope, g, blocks, prefetch));
  } else {
    const unsigned blocks = resident_grid<Kernel64>(g);
    Kernel64<<<blocks, g.block_threads, 0, stream>>>(params, kernel::launched(rope, g, blocks, prefetch));
  }
}

}  // namespace cuda
}  // namespace rotary
