// CPU apply_rope_with_kv_cache_: the RoPE kernel (rope_cpu.cpp) rotates q
// and k in place and hands each task's freshly rotated k rows to the cache
// write below, so k is read from memory once. The rotation is the one
// apply_rope_qk_ runs: the cache holds the same bits as the unfused sequence.
#include "rope_cpu.h"

#include "kernel/fp8_kernel.h"
#include "op/kv_backend.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

namespace rotary {
namespace {

using kernel::KVCacheParams;

// n values of x into an fp8 cache row: the build's vector quantization.
template <typename T>
void quantize_row(const T* x, int64_t n, const float* scale, uint8_t* out) {
  static const cpu::Capability cap = cpu::capability_from_aten();
  ROTARY_CPU_DISPATCH(cap, isa::quantize_fp8_row(x, n, scale, out))
}

// A head row moves as a whole when both sides are dense along head_dim: one
// memcpy into a cache of the input's dtype, or one quantized row into an
// fp8 cache (the element-wise write's bytes); anything else goes element by
// element.
template <typename T, typename Cache>
void write_rows(const KVCacheParams& p, int64_t b, int64_t s0, int64_t n, int64_t h0, int64_t h1) {
  const auto& r = p.rope;
  const int64_t dim = r.head_dim;
  const bool rows = r.k.out_stride[3] == 1 && p.v_stride[3] == 1 && p.kc_stride[3] == 1 && p.vc_stride[3] == 1;
  for (int64_t s = s0; s < s0 + n; ++s) {
    int64_t outer = 0, inner = 0;
    if (!kernel::cache_row(p, b, s, outer, inner)) continue;  // slot -1
    const kernel::KVRow row = kernel::kv_row(p, b, s, outer, inner);
    for (int64_t h = h0; h < h1; ++h) {
      if (!rows) {
        for (int64_t d = 0; d < kernel::kv_row_dim(p); ++d) kernel::write_kv_element<T, Cache>(p, row, h, d);
        continue;
      }
      const T* k = static_cast<const T*>(r.k.out) + row.k + h * r.k.out_stride[1];
      const T* v = static_cast<const T*>(p.v) + row.v + h * p.v_stride[1];
      Cache* kc = static_cast<Cache*>(p.k_cache) + row.kc + h * p.kc_stride[1];
      Cache* vc = static_cast<Cache*>(p.v_cache) + row.vc + h * p.vc_stride[1];
      if constexpr (std::is_same_v<T, Cache>) {
        std::memcpy(kc, k, dim * sizeof(T));
        std::memcpy(vc, v, p.v_dim * sizeof(T));
      } else {
        quantize_row(k, dim, kernel::cache_scale(p, false, h), kc);
        quantize_row(v, p.v_dim, kernel::cache_scale(p, true, h), vc);
      }
    }
  }
}

template <typename T, typename Cache>
void write_tile(const void* ctx, int64_t b, int64_t s0, int64_t n, int64_t h0, int64_t h1) {
  write_rows<T, Cache>(*static_cast<const KVCacheParams*>(ctx), b, s0, n, h0, h1);
}

// One pass: each rotation task of the RoPE kernel writes the k rows it has
// just rotated, and the matching v rows, into the cache.
void run_cpu(const detail::PreparedKV& prepared, at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_kv_cache_cpu", [&] {
    cpu::TileHook hook;
    hook.fn = prepared.params.fp8 ? &write_tile<scalar_t, uint8_t> : &write_tile<scalar_t, scalar_t>;
    hook.ctx = &prepared.params;
    cpu::rope_cpu(prepared.params.rope, dtype, hook);
  });
}

// The prologue's kernel with the same hook: k rows as normalized and rotated.
void run_norm_cpu(const detail::PreparedNormKV& prepared, at::ScalarType dtype) {
  const auto& params = prepared.kv.params;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_norm_kv_cache_cpu", [&] {
    cpu::TileHook hook;
    hook.fn = params.fp8 ? &write_tile<scalar_t, uint8_t> : &write_tile<scalar_t, scalar_t>;
    hook.ctx = &params;
    cpu::norm_rope_cpu(params.rope, prepared.norm.params, dtype, &hook);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  m.impl("apply_rope_with_kv_cache_", &detail::apply_rope_with_kv_cache_impl<&run_cpu>);
  m.impl("apply_qk_norm_rope_with_kv_cache_", &detail::apply_qk_norm_rope_with_kv_cache_impl<&run_norm_cpu>);
}

}  // namespace rotary
