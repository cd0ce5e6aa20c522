// The float8_e4m3fn encoding (params/fp8.h) against c10's, and the GPU's
// division by a cache scale (Fp8Scale::quotient: x times the scale's
// reciprocal, one fma correction, out-of-range scales normalized by powers
// of two) against the division itself, bit for bit.
// Both are plain arithmetic, so the host checks what the device computes
// (fmaf is the IEEE fused multiply-add on both).
#include "params/fp8.h"

#include <c10/util/Float8_e4m3fn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using rotary::kernel::bits_of_float;
using rotary::kernel::float_of_bits;

// Low 12 bits that sit on and around the rounding points of every format
// here (exact, half way, just off it), under every value of the top 20
// bits: sign, exponent and the mantissa's top 11 bits.
constexpr uint32_t kLowBits[] = {0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff};

template <typename F>
void for_each_float(F&& f) {
  for (uint32_t top = 0; top < (1u << 20); ++top) {
    for (const uint32_t low : kLowBits) f(float_of_bits(top << 12 | low));
  }
}

bool same(float a, float b) {
  return bits_of_float(a) == bits_of_float(b) || (std::isnan(a) && std::isnan(b));
}
bool same(double a, double b) {
  uint64_t x, y;
  std::memcpy(&x, &a, 8);
  std::memcpy(&y, &b, 8);
  return x == y || (std::isnan(a) && std::isnan(b));
}

TEST(Fp8Encoding, MatchesC10OnEveryRoundingPoint) {
  int64_t bad = 0;
  for_each_float([&](float f) {
    const uint8_t want = c10::detail::fp8e4m3fn_from_fp32_value(f);
    if (rotary::kernel::fp8_e4m3fn_bits(f) != want && bad++ < 5) {
      ADD_FAILURE() << "bits 0x" << std::hex << bits_of_float(f) << ": got 0x"
                    << int(rotary::kernel::fp8_e4m3fn_bits(f)) << ", c10 0x" << int(want);
    }
  });
  EXPECT_EQ(bad, 0);
}

// Scales: typical ones, the ends of the range taken as it is, random ones
// across it, and past it (brought into [1, 2) by powers of two):
// subnormal, tiny, huge, the largest float.
std::vector<float> scales() {
  const float lo = static_cast<float>(rotary::kernel::kFp8ScaleMin);
  const float hi = static_cast<float>(rotary::kernel::kFp8ScaleMax);
  std::vector<float> s = {1.0f, 3.0f, 0.1f, 0.0123f, 448.0f / 240.0f, 1.0f / 3.0f, 7.0f, 0.0078125f, lo, hi,
                          std::nextafter(hi, 0.0f), std::nextafter(lo, 0.0f), std::nextafter(hi, 1e30f), -2.5f,
                          1e-30f, -3.7e-25f, 6.1e21f, 1e30f, std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), 3.3e-42f, 1.1e-38f};
  std::mt19937 gen(8);
  std::uniform_real_distribution<float> exponent(-64.0f, 64.0f);
  for (int i = 0; i < 8; ++i) s.push_back(std::exp2(exponent(gen)) * (1.0f + 0.37f * static_cast<float>(i)));
  return s;
}

// Where 2^-11 <= |x / b| < 2^127, inf or NaN, the same bits; below (where x
// or the correction's r may underflow, no longer exact) the same sign and
// both below 2^-11, where float8_e4m3fn rounds to that signed zero; above,
// a scale under 2^-64 may overflow x's power-of-two step to the same-signed
// inf (both saturate). And the fp8 bits, the property the cache needs, for
// every x.
template <typename acc_t>
bool agrees(acc_t got, acc_t want) {
  if (same(got, want)) return true;
  const acc_t zero = acc_t(1) / acc_t(2048), huge = std::ldexp(acc_t(1), 127);
  if (std::signbit(got) != std::signbit(want)) return false;
  return (std::fabs(want) < zero && std::fabs(got) < zero) || (std::fabs(want) >= huge && std::isinf(got));
}

TEST(Fp8Divide, QuotientIsTheDivisionInFloat) {
  for (const float b : scales()) {
    const rotary::kernel::Fp8Scale<float> scale(&b);
    int64_t bad = 0;
    for_each_float([&](float x) {
      const float got = scale.quotient(x), want = x / b;
      const bool ok = agrees(got, want) &&
          rotary::kernel::fp8_of_quotient(got) == rotary::kernel::fp8_of_quotient(want);
      if (!ok && bad++ < 5) {
        ADD_FAILURE() << "x bits 0x" << std::hex << bits_of_float(x) << " / " << b << ": got " << got << ", want "
                      << want;
      }
    });
    EXPECT_EQ(bad, 0) << "scale " << b;
  }
}

