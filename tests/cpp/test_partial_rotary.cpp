// Partial rotary from C++: the reference on x.narrow(-1, 0, r) (a head of
// size r) plus the tail copied unchanged (helpers.h: ref_partial).
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

namespace {

using rotary_test::AllClose;
using rotary_test::poison_like;
using rotary_test::tolerance_for;
using rotary_test::randn;
using rotary_test::ref_partial;
using rotary_test::Variants;

// ---------------------------------------------------------------------------
// Partial rotary

TEST_P(Variants, PartialRotaryRotatesOnlyTheFirstDims) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, Hq = 3, Hk = 1, S = 5, D = 40, start = 6;
  for (int64_t r : {2, 16, 34, 40}) {
    const auto freqs = rotary::rope_freqs(r, 32);
    const auto q = randn({B, Hq, S, D}, dtype);
    const auto k = randn({B, S, Hk, D}, dtype).transpose(1, 2);
    poison_like(q);
    const auto y = rotary::apply_rope(q, freqs, start, interleaved);
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, start, interleaved);
    EXPECT_TRUE(AllClose(y, ref_partial(q, r, start, interleaved), tolerance_for(dtype))) << "r " << r;
    EXPECT_TRUE(AllClose(yk, ref_partial(k, r, start, interleaved), tolerance_for(dtype))) << "r " << r;
    EXPECT_TRUE(at::equal(yq, y));
    EXPECT_TRUE(at::equal(y.narrow(3, r, D - r), q.narrow(3, r, D - r))) << "tail copied bit for bit, r " << r;
    // In place: [0, r) as out of place, [r, D) untouched (NaN stays NaN).
    auto x = q.clone();
    x.narrow(3, r, D - r).fill_(std::numeric_limits<double>::quiet_NaN());
    at::Tensor& ret = rotary::apply_rope_(x, freqs, start, interleaved);
    EXPECT_EQ(&ret, &x);
    EXPECT_TRUE(at::equal(x.narrow(3, 0, r), y.narrow(3, 0, r))) << "r " << r;
    EXPECT_TRUE(at::isnan(x.narrow(3, r, D - r)).all().item<bool>()) << "r " << r;
  }
}

}  // namespace
