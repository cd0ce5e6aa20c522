// The host emulation of the CUDA RoPE kernel (cuda/rope_kernel.cuh), shared
// by its tests: rope_thread, the kernel's own per-thread body, run over the
// whole grid of a launch on the CPU, a store that counts writes and records
// prefetches, and the inputs and reference tables the tests draw.
#pragma once

#include "checks/checks.h"
#include "cuda/cuda_types.h"
#include "cuda/rope_kernel.cuh"
#include "reference.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace rotary_emulation {

using rotary::kernel::Grid;
using rotary::kernel::RopeParams;

// Which variant of the launch to emulate: vector or strided path, 32- or
// 64-bit index math, and how many blocks the grid has (fewer than the row
// blocks makes every block wrap around the grid-stride loop).
struct Variant {
  bool vectorized = true;
  bool index64 = false;  // otherwise int32 when fits_int32 allows it
  int64_t max_blocks = int64_t{1} << 40;
  bool prefetch = true;  // prefetch each thread's next row (when the grid strides)
};

// Counts the bytes every store writes (the kernel's plain store otherwise).
struct CountingStore {
  static std::unordered_map<uintptr_t, int>& counts() {
    static std::unordered_map<uintptr_t, int> c;
    return c;
  }
  template <typename V>
  static void put(V* at, const V& v) {
    *at = v;
    const auto base = reinterpret_cast<uintptr_t>(at);
    for (size_t i = 0; i < sizeof(V); ++i) ++counts()[base + i];
  }
  // Every L2 prefetch, by address.
  static std::vector<uintptr_t>& prefetches() {
    static std::vector<uintptr_t> p;
    return p;
  }
  static void prefetch(const void* at) { prefetches().push_back(reinterpret_cast<uintptr_t>(at)); }
};

// Runs the whole grid of one launch on the CPU: every block, every thread of
// it, through rope_thread, the exact per-thread body of the GPU kernel (with
// a CacheSink: the fused KV-cache launch, kv_emulation.h).
template <typename T, bool kInterleaved, bool kVectorized, typename Index, typename Store,
          typename Sink = rotary::kernel::NoSink>
void emulate_launch(const RopeParams& p, const Grid& g, int64_t max_blocks, bool prefetch, Sink sink = Sink()) {
  const int64_t blocks = std::min(g.row_blocks, max_blocks);
  const Grid launched = rotary::kernel::launched(p, g, blocks, prefetch);
  for (int64_t block = 0; block < blocks; ++block) {
    for (int32_t tid = 0; tid < g.block_threads; ++tid) {
      rotary::kernel::rope_thread<T, kInterleaved, kVectorized, Index, Store, Sink>(p, launched, block, tid, sink);
    }
  }
}

template <typename T, bool kInterleaved, bool kVectorized, typename Store = rotary::kernel::DirectStore,
          typename Sink = rotary::kernel::NoSink>
void emulate_grid(const RopeParams& p, const Variant& v, Sink sink = Sink()) {
  const Grid g = rotary::kernel::make_grid<T, kInterleaved, kVectorized>(p);
  if (g.row_blocks == 0) return;
  if (!v.index64 && rotary::kernel::fits_int32(p, g)) {
    emulate_launch<T, kInterleaved, kVectorized, int32_t, Store>(p, g, v.max_blocks, v.prefetch, sink);
  } else {
    emulate_launch<T, kInterleaved, kVectorized, int64_t, Store>(p, g, v.max_blocks, v.prefetch, sink);
  }
}

template <typename T, typename Store = rotary::kernel::DirectStore>
void emulate(const RopeParams& p, const Variant& v) {
  if (p.interleaved) {
    v.vectorized ? emulate_grid<T, true, true, Store>(p, v) : emulate_grid<T, true, false, Store>(p, v);
  } else {
    v.vectorized ? emulate_grid<T, false, true, Store>(p, v) : emulate_grid<T, false, false, Store>(p, v);
  }
}

// Both index widths and a wrapping grid, on the given path.
inline std::vector<Variant> variants(bool vectorized) {
  std::vector<Variant> out;
  for (bool index64 : {false, true}) {
    for (int64_t max_blocks : {int64_t{1} << 40, int64_t{2}}) out.push_back({vectorized, index64, max_blocks});
  }
  return out;
}

inline void poison(const rotary::detail::PreparedRope& prepared) {
  prepared.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
  prepared.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
}

template <typename T>
void emulate(const RopeParams& p, bool vectorized) {
  Variant v;
  v.vectorized = vectorized;
  emulate<T>(p, v);
}

// The q/k layouts of the tests (helpers.h).
using rotary_test::Layout;
using rotary_test::layout_name;
using rotary_test::make_qk;

inline double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 2e-5;
    case at::kDouble: return 2e-6;  // the table is complex64
    case at::kHalf: return 4e-3;
    default: return 3e-2;           // bfloat16: one rounding of values up to ~4
  }
}

// Table from the reference formula, not from the library.
inline at::Tensor reference_table(int64_t len, int64_t rotary_dim) {
  auto freqs = at::empty({len, rotary_dim / 2}, at::kComplexFloat);
  auto* f = freqs.data_ptr<c10::complex<float>>();
  for (int64_t pos = 0; pos < len; ++pos) {
    for (int64_t j = 0; j < rotary_dim / 2; ++j) {
      const auto e = rotary_test::ref_freq(pos, j, rotary_dim);
      f[pos * (rotary_dim / 2) + j] = {static_cast<float>(e.real()), static_cast<float>(e.imag())};
    }
  }
  return freqs;
}

// Runs the emulated grid of the CUDA kernel for dtype over p.
template <typename Store = rotary::kernel::DirectStore>
void emulate_dtype(at::ScalarType dtype, const RopeParams& p, const Variant& v) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "emulate", [&] {
    using T = typename rotary::cuda::CudaType<scalar_t>::type;
    emulate<T, Store>(p, v);
  });
}

inline void emulate_dtype(at::ScalarType dtype, const RopeParams& p, bool vectorized) {
  Variant v;
  v.vectorized = vectorized;
  emulate_dtype(dtype, p, v);
}

// The launch shape the kernel gets for dtype, on the chosen path.
inline Grid grid_for(at::ScalarType dtype, const RopeParams& p, bool vectorized) {
  Grid g;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "grid", [&] {
    using T = typename rotary::cuda::CudaType<scalar_t>::type;
    if (p.interleaved) {
      g = vectorized ? rotary::kernel::make_grid<T, true, true>(p) : rotary::kernel::make_grid<T, true, false>(p);
    } else {
      g = vectorized ? rotary::kernel::make_grid<T, false, true>(p) : rotary::kernel::make_grid<T, false, false>(p);
    }
  });
  return g;
}

inline bool vectorizable(at::ScalarType dtype, const RopeParams& p) {
  bool result = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "vectorizable", [&] {
    using T = typename rotary::cuda::CudaType<scalar_t>::type;
    result = rotary::kernel::can_vectorize<T>(p);
  });
  return result;
}

}  // namespace rotary_emulation
