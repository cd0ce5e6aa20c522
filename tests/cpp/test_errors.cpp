// Argument validation of the functional API: each bad input raises the right
// c10 exception type (ValueError / TypeError / IndexError, i.e. Python's
// ValueError / TypeError / IndexError) with a message naming the argument
// and the offending sizes.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/cuda.h>
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <sstream>

namespace {

using rotary_test::ExpectError;

using rotary_test::randn;

const at::Tensor& freqs8() {
  static const at::Tensor f = rotary::rope_freqs(8, 16);  // [16, 4], head_dim 8
  return f;
}

TEST(RopeErrors, OddHeadDim) {
  const auto freqs = rotary::rope_freqs(8, 16);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 7}), freqs); },
      {"apply_rope", "x.size(-1) (head_dim) must be even and > 0", "got 7", "[1, 2, 3, 7]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 2, 3, 5}), freqs); },
      {"apply_rope_qk", "k.size(-1) (head_dim) must be even", "got 5", "[1, 2, 3, 5]"});
}

TEST(RopeErrors, ZeroHeadDim) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(at::empty({1, 2, 3, 0}), freqs8()); },
      {"x.size(-1) (head_dim) must be even and > 0", "got 0", "[1, 2, 3, 0]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(at::empty({1, 2, 3, 0}), at::empty({1, 2, 3, 0}), freqs8()); },
      {"apply_rope_qk", "q.size(-1)", "got 0"});
}

TEST(RopeErrors, ThreeDimInput) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({2, 3, 8}), freqs8()); },
      {"apply_rope",
       "x must be 4-D [batch, heads, seq_len, head_dim], got shape [2, 3, 8] (layout BHSD); a 3-D [total_tokens, "
       "heads, head_dim] input needs cu_seqlens"});
  // Other layouts name their own dim order.
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope(randn({2, 3, 8}), freqs8(), 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BSHD");
      },
      {"x must be 4-D [batch, seq_len, heads, head_dim], got shape [2, 3, 8] (layout BSHD)", "needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({2, 3, 8}), freqs8()); },
      {"apply_rope_qk", "k must be 4-D", "[2, 3, 8]"});
}

TEST(RopeErrors, FiveDimInput) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 4, 8}), freqs8()); },
      {"x must be 4-D [batch, heads, seq_len, head_dim], got shape [1, 2, 3, 4, 8] (layout BHSD)"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope(
            randn({1, 2, 3, 4, 8}), freqs8(), 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "SBHD");
      },
      {"x must be 4-D [seq_len, batch, heads, head_dim], got shape [1, 2, 3, 4, 8] (layout SBHD)"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 4, 8}), randn({1, 2, 3, 8}), freqs8()); },
      {"q must be 4-D", "[1, 2, 3, 4, 8]"});
}

TEST(RopeErrors, FreqsComplex128) {
  const auto freqs = rotary::rope_freqs(8, 16).to(at::kComplexDouble);
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); },
      {"apply_rope", "freqs must be complex64", "got ComplexDouble"});
}

TEST(RopeErrors, FreqsRealFloat) {
  const auto freqs = at::view_as_real(rotary::rope_freqs(8, 16)).select(-1, 0).contiguous();  // float32 [16, 4]
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); }, {"freqs must be complex64", "got Float"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 1, 3, 8}), freqs); },
      {"apply_rope_qk", "freqs must be complex64", "got Float"});
}

TEST(RopeErrors, FreqsWrongRank) {
  const auto f = rotary::rope_freqs(8, 16);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f.unsqueeze(0)); },
      {"freqs must have shape [max_seq_len, ", "[*, 4]", "head_dim", "got [1, 16, 4]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f.select(0, 0)); },
      {"freqs must have shape", "got [4]"});
}

