// Errors of the variants from C++ (cu_seqlens, layouts, shapes, inv_freq,
// positions): the type and a message naming the argument.
#include "helpers.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>

namespace {

using rotary_test::ExpectError;
using rotary_test::randn;
using rotary_test::longs;

// ---------------------------------------------------------------------------
// Errors: type and a message naming the argument

TEST(VariantsErrors, CuSeqlens) {
  const auto freqs = rotary::rope_freqs(8, 16);
  const auto x = randn({5, 2, 8});
  const auto x_before = x.clone();
  auto call = [&](const at::Tensor& cu) { rotary::apply_rope(x, freqs, 0, true, std::nullopt, std::nullopt, false, cu); };
  ExpectError<c10::ValueError>([&] { call(longs({1, 2, 5})); },
                               {"apply_rope: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5",
                                "got [1, 2, 5]"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 3, 2, 5})); }, {"cu_seqlens must start at 0", "got [0, 3, 2, 5]"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 2, 4}).to(at::kInt)); }, {"end at total_tokens = 5", "got [0, 2, 4]"});
  ExpectError<c10::TypeError>([&] { call(longs({0, 5}).to(at::kFloat)); }, {"cu_seqlens must be int32 or int64, got Float"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 2, 5}).view({1, 3})); },
                               {"cu_seqlens must be 1-D [num_seqs + 1]", "got shape [1, 3]"});
  ExpectError<c10::ValueError>([&] { call(at::empty({0}, at::kLong)); }, {"cu_seqlens must be 1-D", "got shape [0]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 5, 2, 8}), freqs, 0, true, std::nullopt, std::nullopt, false, longs({0, 5})); },
      {"with cu_seqlens, x must be 3-D [total_tokens, heads, head_dim]", "got shape [1, 5, 2, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x, randn({1, 5, 1, 8}), freqs, 0, true, std::nullopt, std::nullopt, false, longs({0, 5})); },
      {"apply_rope_qk: with cu_seqlens, k must be 3-D"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 0, true, std::nullopt, at::zeros({1, 5}, at::kLong), false, longs({0, 5})); },
      {"with cu_seqlens, position_ids must have shape [total_tokens] = [5]", "got [1, 5]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 0, true, at::zeros({5}, at::kLong), std::nullopt, false, longs({0, 5})); },
      {"with cu_seqlens, offsets must have shape [] or [num_seqs] = [1]", "got [5]", "pass position_ids"});
  EXPECT_TRUE(at::equal(x, x_before));
}

TEST(VariantsErrors, LayoutsAndShapes) {
  const auto freqs = rotary::rope_freqs(8, 16);
  const auto x = randn({2, 2, 3, 8});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BHDS"); },
      {"apply_rope: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs, 0, true, std::nullopt, std::nullopt, false, longs({0, 5}), std::nullopt, "SBHD"); },
      {"with cu_seqlens the layout is 'THD', got 'SBHD'"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs); },
      {"x must be 4-D [batch, heads, seq_len, head_dim], got shape [5, 2, 8] (layout BHSD)",
       "a 3-D [total_tokens, heads, head_dim] input needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs, 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "SBHD"); },
      {"x must be 4-D [seq_len, batch, heads, head_dim]", "(layout SBHD)", "needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, rotary::rope_freqs(10, 16)); },
      {"freqs must have shape [max_seq_len, rotary_dim / 2] with 0 < rotary_dim <= head_dim = 8", "got [16, 5]"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(x, freqs, 20, true, std::nullopt, std::nullopt, false, std::nullopt, at::ones({4}, at::kFloat)); },
      {"inv_freq must be float64, got Float"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 20, true, std::nullopt, std::nullopt, false, std::nullopt, at::ones({8}, at::kDouble)); },
      {"inv_freq must have shape [rotary_dim / 2] = [4] to match freqs, got [8]"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope(
            randn({2, 3, 2, 8}), freqs, 0, true, longs({0, 1, 2}), std::nullopt, false, std::nullopt, std::nullopt,
            "BSHD");
      },
      {"offsets must have shape [] or [batch]", "batch = 2", "got [3]", "pass position_ids"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 1, true, longs({0, -2})); },
      {"apply_rope: token (batch 1, seq 0) has negative position -1 (start_pos 1 + offsets + s)"});
}

}  // namespace
