// What the CPU driver (rope_cpu.cpp) hands the kernel: the head vectors of one
// tensor for a tile of tokens and their rotation coefficients. rope_kernel.cpp
// is compiled once per CPU capability into namespace rotary::cpu::<CAPABILITY>,
// as ATen compiles native/cpu; the driver picks one at run time.
#pragma once

#include "builds.h"

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace rotary {
namespace cpu {

// Vector (t, h) starts at in + t * in_tok + h * in_head (likewise out); its
// elements are in_inner (out_inner) apart. Token t's coefficients start at
// coef + t * coef_tok, 2 * rotary_dim values of acc_t:
//   interleaved: c = (c0, c0, c1, c1, ...), s = (-s0, s0, -s1, s1, ...), so
//                out[i] = x[i] * c[i] + x[i ^ 1] * s[i]
//   half:        c = (c0, ..., c_{R/2-1}), s = (s0, ..., s_{R/2-1}), then R
//                unused values; out[j] = x[j] c_j - x[j + R/2] s_j and
//                out[j + R/2] = x[j] s_j + x[j + R/2] c_j
// Negating a product is exact, so x0 * c + x1 * (-s) has the bits of
// x0 * c - x1 * s. tokens_outer: walk token by token (token-major memory);
// otherwise a block of heads at a time over all tokens (heads-major).
// prefetch: software prefetch along the walk, of the input ahead and of the
// next block's output lines (for data that streams from memory; cached data
// would only pay its instructions).
template <typename scalar_t>
struct Run {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* in;
  scalar_t* out;
  int64_t tokens, in_tok, out_tok, coef_tok;
  int64_t heads, in_head, out_head;
  int64_t in_inner, out_inner;
  const acc_t* coef;
  bool tokens_outer;
  bool prefetch;
};

// Rotates dims [0, dim) of every vector of r. nt: streaming stores (the
// caller checked their alignment); a no-op request on DEFAULT. Multiplies and
// adds round separately in every capability, so all give the same bits
// (a NaN's sign and payload excepted: which operand's survives is the codegen's).
#define ROTARY_CPU_KERNEL_DECLARE(CAP, ...)                                                     \
  namespace CAP {                                                                           \
  template <typename scalar_t>                                                              \
  void rotate_run(const Run<scalar_t>& r, int64_t dim, bool interleaved, bool nt);          \
  extern template void rotate_run<float>(const Run<float>&, int64_t, bool, bool);           \
  extern template void rotate_run<double>(const Run<double>&, int64_t, bool, bool);         \
  extern template void rotate_run<c10::Half>(const Run<c10::Half>&, int64_t, bool, bool);   \
  extern template void rotate_run<c10::BFloat16>(const Run<c10::BFloat16>&, int64_t, bool, bool); \
  }

ROTARY_CPU_BUILDS(ROTARY_CPU_KERNEL_DECLARE, )
#undef ROTARY_CPU_KERNEL_DECLARE

}  // namespace cpu
}  // namespace rotary
