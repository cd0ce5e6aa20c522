// float8_e4m3fn encoding shared by the KV-cache write and the prologue's
// fp8 q: framework-free, host and device.
#pragma once

#include "rope_params.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace rotary {
namespace kernel {

// The encoding's constants, on the bits of |f| (fp8_e4m3fn_bits, and the
// CPU's vector twin, store_fp8 in cpu/kernel/vec_isa.h).
constexpr uint32_t kFp8NanFrom = 1087u << 20;    // |f| >= 480: NaN
constexpr uint32_t kFp8NormalFrom = 121u << 23;  // |f| >= 2^-6: normal; below, subnormal
constexpr uint32_t kFp8DenormBits = 141u << 23;  // 2^14: a float add rounds a subnormal
// The exponent rebiased (7 - 127) and half the dropped mantissa added.
constexpr uint32_t kFp8NormalBias = (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;
constexpr float kFp8Max = 448.0f;  // the largest finite value

// float -> float8_e4m3fn bits, round to nearest even; |f| >= 480 and NaN give
// NaN (0x7f). The same arithmetic as c10's fp8e4m3fn_from_fp32_value, so the
// cache holds the bits torch's .to(torch.float8_e4m3fn) gives. All three
// cases are computed and one selected: no branch per element on the GPU.
ROTARY_HOST_DEVICE uint8_t fp8_e4m3fn_bits(float f) {
  uint32_t bits = bits_of_float(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  const uint32_t subnormal = bits_of_float(float_of_bits(bits) + float_of_bits(kFp8DenormBits)) - kFp8DenormBits;
  const uint32_t mant_odd = (bits >> 20) & 1u;
  const uint32_t normal = (bits + kFp8NormalBias + mant_odd) >> 20;
  const uint32_t result = bits >= kFp8NanFrom ? 0x7fu : (bits < kFp8NormalFrom ? subnormal : normal);
  return static_cast<uint8_t>(result | (sign >> 24));
}

// Scales within [2^-64, 2^64] divide as they are; others are first brought
// into [1, 2) by powers of two (Fp8Scale).
constexpr double kFp8ScaleMin = 5.421010862427522e-20;  // 2^-64
constexpr double kFp8ScaleMax = 1.8446744073709552e19;  // 2^64

// x / b from y = RN(1 / b): q = RN(x y) is within an ulp of x / b, r =
// x - b q is exact (one fma), and RN(q + r y) is RN(x / b) (Markstein's
// theorem), for b within [2^-64, 2^64] and |x / b| >= 2^-11 (x and r
// normal). Below that x or r may underflow and the quotient be an ulp off:
// it keeps its sign and stays under 2^-11, where float8_e4m3fn rounds it to
// the same zero. Where r is 0 (q exact, and x = -0 keeps its sign) or not
// a number (b is +-inf), or q is not finite (x is, or x / b rounds to,
// +-inf or NaN; b is 0 or NaN), q itself. tests/cpp/test_fp8.cpp checks it
// against the division, and the fp8 bits of both.
ROTARY_HOST_DEVICE float fused_multiply_add(float a, float b, float c) { return fmaf(a, b, c); }
ROTARY_HOST_DEVICE double fused_multiply_add(double a, double b, double c) { return fma(a, b, c); }
template <typename acc_t>
ROTARY_HOST_DEVICE acc_t divide_by_reciprocal(acc_t x, acc_t b, acc_t y) {
  const acc_t q = x * y;
  const acc_t r = fused_multiply_add(-b, q, x);
  const acc_t q1 = fused_multiply_add(r, y, q);
  return (r < acc_t(0) || r > acc_t(0)) && q - q == acc_t(0) ? q1 : q;
}

ROTARY_HOST_DEVICE int binary_exponent(float b) {
  int e = 0;
  frexpf(b, &e);
  return e;
}
ROTARY_HOST_DEVICE int binary_exponent(double b) {
  int e = 0;
  frexp(b, &e);
  return e;
}

// A cache's fp8 scale b, read once for the elements it divides. The GPU
// divides by multiplying with a reciprocal (quotient: the same fp8 bits, no
// division per element, no branch); the host divides. A b outside
// [2^-64, 2^64] is brought into [1, 2) as m = b p1 p2 (powers of two, of
// one sign of exponent: exact), and x / b computed as (x p1 p2) / m, the
// same real number: x p1 p2 is exact, or overflows to +-inf (then
// |x / b| >= 2^127, saturated) or underflows (then |x / b| < 2^-126,
// rounded to a signed zero). Without a scale (`scaled` false) x is left as
// it is, by a select: no arithmetic, so a NaN keeps its bits as torch's
// .to() keeps them.
template <typename acc_t>
struct Fp8Scale {
  acc_t b = 1;           // the scale, as the host divides by it
  acc_t m = 1, y = 1;    // b p1 p2, and RN(1 / m)
  acc_t p1 = 1, p2 = 1;  // powers of two
  bool scaled = true;

  ROTARY_HOST_DEVICE Fp8Scale(float scale, bool has_scale)
      : b(has_scale ? static_cast<acc_t>(scale) : acc_t(1)), m(b), scaled(has_scale) {
    const acc_t mag = b < acc_t(0) ? -b : b;  // NaN: no comparison holds
    if (mag > acc_t(0) && mag - mag == acc_t(0) && (mag < acc_t(kFp8ScaleMin) || mag > acc_t(kFp8ScaleMax))) {
      const int k = 1 - binary_exponent(b);  // b 2^k in [1, 2); |k| in [64, 149]
      const int k1 = k > 0 ? 64 : -64;
      p1 = static_cast<acc_t>(k1 > 0 ? kFp8ScaleMax : kFp8ScaleMin);
      p2 = static_cast<acc_t>(ldexp(1.0, k - k1));
      m = b * p1 * p2;
    }
    y = acc_t(1) / m;
  }
  ROTARY_HOST_DEVICE explicit Fp8Scale(const float* scale)
      : Fp8Scale(scale != nullptr ? *scale : 1.0f, scale != nullptr) {}

  // The GPU's x / b.
  ROTARY_HOST_DEVICE acc_t quotient(acc_t x) const { return divide_by_reciprocal(x * p1 * p2, m, y); }

  ROTARY_HOST_DEVICE acc_t divide(acc_t x) const {
#if defined(__CUDA_ARCH__)
    const acc_t q = quotient(x);
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
  const acc_t top = kFp8Max;
  v = v > top ? top : (v < -top ? -top : v);
  return fp8_e4m3fn_bits(static_cast<float>(v));
}

// v / scale clamped to +-448 and rounded to float8_e4m3fn, the division in
// acc_t (float32, or float64 for double data), once: the bits of torch's
// (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, const Fp8Scale<acc_t>& scale) {
  return fp8_of_quotient(scale.divide(v));
}
// The same for one element, its scale by pointer (null: none).
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, const float* scale) {
  return fp8_of_quotient(scale != nullptr ? v / static_cast<acc_t>(*scale) : v);
}

// Elements 2k and 2k + 1 of a vector as fp8 bytes 2k and 2k + 1 of the word
// W that holds its bytes (the cache's chunk, the prologue's fp8 q).
template <typename W, typename acc_t>
ROTARY_HOST_DEVICE W fp8_pair(int k, acc_t a, acc_t b, const Fp8Scale<acc_t>& scale) {
  return static_cast<W>(static_cast<W>(quantize_fp8(a, scale)) << (16 * k)) |
      static_cast<W>(static_cast<W>(quantize_fp8(b, scale)) << (16 * k + 8));
}

}  // namespace kernel
}  // namespace rotary
