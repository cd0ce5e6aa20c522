// float8_e4m3fn encoding shared by the KV-cache write and the prologue's
// fp8 q: framework-free, host and device.
#pragma once

#include "rope_params.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rotary {
namespace kernel {

// float -> float8_e4m3fn bits, round to nearest even; |f| >= 480 and NaN give
// NaN (0x7f). The same arithmetic as c10's fp8e4m3fn_from_fp32_value, so the
// cache holds the bits torch's .to(torch.float8_e4m3fn) gives. All three
// cases are computed and one selected: no branch per element on the GPU.
ROTARY_HOST_DEVICE uint8_t fp8_e4m3fn_bits(float f) {
  uint32_t bits = bits_of_float(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  // Below 2^-6: subnormal, rounded by a float add.
  constexpr uint32_t denorm_bits = 141u << 23;
  const uint32_t subnormal = bits_of_float(float_of_bits(bits) + float_of_bits(denorm_bits)) - denorm_bits;
  const uint32_t mant_odd = (bits >> 20) & 1u;
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd) >> 20;
  const uint32_t result = bits >= (1087u << 20) ? 0x7fu : (bits < (121u << 23) ? subnormal : normal);
  return static_cast<uint8_t>(result | (sign >> 24));
}

// Below 2^-64 or above 2^64 a scale takes the plain division (the
// reciprocal's correction is exact only away from underflow and overflow).
constexpr double kFp8ReciprocalMin = 5.421010862427522e-20;  // 2^-64
constexpr double kFp8ReciprocalMax = 1.8446744073709552e19;  // 2^64

// x / b from y = RN(1 / b): q = RN(x y) is within an ulp of x / b, r =
// x - b q is exact (one fma), and RN(q + r y) is RN(x / b) (Markstein's
// theorem), for b within [2^-64, 2^64] and |x / b| >= 2^-11 (x and r
// normal). Below that x or r may underflow and the quotient be an ulp off:
// it keeps its sign and stays under 2^-11, where float8_e4m3fn rounds it to
// the same zero. Where r is 0 (q exact, and x = -0 keeps its sign) or q is
// not finite (x is, or x / b rounds to, +-inf or NaN), q itself.
// tests/cpp/test_fp8.cpp checks it against the division, and the fp8 bits
// of both.
ROTARY_HOST_DEVICE float fused_multiply_add(float a, float b, float c) { return fmaf(a, b, c); }
ROTARY_HOST_DEVICE double fused_multiply_add(double a, double b, double c) { return fma(a, b, c); }
template <typename acc_t>
ROTARY_HOST_DEVICE acc_t divide_by_reciprocal(acc_t x, acc_t b, acc_t y) {
  const acc_t q = x * y;
  const acc_t r = fused_multiply_add(-b, q, x);
  const acc_t q1 = fused_multiply_add(r, y, q);
  return r == acc_t(0) || !(q - q == acc_t(0)) ? q : q1;
}

// A cache's fp8 scale, read once for the elements it divides. With
// `reciprocal` set the GPU may divide by multiplying with its reciprocal
// (divide_by_reciprocal: the same fp8 bits, no division per element);
// kReciprocal false divides, the path of a scale without it. The host
// divides. Without a scale (`scaled` false) x is left as it is, by a select:
// no arithmetic, so a NaN keeps its bits as torch's .to() keeps them.
template <typename acc_t>
struct Fp8Scale {
  acc_t b = 1, y = 1;
  bool reciprocal = true;
  bool scaled = true;

  ROTARY_HOST_DEVICE Fp8Scale(float scale, bool has_scale)
      : b(has_scale ? static_cast<acc_t>(scale) : acc_t(1)), y(acc_t(1) / b), scaled(has_scale) {
    const acc_t m = b < acc_t(0) ? -b : b;
    reciprocal = m >= acc_t(kFp8ReciprocalMin) && m <= acc_t(kFp8ReciprocalMax);
  }
  ROTARY_HOST_DEVICE explicit Fp8Scale(const float* scale)
      : Fp8Scale(scale != nullptr ? *scale : 1.0f, scale != nullptr) {}

  template <bool kReciprocal>
  ROTARY_HOST_DEVICE acc_t divide(acc_t x) const {
#if defined(__CUDA_ARCH__)
    const acc_t q = kReciprocal ? divide_by_reciprocal(x, b, y) : x / b;
#else
    const acc_t q = x / b;
#endif
    return scaled ? q : x;
  }
};

// v clamped to +-448 and rounded to float8_e4m3fn: the bits of torch's
// .clamp(-448, 448).to(torch.float8_e4m3fn) of it (NaN stays NaN).
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t fp8_of_quotient(acc_t v) {
  v = v > acc_t(448) ? acc_t(448) : (v < acc_t(-448) ? acc_t(-448) : v);
  return fp8_e4m3fn_bits(static_cast<float>(v));
}

// v / scale clamped to +-448 and rounded to float8_e4m3fn, the division in
// acc_t (float32, or float64 for double data), once: the bits of torch's
// (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn). kReciprocal: for a
// scale with `reciprocal` set only.
template <bool kReciprocal, typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, const Fp8Scale<acc_t>& scale) {
  return fp8_of_quotient(scale.template divide<kReciprocal>(v));
}
// The same for one element, its scale by pointer (null: none).
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, const float* scale) {
  return fp8_of_quotient(scale != nullptr ? v / static_cast<acc_t>(*scale) : v);
}

}  // namespace kernel
}  // namespace rotary
