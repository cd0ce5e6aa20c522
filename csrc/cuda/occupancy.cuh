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

// Blocks of Kernel resident at once on the current device (one wave), at
// block_threads threads a block.
template <auto Kernel>
int64_t resident_wave(int block_threads) {
  int device = 0;
  cudaGetDevice(&device);
  return static_cast<int64_t>(sm_count(device)) * resident_blocks<Kernel>(device, block_threads);
}

// s's grid of `rope` as Kernel launches it: whole waves of `wave` blocks
// (resident_wave), evenly loaded (even_grid), prefetching when it strides.
template <auto Kernel>
kernel::Grid launch_grid(const kernel::RopeParams& rope, const kernel::LaunchShape& s, int64_t& wave) {
  wave = resident_wave<Kernel>(s.grid.block_threads);
  return kernel::launched(rope, s.grid, kernel::even_grid(s.grid.row_blocks, wave), s.prefetch);
}

// Launches the instantiation of the index width s chose (Kernel32 or
// Kernel64, each taking (params, grid)) over s's grid of rows of `rope`.
template <auto Kernel32, auto Kernel64, typename Params>
void launch_rows(const Params& params, const kernel::RopeParams& rope, const kernel::LaunchShape& s,
                 cudaStream_t stream) {
  int64_t wave = 0;
  if (s.int32) {
    const kernel::Grid g = launch_grid<Kernel32>(rope, s, wave);
    Kernel32<<<static_cast<unsigned>(g.blocks), g.block_threads, 0, stream>>>(params, g);
  } else {
    const kernel::Grid g = launch_grid<Kernel64>(rope, s, wave);
    Kernel64<<<static_cast<unsigned>(g.blocks), g.block_threads, 0, stream>>>(params, g);
  }
}

}  // namespace cuda
}  // namespace rotary