// A table narrower than head_dim / 2 is partial rotary (valid; see the
// partial-rotary tests); wider than head_dim / 2, or 0 wide, is an error.
TEST(RopeErrors, FreqsWiderThanHeadDim) {
  const auto f = rotary::rope_freqs(16, 16);  // [16, 8]: for head_dim 16
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f); },
      {"apply_rope",
       "freqs must have shape [max_seq_len, rotary_dim / 2] with 0 < rotary_dim <= head_dim = 8 (full rotation: "
       "[*, 4]), got [16, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 2, 3, 8}), f); },
      {"apply_rope_qk", "0 < rotary_dim <= head_dim = 8 (full rotation: [*, 4]), got [16, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs8().narrow(1, 0, 0)); },
      {"apply_rope", "0 < rotary_dim <= head_dim = 8", "got [16, 0]"});
}

TEST(RopeErrors, StartPosOutOfRange) {
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(randn({1, 2, 8, 8}), freqs8(), 10); },
      {"apply_rope", "start_pos + seq_len = 10 + 8 = 18", "exceeds the freqs table length (max_seq_len) 16"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 17, 8}), randn({1, 2, 17, 8}), freqs8(), 0); },
      {"apply_rope_qk", "0 + 17 = 17", "(max_seq_len) 16"});
  // One past the end.
  ExpectError<c10::IndexError>([&] { rotary::apply_rope(randn({1, 1, 1, 8}), freqs8(), 16); }, {"16 + 1 = 17"});
  // Just below the 2^60 bound: the last position is 2^60 - 1, with or without a table.
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(randn({1, 1, 3, 8}), freqs8(), (int64_t{1} << 60) - 1); },
      {"apply_rope", "start_pos + seq_len = 1152921504606846975 + 3", "reaches past the last position, 2^60 - 1"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(randn({1, 1, 3, 8}), freqs8(), (int64_t{1} << 60) - 4); },
      {"apply_rope", "start_pos + seq_len = 1152921504606846972 + 3 = 1152921504606846975",
       "exceeds the freqs table length (max_seq_len) 16"});
}

// Regression: at 437492f the range check computed start_pos + seq in int64;
// for start_pos near INT64_MAX it wrapped negative, passed, and the kernel
// read the row before the table (out of bounds). Any c10 error naming
// start_pos is accepted (IndexError or ValueError).
TEST(RopeErrors, HugeStartPosDoesNotOverflowRangeCheck) {
  const int64_t huge = std::numeric_limits<int64_t>::max();
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(at::ones({1, 1, 2, 8}), freqs8(), huge); }, {"apply_rope", "start_pos"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope_qk(at::ones({1, 1, 2, 8}), at::ones({1, 1, 2, 8}), freqs8(), huge - 1); },
      {"apply_rope_qk", "start_pos"});
  // With inv_freq (no table bound) or a positions tensor, start_pos >= 2^60 is
  // rejected by its own bound.
  const auto inv = at::pow(10000.0, -at::arange(0, 8, 2, at::kDouble) / 8.0);
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(at::ones({1, 1, 2, 8}), freqs8(), huge, true, std::nullopt, std::nullopt, false, std::nullopt, inv); },
      {"apply_rope", "start_pos must be < 2^60, got 9223372036854775807"});
  ExpectError<c10::IndexError>(
      [&] {
        rotary::apply_rope_qk(
            at::ones({1, 1, 2, 8}), at::ones({1, 1, 2, 8}), freqs8(), int64_t{1} << 60, true, std::nullopt, std::nullopt, false,
            std::nullopt, inv);
      },
      {"apply_rope_qk", "start_pos must be < 2^60, got 1152921504606846976"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(at::ones({1, 1, 2, 8}), freqs8(), int64_t{1} << 60, true, at::scalar_tensor(0, at::kLong)); },
      {"apply_rope", "start_pos must be < 2^60, got 1152921504606846976"});
}

TEST(RopeErrors, NegativeStartPos) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs8(), -1); },
      {"apply_rope", "start_pos must be >= 0, got -1"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 2, 3, 8}), freqs8(), -5); },
      {"apply_rope_qk", "start_pos must be >= 0, got -5"});
}

