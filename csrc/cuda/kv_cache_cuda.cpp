// CUDA apply_rope_with_kv_cache_ glue: one launch rotates q and k in place
// and writes k and v into the caches (the element-wise cache kernel after
// the RoPE launch where a cache is not vector-addressable); the prologue's
// kernel writes the caches in its own launch. All on the current stream. No
// host sync anywhere, so it captures in a CUDA graph with device-side
// positions and slot_mapping.
#include "op/kv_backend.h"
#include "cuda_types.h"
#include "kv_cache_launch.h"
#include "norm_rope_launch.h"
#include "rope_launch.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

namespace rotary {
namespace {

void run_cuda(const detail::PreparedKV& prepared, at::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_kv_cache_cuda", [&] {
    using T = typename cuda::CudaType<scalar_t>::type;
    if (prepared.params.fp8) {
      cuda::launch_rope_with_kv_cache<T, uint8_t>(prepared.params, stream);
    } else {
      cuda::launch_rope_with_kv_cache<T, T>(prepared.params, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The prologue's kernel, writing the caches in the same launch.
void run_norm_cuda(const detail::PreparedNormKV& prepared, at::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto& params = prepared.kv.params;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_norm_kv_cache_cuda", [&] {
    using T = typename cuda::CudaType<scalar_t>::type;
    if (params.fp8) {
      cuda::launch_norm_rope<T, uint8_t>(params, prepared.norm.params, stream);
    } else {
      cuda::launch_norm_rope<T, T>(params, prepared.norm.params, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CUDA, m) {
  m.impl("apply_rope_with_kv_cache_", &detail::apply_rope_with_kv_cache_impl<&run_cuda>);
  m.impl("apply_qk_norm_rope_with_kv_cache_", &detail::apply_qk_norm_rope_with_kv_cache_impl<&run_norm_cuda>);
}

}  // namespace rotary
