// The C++ side of N-D positions and the offset span: the module's M-RoPE
// options against the ops, the pair -> axis maps, and the errors that name
// their argument (nothing written for a refused in-place call).
#include "helpers.h"

#include <rotary/rotary.h>

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <vector>

namespace {

using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;
using rotary_test::ExpectError;

TEST(NdPositions, MropePairAxes) {
  EXPECT_EQ(rotary::mrope_pair_axes({2, 3, 3}, 16, false), (std::vector<int64_t>{0, 0, 1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(rotary::mrope_pair_axes({4, 2, 2}, 16, true), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 0}));
  ExpectError<c10::ValueError>(
      [] { rotary::mrope_pair_axes({16, 24, 20}, 128, false); },
      {"mrope_section [16, 24, 20] must sum to rotary_dim / 2 = 64", "got 60"});
}

TEST(NdPositions, ModuleMropeAndOffset) {
  RotaryEmbedding rope(
      RotaryEmbeddingOptions(16).max_seq_len(64).interleaved(false).mrope_section({2, 3, 3}).rotary_offset(8));
  const auto q = torch::randn({2, 3, 5, 32});
  const auto k = torch::randn({2, 1, 5, 32});
  const auto pos = torch::randint(0, 64, {3, 2, 5}, torch::kLong);
  auto [oq, ok] = rope->forward(q, k, 0, std::nullopt, pos);
  auto [eq, ek] = rotary::apply_rope_qk(
      q, k, rope->freqs, 0, false, std::nullopt, pos, false, std::nullopt, std::nullopt, "BHSD", 8, rope->pair_axes);
  EXPECT_TRUE(torch::equal(oq, eq));
  EXPECT_TRUE(torch::equal(ok, ek));
  EXPECT_TRUE(torch::equal(oq.narrow(3, 0, 8), q.narrow(3, 0, 8)));
  EXPECT_TRUE(torch::equal(oq.narrow(3, 24, 8), q.narrow(3, 24, 8)));
  // 2-D ids: every pair at the one position, which equal 3-D axes give too.
  const auto text = pos[0];
  EXPECT_TRUE(torch::equal(rope->forward(q, 0, std::nullopt, text), rope->forward(q, 0, std::nullopt, text.expand({3, 2, 5}))));
  ExpectError<c10::ValueError>(
      [&] { rope->forward(torch::randn({1, 1, 2, 20})); },
      {"RotaryEmbedding(dim=16): head_dim must be >= rotary_offset + dim = 24 (the rotated span), got head_dim 20"});
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(16).mrope_section({2, 3, 2})); },
      {"mrope_section [2, 3, 2] must sum to rotary_dim / 2 = 8"});
}

// An explicit map turns each pair as the sections naming the same map do
// (the Python tests check it against the float64 reference); clones keep it.
TEST(NdPositions, ModuleExplicitPairAxes) {
  RotaryEmbedding sections(RotaryEmbeddingOptions(16).max_seq_len(64).mrope_section({2, 3, 3}));
  RotaryEmbedding explicit_map(RotaryEmbeddingOptions(16).max_seq_len(64).pair_axes({0, 0, 1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(explicit_map->pair_axes, sections->pair_axes);
  const auto q = torch::randn({2, 3, 5, 16});
  const auto pos = torch::randint(0, 64, {3, 2, 5}, torch::kLong);
  const auto want = sections->forward(q, 0, std::nullopt, pos);
  EXPECT_TRUE(torch::equal(explicit_map->forward(q, 0, std::nullopt, pos), want));
  auto copy = std::dynamic_pointer_cast<rotary::RotaryEmbeddingImpl>(explicit_map->clone());
  EXPECT_TRUE(torch::equal(copy->forward(q, 0, std::nullopt, pos), want));
  std::ostringstream repr;
  explicit_map->pretty_print(repr);
  EXPECT_NE(repr.str().find("pair_axes=[0, 0, 1, 1, 1, 2, 2, 2]"), std::string::npos) << repr.str();
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(16).pair_axes({0, 1, 2})); },
      {"pair_axes must have one entry per pair, dim / 2 = 8, got 3"});
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(8).pair_axes({0, 1, 2, 16})); },
      {"pair_axes[3] must be an axis index in [0, 16), got 16"});
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(8).pair_axes({0, 1, 1, 0}).mrope_section({2, 1, 1})); },
      {"three N-D rules; pass one of them"});
}

TEST(NdPositions, ModuleAxialPerAxisTheta) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(32).axes_dim({4, 6, 6}).axes_theta({1e4, 100.0, 1e3}));
  const auto axial = rotary::axial_rope({4, 6, 6}, {1e4, 100.0, 1e3}, false);
  EXPECT_EQ(rope->pair_axes, axial.pair_axes);
  EXPECT_EQ(rope->pair_axes, (std::vector<int64_t>{0, 0, 1, 1, 1, 2, 2, 2}));
  const auto inv = rope->inv_freq;
  for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(inv[j].item<double>(), axial.freqs.inv_freq[j]);
  EXPECT_DOUBLE_EQ(axial.freqs.inv_freq[3], std::pow(100.0, -2.0 / 6.0));
  const auto x = torch::randn({1, 2, 4, 16});
  const auto pos = torch::randint(0, 32, {3, 1, 4}, torch::kLong);
  EXPECT_TRUE(torch::equal(
      rope->forward(x, 0, std::nullopt, pos),
      rotary::apply_rope(x, rope->freqs, 0, true, std::nullopt, pos, false, std::nullopt, std::nullopt, "BHSD", 0,
                         rope->pair_axes)));
  // Pixtral: one spectrum of 16 dims dealt to h (even entries) and w (odd).
  const auto pix = rotary::axial_rope({8, 8}, {1e4}, true);
  EXPECT_DOUBLE_EQ(pix.freqs.inv_freq[1], std::pow(1e4, -4.0 / 16.0));
  EXPECT_DOUBLE_EQ(pix.freqs.inv_freq[4], std::pow(1e4, -2.0 / 16.0));
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(16).axes_dim({4, 6, 4})); },
      {"axes_dim [4, 6, 4] must sum to dim = 16, got 14"});
}

TEST(NdPositions, RefusedInPlaceWritesNothing) {
  const auto freqs = rotary::freqs_table(rotary::compute_frequencies(16, 10000.0), 32);
  auto x = torch::randn({2, 3, 5, 20});
  const auto before = x.clone();
  const auto ids = torch::zeros({3, 2, 5}, torch::kLong);
  const std::vector<int64_t> axes = {0, 0, 0, 1, 1, 2, 2, 2};
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(x, freqs, 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BHSD", 5); },
      {"apply_rope_: rotary_offset + rotary_dim must fit in head_dim = 20", "rotary_offset = 5 and rotary_dim = 16"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope_(
            x, freqs, 0, true, std::nullopt, ids.narrow(0, 0, 2), false, std::nullopt, std::nullopt, "BHSD", 0, axes);
      },
      {"apply_rope_: position_ids has 2 axes", "uses axes 0..2"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope_(
            x, freqs, 0, true, std::nullopt, ids, false, std::nullopt, std::nullopt, "BHSD", 0,
            std::vector<int64_t>{0, 1, 2});
      },
      {"pair_axes must have one axis per pair, rotary_dim / 2 = 8 entries, got 3"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(x, freqs, 0, true, std::nullopt, ids[0][0], false, std::nullopt, std::nullopt, "BHSD", 0, axes); },
      {"with pair_axes, position_ids must have shape [n_axes, seq_len] or [n_axes, batch, seq_len]"});
  EXPECT_TRUE(torch::equal(x, before));
}

}  // namespace
