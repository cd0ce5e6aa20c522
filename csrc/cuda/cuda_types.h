// torch's 16-bit types share their bit layout with CUDA's: the glue hands
// kernels the CUDA type of each torch scalar type.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rotary {
namespace cuda {

template <typename scalar_t>
struct CudaType {
  using type = scalar_t;
};
template <>
struct CudaType<c10::Half> {
  using type = __half;
};
template <>
struct CudaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

}  // namespace cuda
}  // namespace rotary