TEST(RopeErrors, QkDifferentBatch) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({3, 4, 5, 8}), freqs8()); },
      {"apply_rope_qk", "k must match q in batch, seq_len and head_dim", "q has shape [2, 4, 5, 8]",
       "k has shape [3, 4, 5, 8]"});
}

TEST(RopeErrors, QkDifferentSeqLen) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 6, 8}), freqs8()); },
      {"k must match q", "q has shape [2, 4, 5, 8]", "k has shape [2, 4, 6, 8]"});
}

TEST(RopeErrors, QkDifferentHeadDim) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 5, 6}), freqs8()); },
      {"k must match q", "q has shape [2, 4, 5, 8]", "k has shape [2, 4, 5, 6]"});
}

TEST(RopeErrors, QkDifferentDtype) {
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 5, 8}, at::kHalf), freqs8()); },
      {"apply_rope_qk", "k has dtype Half but q has dtype Float", "must share one dtype"});
}

TEST(RopeErrors, IntegerInput) {
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(at::ones({1, 2, 3, 8}, at::kInt), freqs8()); },
      {"apply_rope", "x must be float32, float64, float16 or bfloat16", "got Int"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), at::ones({1, 2, 3, 8}, at::kLong), freqs8()); },
      {"apply_rope_qk", "k must be float32, float64, float16 or bfloat16", "got Long"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(rotary::rope_freqs(16, 4).view({1, 1, 4, 8}), freqs8()); },
      {"x must be float32", "got ComplexFloat"});
}

TEST(RopeErrors, PositionsNonIntegerDtype) {
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({2, 2, 3, 8}), freqs8(), 0, true, at::zeros({2})); },
      {"apply_rope", "offsets must have an integer dtype", "got Float"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({2, 2, 3, 8}), freqs8(), 0, true, std::nullopt, at::zeros({2, 3}, at::kBool)); },
      {"apply_rope", "position_ids must have an integer dtype", "got Bool"});
}

TEST(RopeErrors, OffsetsWrongShape) {
  const auto x = randn({2, 2, 5, 8});
  const std::vector<at::Tensor> bad = {
      at::zeros({3}, at::kLong), at::zeros({2, 5}, at::kLong), at::zeros({2, 5, 1}, at::kLong),
      at::zeros({0}, at::kLong)};
  for (const auto& pos : bad) {
    std::ostringstream shape;
    shape << pos.sizes();
    ExpectError<c10::ValueError>(
        [&] { rotary::apply_rope(x, freqs8(), 0, true, pos); },
        {"apply_rope", "offsets must have shape [] or [batch]", "batch = 2", "got " + shape.str(),
         "for absolute ids [seq_len] or [batch, seq_len] pass position_ids"});
  }
}

TEST(RopeErrors, PositionIdsWrongShape) {
  const auto x = randn({2, 2, 5, 8});
  const std::vector<at::Tensor> bad = {
      at::zeros({2}, at::kLong), at::zeros({2, 4}, at::kLong), at::zeros({3, 5}, at::kLong),
      at::zeros({2, 5, 1}, at::kLong), at::zeros({}, at::kLong)};
  for (const auto& pos : bad) {
    std::ostringstream shape;
    shape << pos.sizes();
    ExpectError<c10::ValueError>(
        [&] { rotary::apply_rope(x, freqs8(), 0, true, std::nullopt, pos); },
        {"apply_rope", "position_ids must have shape [seq_len] or [batch, seq_len]", "batch = 2, seq_len = 5",
         "got " + shape.str()});
  }
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x, x, freqs8(), 0, true, std::nullopt, at::zeros({2, 6}, at::kLong)); },
      {"apply_rope_qk", "position_ids must have shape", "got [2, 6]"});
  // [batch] offsets passed as ids are named for what they are.
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, std::nullopt, at::zeros({2}, at::kLong)); },
      {"for per-batch offsets [batch] pass offsets"});
}

TEST(RopeErrors, OffsetsAndPositionIdsTogether) {
  const auto x = randn({2, 2, 3, 8});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, at::zeros({2}, at::kLong), at::zeros({2, 3}, at::kLong)); },
      {"apply_rope: pass offsets (per-sequence starts) or position_ids (absolute ids), not both"});
}

