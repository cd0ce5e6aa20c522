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
// coef + t * coef_tok (coefficients.h fills them), as rows of pairs or,
// for interleaved runs of builds without interleaved_pair_rows, per element:
//   pairs:    c = (c0, ..., c_{R/2-1}), then s = (s0, ..., s_{R/2-1}), R
//             values; pair j, (x[2j], x[2j + 1]) interleaved and (x[j],
//             x[j + R/2]) half, turns to (x0 c_j - x1 s_j, x0 s_j + x1 c_j)
//   elements: c = (c0, c0, c1, c1, ...), s = (-s0, s0, -s1, s1, ...), 2R
//             values, so out[i] = x[i] * c[i] + x[i ^ 1] * s[i]
// Negating a product is exact, so x0 * c + x1 * (-s) has the bits of
// x0 * c - x1 * s. The x86 builds' bf16 kernel holds a pair in each 32-bit
// word and takes c and s with straight loads from pair rows, which also
// take half the cache of element rows (interleaved bf16 prefill, Zen 3:
// 1.98x `clone` to 1.19x at 1 thread). The vector kernels of other types
// load element rows straight, where pairs would need a shuffle per vector
// (docs/performance/amd_pairs.md).
// tokens_outer: walk token by token (token-major memory);
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
  template <typename scalar_t>                                                              \
  bool interleaved_pair_rows();                                                             \
  extern template bool interleaved_pair_rows<float>();                                      \
  extern template bool interleaved_pair_rows<double>();                                     \
  extern template bool interleaved_pair_rows<c10::Half>();                                  \
  extern template bool interleaved_pair_rows<c10::BFloat16>();                              \
  extern template void rotate_run<float>(const Run<float>&, int64_t, bool, bool);           \
  extern template void rotate_run<double>(const Run<double>&, int64_t, bool, bool);         \
  extern template void rotate_run<c10::Half>(const Run<c10::Half>&, int64_t, bool, bool);   \
  extern template void rotate_run<c10::BFloat16>(const Run<c10::BFloat16>&, int64_t, bool, bool); \
  }

ROTARY_CPU_BUILDS(ROTARY_CPU_KERNEL_DECLARE, )
#undef ROTARY_CPU_KERNEL_DECLARE

}  // namespace cpu
}  // namespace rotary