TEST(Fp8Divide, QuotientIsTheDivisionInDouble) {
  std::mt19937_64 gen(9);
  std::vector<double> xs = {0.0, -0.0, std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(),
                            std::numeric_limits<double>::denorm_min(), std::numeric_limits<double>::max()};
  std::uniform_real_distribution<double> exponent(-40.0, 40.0);
  for (int i = 0; i < 1 << 19; ++i) {
    uint64_t u = gen();
    double x;
    std::memcpy(&x, &u, 8);
    xs.push_back(x);                                          // any bits
    xs.push_back(std::exp2(exponent(gen)) * (1.0 + x * 0.0));  // the range a model's values take
    xs.back() = std::nextafter(xs.back(), static_cast<double>(u % 3) - 1.0);
  }
  for (const float bf : scales()) {
    const rotary::kernel::Fp8Scale<double> scale(&bf);
    int64_t bad = 0;
    for (const double x : xs) {
      const double got = scale.quotient(x), want = x / scale.b;
      const bool ok = agrees(got, want) &&
          rotary::kernel::fp8_of_quotient(got) == rotary::kernel::fp8_of_quotient(want);
      if (!ok && bad++ < 5) ADD_FAILURE() << x << " / " << scale.b << ": got " << got << ", want " << want;
    }
    EXPECT_EQ(bad, 0) << "scale " << bf;
  }
}

// Scales no quotient is a number for, or every one is: the division's.
TEST(Fp8Divide, SpecialScales) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float b : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
    const rotary::kernel::Fp8Scale<float> scale(&b);
    int64_t bad = 0;
    for_each_float([&](float x) {
      const float got = scale.quotient(x), want = x / b;
      if (!same(got, want) && bad++ < 5) ADD_FAILURE() << x << " / " << b << ": got " << got << ", want " << want;
    });
    EXPECT_EQ(bad, 0) << "scale " << b;
  }
}

// A scale past [2^-64, 2^64] becomes m in [1, 2) times powers of two.
TEST(Fp8Divide, OutOfRangeScalesAreNormalized) {
  for (const float b : {1e-30f, 3.3e-42f, 6.1e21f, std::numeric_limits<float>::max()}) {
    const rotary::kernel::Fp8Scale<float> scale(&b);
    EXPECT_TRUE(std::fabs(scale.m) >= 1.0f && std::fabs(scale.m) < 2.0f) << b;
    EXPECT_EQ(static_cast<double>(scale.m), static_cast<double>(b) * scale.p1 * scale.p2) << b;
  }
  const float in_range = 0.37f;
  const rotary::kernel::Fp8Scale<float> plain(&in_range);
  EXPECT_TRUE(plain.m == in_range && plain.p1 == 1.0f && plain.p2 == 1.0f);
}

// A scale by value and by pointer are one scale; none leaves every x as it
// is, NaNs bit for bit (a cache without a scale holds x's own fp8 bits).
TEST(Fp8Divide, ScaleFormsAgree) {
  for (const float b : scales()) {
    const rotary::kernel::Fp8Scale<float> by_value(b, true), by_pointer(&b);
    EXPECT_EQ(bits_of_float(by_value.b), bits_of_float(by_pointer.b));
    EXPECT_EQ(bits_of_float(by_value.y), bits_of_float(by_pointer.y));
    EXPECT_EQ(bits_of_float(by_value.m), bits_of_float(by_pointer.m));
  }
  const rotary::kernel::Fp8Scale<float> none(nullptr), unset(123.0f, false);
  EXPECT_TRUE(none.b == 1.0f && none.y == 1.0f && !none.scaled);
  EXPECT_TRUE(unset.b == 1.0f && !unset.scaled);
  int64_t bad = 0;
  for_each_float([&](float x) {
    const uint8_t want = rotary::kernel::fp8_e4m3fn_bits(x > 448.0f ? 448.0f : (x < -448.0f ? -448.0f : x));
    if (rotary::kernel::quantize_fp8(x, none) != want && bad++ < 5) ADD_FAILURE() << x;
    if (bits_of_float(none.divide(x)) != bits_of_float(x) && bad++ < 5) ADD_FAILURE() << x;  // NaNs too
    if (!same(none.quotient(x), x) && !std::isnan(x) && bad++ < 5) ADD_FAILURE() << x;
  });
  EXPECT_EQ(bad, 0);
}

}  // namespace
