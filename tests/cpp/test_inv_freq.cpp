// inv_freq from C++: positions past the freqs table computed in float64,
// with start_pos, ids, varlen and partial rotary.
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>

namespace {

using rotary_test::AllClose;
using rotary_test::ExpectError;
using rotary_test::ref_rope;
using rotary_test::tolerance_for;
using rotary_test::randn;
using rotary_test::longs;
using rotary_test::cu_from_lens;
using rotary_test::ref_partial;
using rotary_test::ref_varlen;
using rotary_test::inv_freq_f64;

// ---------------------------------------------------------------------------
// inv_freq: positions past the table

TEST(VariantsInvFreq, ComputesFarPositions) {
  at::manual_seed(5);
  const int64_t D = 16, L = 8;  // a table of 8 rows
  const auto freqs = rotary::rope_freqs(D, L);
  const auto inv = inv_freq_f64(D);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool interleaved : {true, false}) {
      for (int64_t where : {int64_t{1000000}, int64_t{1} << 31, int64_t{1} << 40}) {
        const auto x = randn({2, 2, 3, D}, dtype);
        const auto y = rotary::apply_rope(x, freqs, where, interleaved, std::nullopt, std::nullopt, false, std::nullopt, inv);
        EXPECT_TRUE(AllClose(y, ref_rope(x, where, interleaved), tolerance_for(dtype))) << "start " << where;
        // ids inside and outside the table
        const auto ids = longs({where, 3, where + 7, 0, where - 1, 7}).view({2, 3});
        const auto y2 = rotary::apply_rope(x, freqs, 0, interleaved, std::nullopt, ids, false, std::nullopt, inv);
        EXPECT_TRUE(AllClose(y2, ref_rope(x, 0, interleaved, ids), tolerance_for(dtype))) << "ids near " << where;
        const auto cu = cu_from_lens({4, 3}, at::kInt);
        const auto xv = randn({7, 2, D}, dtype);
        const auto yv = rotary::apply_rope(xv, freqs, where, interleaved, std::nullopt, std::nullopt, false, cu, inv);
        EXPECT_TRUE(AllClose(yv, ref_varlen(xv, cu, D, where, interleaved), tolerance_for(dtype)));
        // Partial: inv_freq has rotary_dim / 2 entries.
        const auto yp = rotary::apply_rope(
            x, rotary::rope_freqs(10, L), where, interleaved, std::nullopt, std::nullopt, false, std::nullopt, inv_freq_f64(10));
        EXPECT_TRUE(AllClose(yp, ref_partial(x, 10, where, interleaved), tolerance_for(dtype)));
      }
    }
  }
  // Without inv_freq the same call is an IndexError.
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(randn({1, 1, 2, D}), freqs, 1000000); }, {"apply_rope", "exceeds the freqs table length"});
}

}  // namespace
