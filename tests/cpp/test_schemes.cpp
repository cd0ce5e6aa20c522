// The older schemes (seed 001) from C++: rotary::sinusoidal_table and
// rotary::alibi_slopes / rotary::alibi_bias.
#include "helpers.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace {

using rotary_test::ExpectError;

// ---------------------------------------------------------------------------
// The older schemes (seed 001): sinusoidal table and ALiBi

TEST(Schemes, SinusoidalTableIsSeedFormula) {
  for (double base : {10000.0, 500.0}) {
    const int64_t n = 37, d = 16;
    const auto pe = rotary::sinusoidal_table(n, d, base);
    ASSERT_EQ(pe.scalar_type(), at::kFloat);
    ASSERT_EQ(pe.sizes(), at::IntArrayRef({n, d}));
    const auto a = pe.accessor<float, 2>();
    for (int64_t pos = 0; pos < n; ++pos) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double theta = static_cast<double>(pos) / std::pow(base, static_cast<double>(2 * i) / d);
        EXPECT_EQ(a[pos][2 * i], static_cast<float>(std::sin(theta))) << pos << ", " << i;
        EXPECT_EQ(a[pos][2 * i + 1], static_cast<float>(std::cos(theta))) << pos << ", " << i;
      }
    }
  }
  EXPECT_EQ(rotary::sinusoidal_table(0, 8).sizes(), at::IntArrayRef({0, 8}));
  // Row 0: sin 0 = 0, cos 0 = 1.
  EXPECT_TRUE(at::equal(rotary::sinusoidal_table(1, 4)[0], at::tensor({0.f, 1.f, 0.f, 1.f})));
}

TEST(Schemes, AlibiSlopesAndBias) {
  for (int64_t heads : {1, 4, 8, 12}) {
    const auto m = rotary::alibi_slopes(heads);
    ASSERT_EQ(m.scalar_type(), at::kFloat);
    ASSERT_EQ(m.numel(), heads);
    for (int64_t h = 0; h < heads; ++h) {
      EXPECT_EQ(m[h].item<float>(), static_cast<float>(std::pow(2.0, -8.0 * (h + 1) / heads)));
    }
  }
  // Powers of two for 8 heads: 1/2, 1/4, ..., 1/256.
  EXPECT_EQ(rotary::alibi_slopes(8)[0].item<float>(), 0.5f);
  EXPECT_EQ(rotary::alibi_slopes(8)[7].item<float>(), 1.0f / 256);
  const int64_t H = 3, S = 6;
  for (bool causal : {true, false}) {
    const auto bias = rotary::alibi_bias(H, S, causal);
    ASSERT_EQ(bias.sizes(), at::IntArrayRef({H, S, S}));
    ASSERT_EQ(bias.scalar_type(), at::kFloat);
    const auto a = bias.accessor<float, 3>();
    for (int64_t h = 0; h < H; ++h) {
      const double slope = std::pow(2.0, -8.0 * (h + 1) / H);
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          if (causal && j > i) {
            EXPECT_TRUE(std::isinf(a[h][i][j]) && a[h][i][j] < 0) << h << " " << i << " " << j;
          } else {
            EXPECT_EQ(a[h][i][j], static_cast<float>(-slope * std::abs(i - j))) << h << " " << i << " " << j;
          }
        }
      }
    }
  }
  EXPECT_EQ(rotary::alibi_bias(2, 0).sizes(), at::IntArrayRef({2, 0, 0}));
}

TEST(Schemes, InvalidArguments) {
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(-1, 8); }, {"sinusoidal_table: n", ">= 0, got -1"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 7); }, {"sinusoidal_table: d", "even and > 0, got 7"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 0); }, {"sinusoidal_table: d", "got 0"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 8, 0.0); }, {"sinusoidal_table: base must be finite and > 0"});
  ExpectError<c10::ValueError>(
      [] { rotary::sinusoidal_table(4, 8, std::numeric_limits<double>::quiet_NaN()); }, {"base must be finite"});
  ExpectError<c10::ValueError>([] { rotary::alibi_slopes(0); }, {"alibi_slopes: n_heads must be > 0, got 0"});
  ExpectError<c10::ValueError>([] { rotary::alibi_bias(-2, 4); }, {"alibi_bias: n_heads must be > 0, got -2"});
  ExpectError<c10::ValueError>([] { rotary::alibi_bias(2, -1); }, {"alibi_bias: seq_len must be >= 0, got -1"});
}

}  // namespace
