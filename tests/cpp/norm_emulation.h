// The prologue's CUDA kernel (cuda/norm_rope_kernel.cuh) run on the CPU:
// norm_rope_thread, the kernel's own body, for every thread of every block,
// each thread a fiber (fiber_block.h). A block's barrier and its warps'
// shuffles are the fibers' barriers (HostSync), so the kernel's loop nest,
// its reduction order and its shared memory all run as on a GPU, and the
// result has the kernel's bits. Used by the emulation tests of apply_qk_norm_rope and of its
// KV-cache form.
#pragma once

#include "cuda/norm_rope_kernel.cuh"
#include "fiber_block.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace rotary_test {

// The kernel's Sync for thread tid of a FiberBlock: the barrier, and the
// warp shuffle through slots (a float or a double, held exactly) and the
// warp's barrier. Shuffles alternate between two slot sets: a lane
// rewrites a set only after the next shuffle's barrier, which every lane
// passes after reading it.
struct HostSync {
  using Slots = double[2][rotary::kernel::kNormWarps][32];
  FiberBlock* fibers;
  Slots* slots;
  int32_t tid, warp, lane;
  int parity = 0;
  void block() const { fibers->sync_block(tid); }
  std::vector<uintptr_t>* prefetched = nullptr;  // where the kernel's L2 prefetches go, if anywhere
  void prefetch(const void* at) const {
    if (prefetched != nullptr) prefetched->push_back(reinterpret_cast<uintptr_t>(at));
  }
  template <typename V>
  V shfl_xor(V v, int m) {
    double* slot = (*slots)[parity][warp];
    parity ^= 1;
    slot[lane] = static_cast<double>(v);
    fibers->sync_warp(tid);
    return static_cast<V>(slot[lane ^ m]);
  }
};

// The launch of apply_qk_norm_rope (Cache void) or of its KV-cache form
// with `blocks` blocks: the instantiation the launch picks
// (with_norm_kernel), each block in turn, its threads as fibers, odd blocks
// on the schedule that lets a warp run ahead. Blocks past
// the rows have none and are skipped. `prefetched`, if given, collects
// every L2 prefetch.
template <typename T, typename Cache = void>
void emulate_norm_rope(const rotary::kernel::KVCacheParams& kv, const rotary::kernel::NormParams& n, int64_t blocks,
                       std::vector<uintptr_t>* prefetched = nullptr) {
  namespace k = rotary::kernel;
  using acc_t = typename k::Acc<T>::type;
  const k::NormGrid g = k::norm_grid_for<T, Cache>(kv, blocks);
  const int64_t busy = std::min(blocks, kv.rope.batch * kv.rope.seq);
  k::with_norm_kernel<T, Cache>(n, g, [&](auto fp8_q, auto vector) {
    FiberBlock fibers(k::kNormThreads);
    HostSync::Slots slots;
    k::NormShared<acc_t> shared;
    fibers.run([&](int tid) {
      HostSync sync{&fibers, &slots, tid, tid / 32, tid % 32};
      sync.prefetched = prefetched;  // fibers take turns: one vector is safe
      for (int64_t b = 0; b < busy; ++b) {
        if (tid == 0) fibers.schedule(b % 2 ? Schedule::kLowestFirst : Schedule::kRoundRobin);  // by turns
        k::norm_rope_thread<T, decltype(fp8_q)::value, Cache, decltype(vector)::value>(
            kv, n, g, b, sync.lane, sync.warp, shared, sync);
        sync.block();  // the next block reuses the shared memory
      }
    });
  });
}

}  // namespace rotary_test
