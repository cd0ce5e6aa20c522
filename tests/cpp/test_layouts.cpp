// RoPE in the BSHD / SBHD layouts from C++ against the float64 reference of
// reference.h: a layout is a view of the reference's [B, H, S, D]
// (helpers.h: ref_partial).
//
// This file also instantiates the Variants suite (helpers.h) for every dtype
// and pairing: its TEST_Ps live here and in test_varlen.cpp,
// test_partial_rotary.cpp and test_inplace.cpp.
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using rotary_test::AllClose;
using rotary_test::poison_like;
using rotary_test::tolerance_for;
using rotary_test::OptTensor;
using rotary_test::randn;
using rotary_test::longs;
using rotary_test::shape_in;
using rotary_test::to_bhsd;
using rotary_test::ref_partial;
using rotary_test::case_name;
using rotary_test::Variants;

// ---------------------------------------------------------------------------
// Layouts

TEST_P(Variants, LayoutsMatchReference) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, Hq = 4, Hk = 2, S = 5, D = 20, start = 3;
  const auto freqs = rotary::rope_freqs(D, 32);
  for (const std::string layout : {"BHSD", "BSHD", "SBHD"}) {
    const auto q = randn(shape_in(layout, B, Hq, S, D), dtype);
    const auto k = randn(shape_in(layout, B, Hk, S, D), dtype);
    const auto q_before = q.clone();
    poison_like(q);
    const auto y = rotary::apply_rope(q, freqs, start, interleaved, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, layout);
    const auto [yq, yk] =
        rotary::apply_rope_qk(q, k, freqs, start, interleaved, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, layout);
    EXPECT_TRUE(AllClose(y, ref_partial(q, D, start, interleaved, {}, false, layout), tolerance_for(dtype))) << layout;
    EXPECT_TRUE(AllClose(yk, ref_partial(k, D, start, interleaved, {}, false, layout), tolerance_for(dtype))) << layout;
    EXPECT_TRUE(at::equal(yq, y)) << layout;
    EXPECT_EQ(y.strides(), q.strides()) << "the output keeps the input's layout (" << layout << ")";
    EXPECT_TRUE(at::equal(q, q_before));
    // The layout name only picks the view: the BHSD call on it gives the same bits.
    EXPECT_TRUE(at::equal(to_bhsd(y, layout), rotary::apply_rope(to_bhsd(q, layout), freqs, start, interleaved)));
  }
}

TEST_P(Variants, LayoutsWithPositionsAndPartialRotary) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 3, H = 2, S = 4, D = 12, r = 8, L = 40, start = 2;
  const auto freqs = rotary::rope_freqs(r, L);
  const std::vector<OptTensor> forms = {
      std::nullopt, at::scalar_tensor(5, at::kLong), longs({0, 20, 3}), longs({11}),
      at::randint(0, L - start, {B, S}, at::kLong), at::randint(0, L - start, {1, S}, at::kLong),
      at::randint(0, L - start, {B, 1}, at::kLong)};
  for (const std::string layout : {"BSHD", "SBHD"}) {
    const auto x = randn(shape_in(layout, B, H, S, D), dtype);
    for (size_t i = 0; i < forms.size(); ++i) {
      const auto P = rotary_test::op_positions(start, forms[i]);
      const auto y = rotary::apply_rope(
          x, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, false, std::nullopt, std::nullopt, layout);
      EXPECT_TRUE(AllClose(y, ref_partial(x, r, start, interleaved, forms[i], false, layout), tolerance_for(dtype)))
          << layout << " positions form " << i;
      EXPECT_TRUE(at::equal(y.narrow(3, r, D - r), x.narrow(3, r, D - r)));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes,
    Variants,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16), ::testing::Bool()),
    case_name);

}  // namespace
