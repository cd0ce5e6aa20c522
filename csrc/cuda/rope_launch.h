// Host entry into the CUDA kernels, callable from the torch glue without
// seeing any CUDA device code.
#pragma once

#include "params/rope_params.h"

#include <cuda_runtime_api.h>

namespace rotary {
namespace cuda {

// Enqueues one launch rotating q and k on `stream`. T is float, double,
// __half or __nv_bfloat16. Errors surface through cudaGetLastError.
template <typename T>
void launch_rope(const kernel::RopeParams& params, cudaStream_t stream);

}  // namespace cuda
}  // namespace rotary