TEST(RopeErrors, StartPosWithPositionIds) {
  const auto x = randn({2, 2, 3, 8});
  const auto ids = at::zeros({2, 3}, at::kLong);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs8(), 2, true, std::nullopt, ids); },
      {"apply_rope: start_pos must be 0 with position_ids (they are absolute positions), got start_pos = 2",
       "add it to the ids, or pass offsets"});
  // Meta sees the same rule when start_pos is known.
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x.to(at::kMeta), x.to(at::kMeta), freqs8().to(at::kMeta), 1, true, std::nullopt,
                                  ids.to(at::kMeta)); },
      {"apply_rope_qk: start_pos must be 0 with position_ids"});
}

TEST(RopeErrors, PositionsOutsideTable) {
  const auto x = randn({2, 2, 3, 8});
  // ids: token (1, 2) lands on row 16 of a 16-row table.
  const auto ids = at::tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 16}, at::kLong).view({2, 3});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, std::nullopt, ids); },
      {"apply_rope", "token (batch 1, seq 2) has position 16 (position_ids), outside the freqs table [0, 16)",
       "build the table with max_seq_len > 16 (the ops also take inv_freq)"});
  // int32 ids are read as they are, with the same checks.
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, std::nullopt, ids.to(at::kInt)); },
      {"token (batch 1, seq 2) has position 16 (position_ids)"});
  // offsets: start_pos 2 + offset 12 + s 2 = 16.
  const auto offsets = at::tensor(std::vector<int64_t>{0, 12}, at::kLong);
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope_qk(x, x, freqs8(), 2, true, offsets); },
      {"apply_rope_qk", "token (batch 1, seq 2) has position 16 (start_pos 2 + offsets + s)", "[0, 16)"});
  // Negative positions are a ValueError.
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, at::scalar_tensor(-1, at::kLong)); },
      {"apply_rope", "token (batch 0, seq 0) has negative position -1 (start_pos 0 + offsets + s)"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope_qk(
            x, x, freqs8(), 0, true, std::nullopt,
            at::tensor(std::vector<int64_t>{0, 1, 2, 3, -3, 5}, at::kLong).view({2, 3}));
      },
      {"apply_rope_qk", "token (batch 1, seq 1) has negative position -3 (position_ids)"});
  // Given positions must lie in (-2^60, 2^60).
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, at::scalar_tensor(int64_t{1} << 60, at::kLong)); },
      {"apply_rope", "offsets must lie in (-2^60, 2^60), got 1152921504606846976"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, at::tensor(std::vector<int64_t>{0, -(int64_t{1} << 60)}, at::kLong)); },
      {"apply_rope", "offsets must lie in (-2^60, 2^60), got -1152921504606846976"});
}

// In place, any strides are decided exactly: disjoint views run, however
// their elements interleave; views that share an element are refused above.
TEST(InPlaceOverlap, DisjointInterleavedViewsAreRotated) {
  const at::Tensor buf = randn({1, 2, 3, 16}, at::kDouble);
  at::Tensor q = buf.slice(3, 0, 16, 2), k = buf.slice(3, 1, 16, 2);  // even and odd elements
  const at::Tensor eq = rotary_test::ref_rope(q, 2), ek = rotary_test::ref_rope(k, 2);
  rotary::apply_rope_qk_(q, k, freqs8(), 2);
  EXPECT_TRUE(rotary_test::AllClose(q, eq, rotary_test::tolerance_for(at::kDouble)));
  EXPECT_TRUE(rotary_test::AllClose(k, ek, rotary_test::tolerance_for(at::kDouble)));
}

