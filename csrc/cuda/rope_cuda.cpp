// Thin glue between the dispatcher and the framework-free CUDA kernel: current
// stream, dtype dispatch, launch check. Nothing else.
#include "op/backend_ops.h"
#include "cuda_types.h"
#include "rope_launch.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

namespace rotary {
namespace {

void run_cuda(const detail::PreparedRope& prepared, at::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cuda", [&] {
    cuda::launch_rope<typename cuda::CudaType<scalar_t>::type>(prepared.params, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

// Device guard, output allocation and validation come from BackendOps.
TORCH_LIBRARY_IMPL(rotary, CUDA, m) {
  detail::BackendOps<&run_cuda>::register_all(m);
}

}  // namespace rotary
