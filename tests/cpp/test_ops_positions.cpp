// Numerical tests of the functional API against the float64 reference, the
// positions: start_pos (up to the table's last row, single-token decode),
// edge sizes (empty tensors, grouped and multi-query heads, long
// sequences), offsets ([] / [B] / [1]) and absolute ids ([B, S] / [1, S]),
// and the property RoPE is for: <rope(q, m), rope(k, n)> depends only on
// m - n. A file of its own to be read in one sitting (the rest of the
// numerics: test_ops_numerics.cpp).
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <utility>
#include <vector>

namespace {

using rotary_test::AllClose;
using rotary_test::ref_rope;
using rotary_test::Seeded;
using rotary_test::tolerance_for;

using rotary_test::kF32;
using rotary_test::kF64;

using rotary_test::randn;

// ---------------------------------------------------------------------------
// start_pos and edge sizes.

TEST_F(Seeded, StartPosOffsetsRows) {
  const int64_t D = 32, L = 64;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({2, 3, 8, D});
  for (int64_t start : {0, 1, 13, 50}) {
    for (bool interleaved : {true, false}) {
      EXPECT_TRUE(AllClose(rotary::apply_rope(x, freqs, start, interleaved), ref_rope(x, start, interleaved), kF32))
          << "start_pos " << start;
    }
  }
  // Token s at start_pos p is token s + p of a longer sequence.
  const auto long_x = randn({1, 1, 10, D});
  const auto full = rotary::apply_rope(long_x, freqs, 0);
  const auto tail = rotary::apply_rope(long_x.slice(2, 4), freqs, 4);
  EXPECT_TRUE(at::allclose(tail, full.slice(2, 4), 0.0, 1e-6));
}

TEST_F(Seeded, DecodeSingleToken) {
  const int64_t D = 128, L = 256;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({4, 8, 1, D});
  const auto k = randn({4, 2, 1, D});
  for (bool interleaved : {true, false}) {
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 200, interleaved);
    EXPECT_TRUE(AllClose(yq, ref_rope(q, 200, interleaved), kF32));
    EXPECT_TRUE(AllClose(yk, ref_rope(k, 200, interleaved), kF32));
    EXPECT_TRUE(AllClose(rotary::apply_rope(q, freqs, L - 1, interleaved), ref_rope(q, L - 1, interleaved), kF32));
  }
}

TEST_F(Seeded, StartPosPlusSeqEqualsTableLength) {
  const int64_t D = 16, L = 24, S = 6;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({2, 2, S, D});
  const auto y = rotary::apply_rope(x, freqs, L - S);  // uses the last row exactly
  EXPECT_TRUE(AllClose(y, ref_rope(x, L - S), kF32));
  const auto [yq, yk] = rotary::apply_rope_qk(x, x, freqs, L - S, false);
  EXPECT_TRUE(AllClose(yq, ref_rope(x, L - S, false), kF32));
  EXPECT_TRUE(AllClose(yk, ref_rope(x, L - S, false), kF32));
  // The whole table, from row 0.
  const auto whole = randn({1, 1, L, D});
  EXPECT_TRUE(AllClose(rotary::apply_rope(whole, freqs, 0), ref_rope(whole, 0), kF32));
}

