// What the prologue driver (norm_rope_cpu.cpp) hands the norm kernel: the
// head vectors of one tensor for a tile of tokens, their rotation
// coefficients (laid out as NormRun says) and the norm's weight.
// norm_kernel.cpp is compiled once per CPU capability, like rope_kernel.cpp.
#pragma once

#include "builds.h"

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace rotary {
namespace cpu {

// Vector (t, h) starts at in + t * in_tok + h * in_head (likewise out, in
// elements of the output type), its elements in_inner (out_inner) apart. Each is normalized over its head_dim
// (across_heads: over all `heads` vectors of its token), scaled by
// weight + h * weight_head, and its dims [rotary_offset, rotary_offset +
// rotary_dim) rotated with token t's coefficients at coef + t * coef_tok
// (rope_kernel.h: rows of pairs, or per element where interleaved);
// the other dims are written normalized. scratch holds kNormScratch *
// head_dim acc_t values (across_heads: heads * head_dim, if more). Every capability gives the same
// bits: the sum of squares keeps 16 partial sums in a fixed order. With
// fp8_scale, out holds float8_e4m3fn bytes: each value divided by
// fp8_scale[h * fp8_scale_head], clamped to +-448, rounded once.
// Vectors the 16-bit per-head norm finds scales for at once, and the
// scratch rows it needs: two such groups, one read while the other is
// written.
constexpr int64_t kNormHeads = 2;
constexpr int64_t kNormScratch = 2 * kNormHeads;

template <typename scalar_t>
struct NormRun {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* in;
  void* out;  // scalar_t, or uint8_t with fp8_scale
  int64_t tokens, in_tok, out_tok;
  int64_t heads, in_head, out_head;
  int64_t in_inner, out_inner;
  const acc_t* coef;
  int64_t coef_tok;
  const acc_t* weight;
  int64_t weight_head;
  int64_t head_dim, rotary_offset, rotary_dim;
  double eps;
  bool across_heads, interleaved;
  acc_t* scratch;
  const float* fp8_scale;
  int64_t fp8_scale_head;
};

#define ROTARY_CPU_NORM_KERNEL_DECLARE(CAP, ...)                                            \
  namespace CAP {                                                                       \
  template <typename scalar_t>                                                          \
  void norm_rotate_run(const NormRun<scalar_t>& r);                                     \
  extern template void norm_rotate_run<float>(const NormRun<float>&);                   \
  extern template void norm_rotate_run<double>(const NormRun<double>&);                 \
  extern template void norm_rotate_run<c10::Half>(const NormRun<c10::Half>&);           \
  extern template void norm_rotate_run<c10::BFloat16>(const NormRun<c10::BFloat16>&);   \
  }

ROTARY_CPU_BUILDS(ROTARY_CPU_NORM_KERNEL_DECLARE, )
#undef ROTARY_CPU_NORM_KERNEL_DECLARE

}  // namespace cpu
}  // namespace rotary
