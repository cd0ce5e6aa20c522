// float8_e4m3fn rows on the CPU (the fp8 KV-cache write), compiled once per
// capability like rope_kernel.cpp: n values of x, each divided by *scale
// (null: none), clamped to +-448 and rounded, kernel::quantize_fp8's bytes
// on every build.
#pragma once

#include "builds.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace rotary {
namespace cpu {

#define ROTARY_CPU_FP8_KERNEL_DECLARE(CAP, ...)                                                           \
  namespace CAP {                                                                                     \
  template <typename scalar_t>                                                                        \
  void quantize_fp8_row(const scalar_t* x, int64_t n, const float* scale, uint8_t* out);              \
  extern template void quantize_fp8_row<float>(const float*, int64_t, const float*, uint8_t*);         \
  extern template void quantize_fp8_row<double>(const double*, int64_t, const float*, uint8_t*);       \
  extern template void quantize_fp8_row<c10::Half>(const c10::Half*, int64_t, const float*, uint8_t*); \
  extern template void quantize_fp8_row<c10::BFloat16>(const c10::BFloat16*, int64_t, const float*,   \
                                                       uint8_t*);                                     \
  }

ROTARY_CPU_BUILDS(ROTARY_CPU_FP8_KERNEL_DECLARE, )
#undef ROTARY_CPU_FP8_KERNEL_DECLARE

}  // namespace cpu
}  // namespace rotary
