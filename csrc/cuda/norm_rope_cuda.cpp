// Glue between the dispatcher and the prologue's CUDA kernel: current stream,
// dtype dispatch, launch check.
#include "cuda_types.h"
#include "norm_rope_launch.h"
#include "op/norm_backend.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

namespace rotary {
namespace {

void run_cuda(const detail::PreparedNormRope& prepared, at::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_norm_cuda", [&] {
    kernel::KVCacheParams kv;  // no caches
    kv.rope = prepared.rope.params;
    cuda::launch_norm_rope<typename cuda::CudaType<scalar_t>::type, void>(kv, prepared.norm.params, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CUDA, m) {
  detail::NormBackendOps<&run_cuda>::register_all(m);
}

}  // namespace rotary
