// Direct entry into the CPU kernel, below the dispatcher: no checks, no
// allocation, no autograd. For benchmarks and tests that build a
// kernel::RopeParams themselves (or with detail::prepare_rope).
#pragma once

#include "params/norm_params.h"
#include "params/rope_params.h"

#include <c10/core/ScalarType.h>

namespace rotary {
namespace cpu {

// The builds of the kernel (kernel/rope_kernel.cpp), as ATen names its CPU
// capabilities, plus AVX512_BF16: AVX512 with the fp32 -> bf16 conversion
// instruction. The x86 builds exist on x86-64 only; each runs where every
// lower one does.
enum class Capability { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The build the ops run: ATen's capability (at::get_cpu_capability(), which
// honours ATEN_CPU_CAPABILITY=default|avx2|avx512), capped at what this
// library was built with; AVX512 becomes AVX512_BF16 on a CPU with it,
// unless ATEN_CPU_CAPABILITY=avx512 asked for plain AVX512.
Capability capability_from_aten();
const char* capability_name(Capability cap);

// Called by each task right after it rotated k heads [h0, h1) of tokens
// [s0, s0 + n) of batch b, while those rows are still in cache: the KV-cache
// op (kv_cache_cpu.cpp) copies them into the cache there. Every (token, k
// head) is handed over exactly once.
struct TileHook {
  void (*fn)(const void* ctx, int64_t b, int64_t s0, int64_t n, int64_t h0, int64_t h1) = nullptr;
  const void* ctx = nullptr;
};
void rope_cpu(const kernel::RopeParams& p, at::ScalarType dtype, const TileHook& hook);

// Rotates p.q (and p.k when p.k.heads > 0) as described by p. dtype is the
// element type of the q/k tensors: float, double, half or bfloat16. The caller
// guarantees valid pointers, strides and in-range positions.
void rope_cpu(const kernel::RopeParams& p, at::ScalarType dtype);
// The same with the kernel build chosen by the caller, which must not exceed
// capability_from_aten() (tests compare the builds with each other).
void rope_cpu(const kernel::RopeParams& p, at::ScalarType dtype, Capability cap);

// The prologue (apply_qk_norm_rope): q and k normalized by n, then rotated
// by p, in one pass; hook (may be null) as for rope_cpu, after each tile's k.
void norm_rope_cpu(
    const kernel::RopeParams& p, const kernel::NormParams& n, at::ScalarType dtype, const TileHook* hook);
// The same with the kernel build chosen by the caller (as rope_cpu's).
void norm_rope_cpu(
    const kernel::RopeParams& p, const kernel::NormParams& n, at::ScalarType dtype, const TileHook* hook,
    Capability cap);

}  // namespace cpu
}  // namespace rotary