TEST(InPlaceOverlap, IrregularDistinctStridesAreRotated) {
  // Offsets {0, 2, 4} + {0, 3}: six distinct elements, though stride 2
  // times size 3 passes the other stride (torch calls this TooHard).
  const at::Tensor base = randn({8}, at::kDouble);
  at::Tensor x = base.as_strided({1, 1, 3, 2}, {8, 8, 2, 3});
  const at::Tensor expected = rotary_test::ref_rope(x, 1);
  rotary::apply_rope_(x, rotary::rope_freqs(2, 8), 1);
  EXPECT_TRUE(rotary_test::AllClose(x, expected, rotary_test::tolerance_for(at::kDouble)));
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

TEST(RopeErrors, FreqsRequiringGradAreRejected) {
  const auto freqs = rotary::rope_freqs(8, 16).requires_grad_();
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); }, {"freqs requires grad", "freqs.detach()"});
}

TEST(RopeErrors, ErrorsAreRaisedForMetaTensorsToo) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  const auto freqs = rotary::rope_freqs(8, 16).to(at::kMeta);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(at::empty({1, 2, 3, 7}, meta), freqs); }, {"x.size(-1)", "got 7"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(at::empty({2, 4, 5, 8}, meta), at::empty({3, 4, 5, 8}, meta), freqs); },
      {"k must match q", "k has shape [3, 4, 5, 8]"});
}

TEST(RopeFreqsErrors, InvalidArguments) {
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(7, 16); }, {"rope_freqs", "dim must be even and > 0, got 7"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(0, 16); }, {"dim must be even and > 0, got 0"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(8, -1); }, {"max_seq_len must be >= 0, got -1"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(8, 16, 0.0); }, {"theta must be finite and > 0, got 0"});
  ExpectError<c10::ValueError>(
      [] { rotary::rope_freqs(8, 16, std::numeric_limits<double>::quiet_NaN()); }, {"theta must be finite"});
}

TEST(RopeErrors, DeviceMismatch) {
  // Dispatch picks the CUDA kernel as soon as any argument is on CUDA, so the
  // check needs a CUDA build as well as a device.
  const auto op = c10::Dispatcher::singleton().findSchema({"rotary::apply_rope", ""});
  if (!torch::cuda::is_available() || !op || !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
    GTEST_SKIP() << "needs a CUDA device and a CUDA build of rotary";
  }
  const auto x_cpu = randn({1, 2, 3, 8});
  const auto x_cuda = x_cpu.to(at::kCUDA);
  const auto freqs_cuda = freqs8().to(at::kCUDA);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cuda, freqs8()); }, {"apply_rope", "freqs is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x_cuda, x_cpu, freqs_cuda); }, {"apply_rope_qk", "k is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cuda, freqs_cuda, 0, true, at::zeros({1}, at::kLong)); },
      {"offsets is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cpu, freqs_cuda); }, {"freqs is on cuda:0 but q/x is on cpu"});
}

}  // namespace

// ==== Added with "Exact, hard to misuse": one table of bad inputs across
// every public entry point (apply_rope, apply_rope_qk, apply_rope_,
// apply_rope_qk_, rope_freqs / freqs_table / freqs_at, RotaryEmbedding and
// its torch::load). Each row: the exception type, substrings naming the
// argument, and the inputs, which must come out bitwise unchanged.
#include <rotary/module.h>

#include <torch/serialize.h>

#include <functional>
#include <string>
#include <vector>

