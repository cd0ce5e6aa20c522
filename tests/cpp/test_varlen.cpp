// Packed variable-length batches (cu_seqlens, layout THD) from C++: the
// float64 reference run on each sequence of the packed batch alone
// (helpers.h: ref_varlen).
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <vector>

namespace {

using rotary_test::AllClose;
using rotary_test::poison_like;
using rotary_test::tolerance_for;
using rotary_test::OptTensor;
using rotary_test::kF64;
using rotary_test::randn;
using rotary_test::cu_from_lens;
using rotary_test::ref_varlen;
using rotary_test::Variants;

// ---------------------------------------------------------------------------
// Packed variable-length batches

TEST_P(Variants, VarlenMatchesPerSequenceReference) {
  const auto [dtype, interleaved] = GetParam();
  const std::vector<int64_t> lens = {3, 0, 5, 1, 0, 4};
  const int64_t T = 13, Hq = 4, Hk = 2, D = 20, L = 32, start = 2;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({T, Hq, D}, dtype);
  const auto k = randn({Hk, T, D}, dtype).transpose(0, 1);  // strided k
  const std::vector<OptTensor> forms = {std::nullopt, at::scalar_tensor(6, at::kLong), at::randint(0, L - start, {T}, at::kLong)};
  for (auto cu_dtype : {at::kInt, at::kLong}) {
    const auto cu = cu_from_lens(lens, cu_dtype);
    for (size_t i = 0; i < forms.size(); ++i) {
      poison_like(q);
      const auto P = rotary_test::op_positions(start, forms[i], /*packed=*/true);
      const auto y = rotary::apply_rope(q, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, false, cu);
      const auto [yq, yk] =
          rotary::apply_rope_qk(q, k, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, false, cu);
      EXPECT_TRUE(AllClose(y, ref_varlen(q, cu, D, start, interleaved, forms[i]), tolerance_for(dtype)))
          << "positions form " << i;
      EXPECT_TRUE(AllClose(yk, ref_varlen(k, cu, D, start, interleaved, forms[i]), tolerance_for(dtype)))
          << "positions form " << i;
      EXPECT_TRUE(at::equal(yq, y));
    }
  }
}

TEST_P(Variants, VarlenPartialInverseRoundTrip) {
  const auto [dtype, interleaved] = GetParam();
  const auto cu = cu_from_lens({2, 0, 6}, at::kInt);
  const int64_t T = 8, D = 14, r = 8;
  const auto freqs = rotary::rope_freqs(r, 32);
  const auto x = randn({T, 3, D}, dtype);
  const auto ids = at::randint(0, 30, {T}, at::kLong);
  // Absolute ids: start_pos 0, the reference's start 1 folded into them.
  const auto inv = rotary::apply_rope(x, freqs, 0, interleaved, std::nullopt, ids + 1, true, cu);
  EXPECT_TRUE(AllClose(inv, ref_varlen(x, cu, r, 1, interleaved, ids, true), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(inv.narrow(2, r, D - r), x.narrow(2, r, D - r)));
  if (dtype == at::kDouble) {
    const auto back = rotary::apply_rope(
        rotary::apply_rope(x, freqs, 0, interleaved, std::nullopt, ids + 1, false, cu), freqs, 0, interleaved,
        std::nullopt, ids + 1, true, cu);
    EXPECT_TRUE(AllClose(back, x, kF64));
  }
}

TEST(VariantsVarlen, EdgeBatches) {
  at::manual_seed(1);
  const auto freqs = rotary::rope_freqs(8, 16);
  const std::vector<std::vector<int64_t>> batches = {{}, {0}, {0, 0}, {7}, {0, 7}, {7, 0, 0}, {1, 1, 1, 1}, {2, 0, 0, 5}};
  for (const auto& lens : batches) {
    int64_t T = 0;
    for (int64_t n : lens) T += n;
    const auto cu = cu_from_lens(lens, at::kInt);
    const auto x = randn({T, 2, 8}, at::kDouble);
    for (bool interleaved : {true, false}) {
      const auto y = rotary::apply_rope(x, freqs, 3, interleaved, std::nullopt, std::nullopt, false, cu);
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_TRUE(AllClose(y, ref_varlen(x, cu, 8, 3, interleaved), kF64)) << "batch of " << lens.size();
    }
  }
  // One sequence is the plain BSHD call on it.
  const auto x = randn({9, 3, 16});
  const auto f16 = rotary::rope_freqs(16, 16);
  EXPECT_TRUE(at::equal(
      rotary::apply_rope(x, f16, 4, false, std::nullopt, std::nullopt, false, cu_from_lens({9}), std::nullopt, "THD"),
      rotary::apply_rope(x.unsqueeze(0), f16, 4, false, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BSHD")[0]));
}

}  // namespace
