// Numerical tests of the functional API against the float64 reference: the
// inverse rotation (inverse=true) and conjugated freqs tables, which turn
// by -angle, rows past the table (from inv_freq) and gradients included.
// A file of its own to be read in one sitting (the rest of the numerics:
// test_ops_numerics.cpp).
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>

namespace {

using rotary_test::AllClose;
using rotary_test::ref_rope;
using rotary_test::Seeded;

using rotary_test::kF32;
using rotary_test::kF64;

using rotary_test::randn;

// ---------------------------------------------------------------------------
// inverse and conjugated tables.

TEST_F(Seeded, InverseMatchesNegativeAngle) {
  const int64_t D = 20, L = 32;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({2, 3, 5, D}, at::kDouble);
  const auto ids = at::randint(0, L, {2, 5}, at::kLong);
  for (bool interleaved : {true, false}) {
    EXPECT_TRUE(AllClose(
        rotary::apply_rope(x, freqs, 6, interleaved, std::nullopt, std::nullopt, true),
        ref_rope(x, 6, interleaved, std::nullopt, true), kF64));
    EXPECT_TRUE(AllClose(
        rotary::apply_rope(x, freqs, 0, interleaved, std::nullopt, ids, true), ref_rope(x, 0, interleaved, ids, true), kF64));
  }
}

TEST_F(Seeded, InverseUndoesForward) {
  const int64_t D = 64, L = 256;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto offsets = at::tensor(std::vector<int64_t>{3, 100}, at::kLong);
  const auto ids = at::randint(0, L - 10, {2, 9}, at::kLong);
  for (bool interleaved : {true, false}) {
    const auto x = randn({2, 4, 9, D}, at::kDouble);
    const auto k = randn({2, 2, 9, D}, at::kDouble);
    for (const std::optional<at::Tensor>& pos : {std::optional<at::Tensor>(), std::optional<at::Tensor>(offsets),
                                                 std::optional<at::Tensor>(ids)}) {
      const auto P = rotary_test::op_positions(10, pos);
      const auto y = rotary::apply_rope(x, freqs, P.start_pos, interleaved, P.offsets, P.position_ids);
      const auto back = rotary::apply_rope(y, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, true);
      EXPECT_TRUE(AllClose(back, x, kF64));
      const auto [yq, yk] = rotary::apply_rope_qk(x, k, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, true);
      const auto [bq, bk] =
          rotary::apply_rope_qk(yq, yk, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, false);
      EXPECT_TRUE(AllClose(bq, x, kF64));
      EXPECT_TRUE(AllClose(bk, k, kF64));
    }
    // fp32 round trip.
    const auto xf = randn({1, 2, 9, D});
    EXPECT_TRUE(AllClose(
        rotary::apply_rope(rotary::apply_rope(xf, freqs, 200, interleaved), freqs, 200, interleaved, std::nullopt, std::nullopt, true),
        xf, kF32));
  }
}

TEST_F(Seeded, ConjugatedFreqsRotateByInverse) {
  const int64_t D = 24, L = 32;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto conj = freqs.conj();  // lazy: conj bit set, same memory
  ASSERT_TRUE(conj.is_conj());
  const auto x = randn({2, 2, 6, D}, at::kDouble);
  for (bool interleaved : {true, false}) {
    EXPECT_TRUE(AllClose(
        rotary::apply_rope(x, conj, 5, interleaved), ref_rope(x, 5, interleaved, std::nullopt, true), kF64));
    // Inverse of the conjugate is the plain rotation.
    EXPECT_TRUE(AllClose(rotary::apply_rope(x, conj, 5, interleaved, std::nullopt, std::nullopt, true), ref_rope(x, 5, interleaved), kF64));
    // Same as a materialised conjugate.
    EXPECT_TRUE(at::equal(rotary::apply_rope(x, conj, 5, interleaved), rotary::apply_rope(x, conj.resolve_conj(), 5, interleaved)));
    const auto [yq, yk] = rotary::apply_rope_qk(x, x, conj, 5, interleaved);
    EXPECT_TRUE(AllClose(yq, ref_rope(x, 5, interleaved, std::nullopt, true), kF64));
    EXPECT_TRUE(AllClose(yk, ref_rope(x, 5, interleaved, std::nullopt, true), kF64));
  }
  EXPECT_TRUE(conj.is_conj());  // the caller's view is not resolved in place
  EXPECT_FALSE(freqs.is_conj());
}

// freqs.conj() turns by -angle everywhere, rows past the table included
// (computed from inv_freq); so do its gradients (+angle).
TEST(ConjugateTable, PastTheTableWithInvFreqTurnsBackwards) {
  const at::Tensor table = rotary::rope_freqs(8, 4);
  const auto f = rotary::compute_frequencies(8, 10000.0);
  const at::Tensor inv = at::tensor(f.inv_freq, at::kDouble);
  const auto tol = rotary_test::tolerance_for(at::kDouble);
  for (bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "inverse=true" : "inverse=false");
    const at::Tensor x = randn({1, 2, 6, 8}, at::kDouble), k = randn({1, 1, 6, 8}, at::kDouble);
    const at::Tensor ex = rotary_test::ref_rope(x, 1, true, std::nullopt, !inverse);
    const at::Tensor ek = rotary_test::ref_rope(k, 1, true, std::nullopt, !inverse);
    EXPECT_TRUE(rotary_test::AllClose(
        rotary::apply_rope(x, table.conj(), 1, true, std::nullopt, std::nullopt, inverse, std::nullopt, inv), ex, tol));
    auto [oq, ok] = rotary::apply_rope_qk(x, k, table.conj(), 1, true, std::nullopt, std::nullopt, inverse, std::nullopt, inv);
    EXPECT_TRUE(rotary_test::AllClose(oq, ex, tol));
    EXPECT_TRUE(rotary_test::AllClose(ok, ek, tol));
    at::Tensor xi = x.clone(), ki = k.clone();
    rotary::apply_rope_qk_(xi, ki, table.conj(), 1, true, std::nullopt, std::nullopt, inverse, std::nullopt, inv);
    EXPECT_TRUE(rotary_test::AllClose(xi, ex, tol));
    EXPECT_TRUE(rotary_test::AllClose(ki, ek, tol));

    const at::Tensor leaf = x.clone().requires_grad_(), g = randn({1, 2, 6, 8}, at::kDouble);
    rotary::apply_rope(leaf, table.conj(), 1, true, std::nullopt, std::nullopt, inverse, std::nullopt, inv).backward(g);
    EXPECT_TRUE(rotary_test::AllClose(leaf.grad(), rotary_test::ref_rope(g, 1, true, std::nullopt, inverse), tol));
  }
}

}  // namespace
