// Argument validation of the functional API, the positions: start_pos
// (negative, past the table, near 2^60 and INT64_MAX), offsets and
// position_ids (dtype, shape, both at once, with a start_pos, outside the
// table). Each bad input raises the right c10 exception type (ValueError /
// TypeError / IndexError, i.e. Python's ValueError / TypeError /
// IndexError) with a message naming the argument and the offending sizes.
// A file of its own to be read in one sitting; the tensors' own checks are
// in test_errors_tensors.cpp.
#include "helpers.h"

#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>

namespace {

using rotary_test::ExpectError;
using rotary_test::freqs8;

using rotary_test::randn;

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
  // [1] is neither [batch] (2) nor [seq] (5): its way out is [1, 1].
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs8(), 0, true, std::nullopt, at::zeros({1}, at::kLong)); },
      {"got [1]; one position for every token is [1, 1]"});
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

}  // namespace
