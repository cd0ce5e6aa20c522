// Thin glue between the dispatcher and the framework-free CUDA kernel: device
// guard, current stream, dtype dispatch, launch check. Nothing else.
#include "../checks.h"
#include "rope_launch.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace rotary {
namespace {

// torch's 16-bit types share their bit layout with CUDA's.
template <typename scalar_t>
struct CudaType {
  using type = scalar_t;
};
template <>
struct CudaType<at::Half> {
  using type = __half;
};
template <>
struct CudaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

void run_cuda(const detail::PreparedRope& prepared, at::ScalarType dtype) {
  if (prepared.params.batch * prepared.params.seq == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cuda", [&] {
    cuda::launch_rope<typename CudaType<scalar_t>::type>(prepared.params, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor apply_rope_cuda(
    const at::Tensor& x,
    const at::Tensor& freqs,
    int64_t start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto prepared =
      detail::prepare_rope("apply_rope", x, nullptr, freqs, start_pos, positions, interleaved, inverse);
  run_cuda(prepared, x.scalar_type());
  return prepared.out_q;
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_cuda(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    int64_t start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto prepared =
      detail::prepare_rope("apply_rope_qk", q, &k, freqs, start_pos, positions, interleaved, inverse);
  run_cuda(prepared, q.scalar_type());
  return {prepared.out_q, prepared.out_k};
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CUDA, m) {
  m.impl("apply_rope", &apply_rope_cuda);
  m.impl("apply_rope_qk", &apply_rope_qk_cuda);
}

}  // namespace rotary