TEST_F(Seeded, EmptyTensors) {
  const int64_t D = 8, L = 16;
  const auto freqs = rotary::rope_freqs(D, L);
  const std::vector<std::vector<int64_t>> shapes = {{0, 2, 3, D}, {2, 0, 3, D}, {2, 2, 0, D}, {0, 0, 0, D}};
  for (const auto& shape : shapes) {
    for (auto dtype : {at::kFloat, at::kHalf}) {
      const auto x = at::empty(shape, dtype);
      const auto y = rotary::apply_rope(x, freqs, 3);
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_EQ(y.scalar_type(), dtype);
      const auto [yq, yk] = rotary::apply_rope_qk(x, x, freqs, 3);
      EXPECT_EQ(yq.sizes(), x.sizes());
      EXPECT_EQ(yk.sizes(), x.sizes());
    }
  }
  // seq 0 is allowed even at the end of the table.
  EXPECT_EQ(rotary::apply_rope(at::empty({1, 1, 0, D}), freqs, L).sizes(), at::IntArrayRef({1, 1, 0, D}));
  // k with no heads next to a non-empty q: q is still rotated.
  const auto q = randn({2, 3, 4, D});
  const auto [yq, yk] = rotary::apply_rope_qk(q, at::empty({2, 0, 4, D}), freqs, 1);
  EXPECT_TRUE(AllClose(yq, ref_rope(q, 1), kF32));
  EXPECT_EQ(yk.sizes(), at::IntArrayRef({2, 0, 4, D}));
}

TEST_F(Seeded, GroupedAndMultiQueryHeads) {
  const int64_t B = 2, S = 6, D = 64, L = 32;
  const auto freqs = rotary::rope_freqs(D, L);
  const std::vector<std::pair<int64_t, int64_t>> heads = {{8, 2}, {8, 1}, {1, 4}, {3, 3}};
  for (const auto& [Hq, Hk] : heads) {
    const auto q = randn({B, Hq, S, D});
    const auto k = randn({B, Hk, S, D});
    for (bool interleaved : {true, false}) {
      const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 4, interleaved);
      EXPECT_EQ(yq.sizes(), q.sizes());
      EXPECT_EQ(yk.sizes(), k.sizes());
      EXPECT_TRUE(AllClose(yq, ref_rope(q, 4, interleaved), kF32)) << "Hq " << Hq << " Hk " << Hk;
      EXPECT_TRUE(AllClose(yk, ref_rope(k, 4, interleaved), kF32)) << "Hq " << Hq << " Hk " << Hk;
    }
  }
}

TEST_F(Seeded, LongSequenceManyThreadsLargePositions) {
  // Enough rows to split across threads, near the end of a long table.
  const int64_t B = 2, H = 4, S = 300, D = 64, L = 8192;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({B, H, S, D});
  const auto k = randn({B, 1, S, D});
  for (bool interleaved : {true, false}) {
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, L - S, interleaved);
    EXPECT_TRUE(AllClose(yq, ref_rope(q, L - S, interleaved), kF32));
    EXPECT_TRUE(AllClose(yk, ref_rope(k, L - S, interleaved), kF32));
  }
}

// ---------------------------------------------------------------------------
// positions: offsets ([] / [B] / [1]) and absolute ids ([B, S] / [1, S]).

TEST_F(Seeded, PositionsScalarOffset) {
  const int64_t B = 2, H = 2, S = 5, D = 16, L = 32;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({B, H, S, D}, at::kDouble);
  const auto off = at::scalar_tensor(7, at::kLong);
  ASSERT_EQ(off.dim(), 0);
  for (bool interleaved : {true, false}) {
    const auto y = rotary::apply_rope(x, freqs, 3, interleaved, off);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 3, interleaved, off), kF64));
    // A 0-d offset is the same as a larger start_pos.
    EXPECT_TRUE(AllClose(y, ref_rope(x, 10, interleaved), kF64));
  }
}

TEST_F(Seeded, PositionsPerBatchOffsets) {
  const int64_t B = 3, H = 2, S = 4, D = 10, L = 40;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({B, H, S, D}, at::kDouble);
  const auto offsets = at::tensor(std::vector<int64_t>{0, 9, 30}, at::kLong);
  for (bool interleaved : {true, false}) {
    const auto y = rotary::apply_rope(x, freqs, 2, interleaved, offsets);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 2, interleaved, offsets), kF64));
    // Batch row b equals a plain call at start_pos 2 + offsets[b].
    for (int64_t b = 0; b < B; ++b) {
      const auto xb = x.narrow(0, b, 1);
      EXPECT_TRUE(AllClose(y.narrow(0, b, 1), ref_rope(xb, 2 + offsets[b].item<int64_t>(), interleaved), kF64));
    }
  }
  // [1] broadcasts over the batch.
  const auto one = at::tensor(std::vector<int64_t>{5}, at::kLong);
  EXPECT_TRUE(AllClose(rotary::apply_rope(x, freqs, 0, true, one), ref_rope(x, 5), kF64));
  // qk shares the offsets.
  const auto k = randn({B, 1, S, D}, at::kDouble);
  const auto [yq, yk] = rotary::apply_rope_qk(x, k, freqs, 1, false, offsets);
  EXPECT_TRUE(AllClose(yq, ref_rope(x, 1, false, offsets), kF64));
  EXPECT_TRUE(AllClose(yk, ref_rope(k, 1, false, offsets), kF64));
}