namespace {

enum class Err { Value, Type, Index };

struct BadInput {
  std::string name;
  Err err;
  std::vector<std::string> parts;
  std::vector<at::Tensor> inputs;                         // checked unchanged afterwards
  std::function<void(std::vector<at::Tensor>&)> call;     // gets the inputs
};

using rotary_test::longs;

std::vector<BadInput> bad_inputs() {
  const auto f = [] { return rotary::rope_freqs(8, 16); };
  const auto r = [](std::vector<int64_t> s) { return at::randn(s); };
  using T = std::vector<at::Tensor>;
  using rotary::RotaryEmbedding;
  using rotary::RotaryEmbeddingOptions;
  std::vector<BadInput> v = {
      // ---- apply_rope
      {"rank-3-without-cu_seqlens", Err::Value, {"apply_rope: x must be 4-D", "[2, 3, 8]"}, T{r({2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"odd-head-dim", Err::Value, {"apply_rope: x.size(-1) (head_dim) must be even and > 0, got 7"},
       T{r({1, 2, 3, 7}), rotary::rope_freqs(6, 16)}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"zero-head-dim", Err::Value, {"head_dim) must be even and > 0, got 0"}, T{at::empty({1, 2, 3, 0}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"rotary-dim-gt-head-dim", Err::Value, {"apply_rope: freqs must have shape", "rotary_dim <= head_dim = 6"},
       T{r({1, 2, 3, 6}), f()}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"freqs-float32", Err::Type, {"apply_rope: freqs must be complex64", "got Float"},
       T{r({1, 2, 3, 8}), at::view_as_real(f()).select(-1, 0).contiguous()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"freqs-3d", Err::Value, {"freqs must have shape", "got [1, 16, 4]"}, T{r({1, 2, 3, 8}), f().unsqueeze(0)},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"int-input", Err::Type, {"apply_rope: x must be float32, float64, float16 or bfloat16", "got Int"},
       T{at::ones({1, 2, 3, 8}, at::kInt), f()}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"offsets-float", Err::Type, {"apply_rope: offsets must have an integer dtype", "got Float"},
       T{r({2, 2, 3, 8}), f(), at::ones({2})}, [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"offsets-wrong-shape", Err::Value, {"offsets must have shape [] or [batch]", "got [2, 4]"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 4}, at::kLong)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"position-ids-wrong-shape", Err::Value, {"position_ids must have shape [seq_len] or [batch, seq_len]", "got [2, 4]"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 4}, at::kLong)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, t[2]); }},
      {"position-ids-with-start-pos", Err::Value, {"start_pos must be 0 with position_ids"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 3}, at::kInt)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 1, true, std::nullopt, t[2]); }},
      {"offsets-out-of-table", Err::Index, {"token (batch 1, seq 2) has position 16", "[0, 16)"},
       T{r({2, 2, 3, 8}), f(), longs({0, 14})}, [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"start-pos-out-of-table", Err::Index, {"start_pos + seq_len = 14 + 3 = 17", "exceeds",
       "build the table with max_seq_len > 16 (the ops also take inv_freq)"},
       T{r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope(t[0], t[1], 14); }},
      {"negative-start-pos", Err::Value, {"apply_rope: start_pos must be >= 0, got -1"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1], -1); }},
      {"bad-layout", Err::Value, {"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'HBSD'"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) {
         rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "HBSD");
       }},
      {"inv-freq-float32", Err::Type, {"inv_freq must be float64, got Float"}, T{r({1, 2, 3, 8}), f(), at::ones({4})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, std::nullopt, t[2]); }},
      {"cu-seqlens-not-monotonic", Err::Value, {"cu_seqlens must start at 0, never decrease", "[0, 3, 2, 5]"},
       T{r({5, 2, 8}), f(), longs({0, 3, 2, 5})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-not-starting-at-0", Err::Value, {"cu_seqlens must start at 0", "[1, 3, 5]"},
       T{r({5, 2, 8}), f(), longs({1, 3, 5})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-not-ending-at-T", Err::Value, {"end at total_tokens = 5", "got [0, 3, 4]"},
       T{r({5, 2, 8}), f(), at::tensor(std::vector<int32_t>{0, 3, 4}, at::kInt)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-float", Err::Type, {"cu_seqlens must be int32 or int64, got Float"},
       T{r({5, 2, 8}), f(), at::zeros({2})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      // ---- apply_rope_qk
      {"qk-batch-mismatch", Err::Value, {"apply_rope_qk: k must match q", "k has shape [1, 2, 3, 8]"},
       T{r({2, 2, 3, 8}), r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-seq-mismatch", Err::Value, {"apply_rope_qk: k must match q", "k has shape [2, 2, 4, 8]"},
       T{r({2, 2, 3, 8}), r({2, 2, 4, 8}), f()}, [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-dtype-mismatch", Err::Type, {"k has dtype Double but q has dtype Float"},
       T{r({2, 2, 3, 8}), r({2, 2, 3, 8}).to(at::kDouble), f()},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-k-int", Err::Type, {"apply_rope_qk: k must be float32"}, T{r({2, 2, 3, 8}), at::ones({2, 2, 3, 8}, at::kLong), f()},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-offsets-double", Err::Type, {"apply_rope_qk: offsets must have an integer dtype", "got Double"},
       T{r({2, 2, 3, 8}), r({2, 1, 3, 8}), f(), at::zeros({2}, at::kDouble)},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2], 0, true, t[3]); }},
      // ---- apply_rope_ / apply_rope_qk_
      {"inplace-leaf-requires-grad", Err::Value, {"apply_rope_: x requires grad", "not differentiable"},
       T{r({1, 2, 3, 8}).requires_grad_(), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"inplace-expanded", Err::Value, {"apply_rope_: x has elements sharing memory (an expanded view?)"},
       T{r({1, 1, 3, 8}), f()}, [](T& t) {
         auto e = t[0].expand({2, 2, 3, 8});
         rotary::apply_rope_(e, t[1]);
       }},
      {"inplace-odd-head-dim", Err::Value, {"apply_rope_: x.size(-1) (head_dim) must be even"},
       T{r({1, 2, 3, 7}), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"inplace-start-pos-out-of-table", Err::Index, {"apply_rope_: start_pos + seq_len = 15 + 3 = 18"},
       T{r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1], 15); }},
      {"qk-inplace-same-tensor", Err::Value, {"apply_rope_qk_: q and k overlap in memory"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[0], t[1]); }},
      {"qk-inplace-overlapping-slices", Err::Value, {"apply_rope_qk_: q and k overlap in memory"},
       T{r({1, 3, 3, 8}), f()}, [](T& t) {
         auto q = t[0].slice(1, 0, 2);
         auto k = t[0].slice(1, 1, 3);
         rotary::apply_rope_qk_(q, k, t[1]);
       }},
      {"qk-inplace-partial-overlap-last-dim", Err::Value, {"apply_rope_qk_: q and k overlap in memory"},
       T{r({1, 2, 4, 12}), f()}, [](T& t) {
         auto q = t[0].slice(3, 0, 8);
         auto k = t[0].slice(3, 4, 12);
         rotary::apply_rope_qk_(q, k, t[1]);
       }},
      {"inplace-as-strided-self-overlap", Err::Value, {"apply_rope_: x has elements sharing memory"},
       T{r({64}), f()}, [](T& t) {
         auto x = t[0].as_strided({1, 1, 4, 8}, {32, 32, 4, 1});
         rotary::apply_rope_(x, t[1]);
       }},
      {"qk-inplace-k-self-overlap", Err::Value, {"apply_rope_qk_: k has elements sharing memory"},
       T{r({1, 2, 3, 8}), r({64}), f()}, [](T& t) {
         auto k = t[1].as_strided({1, 2, 3, 8}, {0, 8, 6, 1});
         rotary::apply_rope_qk_(t[0], k, t[2]);
       }},
      {"inplace-x-aliases-freqs", Err::Value, {"apply_rope_: x and freqs overlap in memory"},
       T{f().clone()}, [](T& t) {
         auto x = at::view_as_real(t[0]).view({1, 1, 16, 8});
         rotary::apply_rope_(x, t[0]);
       }},
      {"inplace-freqs-requires-grad", Err::Value, {"rotary: freqs requires grad"},
       T{r({1, 2, 3, 8}), f().clone().requires_grad_()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"qk-inplace-k-requires-grad", Err::Value, {"apply_rope_qk_: k requires grad"},
       T{r({1, 2, 3, 8}), r({1, 2, 3, 8}).requires_grad_(), f()},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[1], t[2]); }},
      {"qk-inplace-cu-seqlens-past-T", Err::Value, {"apply_rope_qk_: cu_seqlens must start at 0", "[0, 3, 6]"},
       T{r({5, 2, 8}), r({5, 1, 8}), f(), longs({0, 3, 6})},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[1], t[2], 0, true, std::nullopt, std::nullopt, false, t[3]); }},
      // ---- table builders
      {"rope-freqs-odd-dim", Err::Value, {"rope_freqs: dim must be even and > 0, got 7"}, T{},
       [](T&) { rotary::rope_freqs(7, 16); }},
      {"rope-freqs-angle-dtype", Err::Value, {"rope_freqs: angle_dtype must be float64", "got Half"}, T{},
       [](T&) { rotary::rope_freqs(8, 16, 1e4, rotary::RopeScaling(), 0, at::kHalf); }},
      {"freqs-table-negative-len", Err::Value, {"freqs_table: max_seq_len must be >= 0, got -1"}, T{},
       [](T&) { rotary::freqs_table(rotary::compute_frequencies(8, 1e4), -1); }},
      {"freqs-at-negative-position", Err::Value, {"freqs_at: positions must be >= 0, got -3 at index 1"},
       T{longs({0, -3})}, [](T& t) { rotary::freqs_at(rotary::compute_frequencies(8, 1e4), t[0]); }},
      {"freqs-at-int32-positions", Err::Type, {"freqs_at: positions must be int64, got Int"},
       T{at::zeros({2}, at::kInt)}, [](T& t) { rotary::freqs_at(rotary::compute_frequencies(8, 1e4), t[0]); }},
      {"scaling-unknown-type", Err::Value, {"unknown type (rope_type) 'ntk-by-parts'"}, T{},
       [](T&) { rotary::compute_frequencies(8, 1e4, rotary::RopeScaling("ntk-by-parts")); }},
      // ---- RotaryEmbedding
      {"module-odd-dim", Err::Value, {"RotaryEmbedding: dim must be even and > 0, got 7"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(7)); }},
      {"module-zero-len", Err::Value, {"RotaryEmbedding: max_seq_len must be > 0, got 0"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(0)); }},
      {"module-angle-dtype", Err::Value, {"RotaryEmbedding: angle_dtype must be float64", "got BFloat16"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(8).angle_dtype(torch::kBFloat16)); }},
      {"module-negative-start", Err::Value, {"RotaryEmbedding: start_pos must be >= 0, got -2"}, T{r({1, 2, 3, 8})},
       [](T& t) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16))->forward(t[0], -2); }},
      {"module-qk-mismatch", Err::Value, {"apply_rope_qk: k must match q"}, T{r({1, 2, 3, 8}), r({1, 2, 4, 8})},
       [](T& t) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16))->forward(t[0], t[1]); }},
      {"module-fp32-angles-past-table", Err::Index, {"RotaryEmbedding(angle_dtype=float32)", "exceeds max_seq_len 16"},
       T{r({1, 2, 3, 8})}, [](T& t) {
         RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).angle_dtype(torch::kFloat32))->forward(t[0], 14);
       }},
      {"module-load-other-theta", Err::Value, {"RotaryEmbedding.load: the saved tables do not match", "theta=10000"},
       T{}, [](T&) {
         std::stringstream s;
         torch::save(RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).theta(500.0)), s);
         RotaryEmbedding m(RotaryEmbeddingOptions(8).max_seq_len(16));
         torch::load(m, s);
       }},
  };
  return v;
}

TEST(BadInputMatrix, EveryEntryPointRejectsAndLeavesInputsAlone) {
  const auto cases = bad_inputs();
  ASSERT_GE(cases.size(), 30u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto inputs = c.inputs;
    std::vector<at::Tensor> saved;
    for (const auto& t : inputs) saved.push_back(t.detach().clone());
    auto run = [&] { c.call(inputs); };
    switch (c.err) {
      case Err::Value: ExpectError<c10::ValueError>(run, c.parts); break;
      case Err::Type: ExpectError<c10::TypeError>(run, c.parts); break;
      case Err::Index: ExpectError<c10::IndexError>(run, c.parts); break;
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_TRUE(at::equal(inputs[i].detach(), saved[i])) << "input " << i << " was modified";
    }
  }
}

}  // namespace