TEST_F(Seeded, PositionsAbsoluteIds) {
  const int64_t B = 2, H = 3, S = 6, D = 12, L = 50;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({B, H, S, D}, at::kDouble);
  const auto ids = at::randint(0, L - 4, {B, S}, at::kLong);  // arbitrary, unsorted, repeats allowed
  for (bool interleaved : {true, false}) {
    const auto y = rotary::apply_rope(x, freqs, 0, interleaved, std::nullopt, ids + 4);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 4, interleaved, ids), kF64));
  }
  // Non-contiguous ids ([S, B] transposed) are read through their strides.
  const auto ids_t = ids.t().contiguous().t();
  ASSERT_FALSE(ids_t.is_contiguous());
  EXPECT_TRUE(AllClose(rotary::apply_rope(x, freqs, 0, true, std::nullopt, ids_t), ref_rope(x, 0, true, ids), kF64));
  // [1, S] ids broadcast over the batch.
  const auto shared = at::arange(S, at::kLong).flip(0).unsqueeze(0) * 3;
  const auto k = randn({B, 1, S, D}, at::kDouble);
  const auto [yq, yk] = rotary::apply_rope_qk(x, k, freqs, 0, false, std::nullopt, shared);
  EXPECT_TRUE(AllClose(yq, ref_rope(x, 0, false, shared), kF64));
  EXPECT_TRUE(AllClose(yk, ref_rope(k, 0, false, shared), kF64));
  // ids = arange(S) is the default numbering.
  const auto arange_ids = at::arange(S, at::kLong).unsqueeze(0).expand({B, S});
  EXPECT_TRUE(AllClose(rotary::apply_rope(x, freqs, 0, true, std::nullopt, arange_ids + 9), ref_rope(x, 9), kF64));
}

TEST_F(Seeded, PositionsWith16BitInputs) {
  const int64_t B = 2, H = 2, S = 3, D = 64, L = 64;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto ids = at::tensor(std::vector<int64_t>{1, 40, 2, 63, 0, 7}, at::kLong).view({B, S});
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    const auto x = randn({B, H, S, D}, dtype);
    EXPECT_TRUE(AllClose(rotary::apply_rope(x, freqs, 0, false, std::nullopt, ids), ref_rope(x, 0, false, ids), tolerance_for(dtype)));
  }
}

// The seed's central claim: <rope(q, m), rope(k, n)> depends only on m - n.
TEST_F(Seeded, DotProductDependsOnlyOnRelativePosition) {
  const int64_t D = 64, L = 128;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({1, 1, 1, D}, at::kDouble);
  const auto k = randn({1, 1, 1, D}, at::kDouble);
  for (bool interleaved : {true, false}) {
    auto score = [&](int64_t m, int64_t n) {
      return (rotary::apply_rope(q, freqs, m, interleaved) * rotary::apply_rope(k, freqs, n, interleaved))
          .sum()
          .item<double>();
    };
    EXPECT_NEAR(score(3, 7), score(13, 17), 1e-5);
    EXPECT_NEAR(score(0, 0), (q * k).sum().item<double>(), 1e-5);
    EXPECT_NEAR(score(100, 90), score(20, 10), 1e-5);
  }
}

}  // namespace
