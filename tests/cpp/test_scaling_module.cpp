// Frequency (scaling) rules in the module: RotaryEmbedding with scaling
// options (host-driven dynamic / longrope updates, clone, save / load,
// casts) registers and keeps both the table and inv_freq. A file of its
// own to be read in one sitting (the formulas: test_scaling_formula.cpp).
#include <rotary/rotary.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using rotary::RopeScaling;
using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;

// ---------------------------------------------------------------------------
// The module with scaling options
// ---------------------------------------------------------------------------
RopeScaling yarn() {
  return RopeScaling("yarn").factor(4.0).original_max_position_embeddings(16);
}

std::vector<std::string> buffer_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& item : m.named_buffers()) names.push_back(item.key());
  return names;
}

TEST(ScalingModule, RegistersTableAndInvFreq) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64).theta(5000.0).scaling(yarn()));
  EXPECT_EQ(buffer_names(*rope), (std::vector<std::string>{"freqs", "inv_freq"}));
  const auto f = rotary::compute_frequencies(16, 5000.0, yarn());
  EXPECT_GT(f.attention_scaling, 1.0);
  EXPECT_EQ(rope->attention_scaling, f.attention_scaling);
  EXPECT_TRUE(torch::equal(rope->freqs, rotary::freqs_table(f, 64)));
  EXPECT_TRUE(torch::equal(rope->inv_freq, rotary::inv_freq_tensor(f)));
  EXPECT_TRUE(rope->named_buffers()["inv_freq"].is_same(rope->inv_freq));

  const auto x = torch::randn({2, 3, 5, 16});
  const auto k = torch::randn({2, 1, 5, 16});
  EXPECT_TRUE(torch::equal(rope->forward(x, 7), rotary::apply_rope(x, rope->freqs, 7, true)));
  const auto [q2, k2] = rope->forward(x, k, 3);
  const auto [q3, k3] = rotary::apply_rope_qk(x, k, rope->freqs, 3, true);
  EXPECT_TRUE(torch::equal(q2, q3));
  EXPECT_TRUE(torch::equal(k2, k3));
  const auto ids = torch::tensor({9, 3, 0, 63, 20, 1, 2, 3, 4, 5}, torch::kLong).view({2, 5});
  EXPECT_TRUE(torch::equal(
      rope->forward(x, 0, std::nullopt, ids), rotary::apply_rope(x, rope->freqs, 0, true, std::nullopt, ids)));

  std::ostringstream os;
  os << *rope;
  EXPECT_NE(os.str().find("scaling=yarn(factor=4)"), std::string::npos) << os.str();
  // Numbers print whole: six significant digits would show 1000000.5 as 1e+06.
  std::ostringstream exact;
  exact << *RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).theta(1000000.5).scaling(
      RopeScaling("linear").factor(2.25)));
  EXPECT_NE(exact.str().find("theta=1000000.5, interleaved=true, scaling=linear(factor=2.25)"), std::string::npos)
      << exact.str();
}

TEST(ScalingModule, DynamicGrowsAndResets) {
  const auto dyn = RopeScaling("dynamic").factor(2.0).max_position_embeddings(32);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(48).scaling(dyn));
  auto expect_state = [&](int64_t seq_len, int64_t rows, int line) {
    const auto f = rotary::compute_frequencies(8, 10000.0, dyn, seq_len);
    EXPECT_TRUE(torch::equal(rope->inv_freq, rotary::inv_freq_tensor(f))) << "line " << line;
    EXPECT_TRUE(torch::equal(rope->freqs, rotary::freqs_table(f, rows))) << "line " << line;
    EXPECT_TRUE(rope->named_buffers()["freqs"].is_same(rope->freqs)) << "line " << line;
  };
  const auto x = torch::randn({1, 1, 4, 8});
  expect_state(0, 48, __LINE__);
  rope->forward(x, 20);  // reach 24
  expect_state(0, 48, __LINE__);
  rope->forward(x, 36);  // reach 40 > 32: grow (float64 angles: row 0 alone, the rest on the fly)
  expect_state(40, 1, __LINE__);
  rope->forward(x, 60);  // reach 64: grow
  expect_state(64, 1, __LINE__);
  rope->forward(x, 40);  // reach 44: kept
  expect_state(64, 1, __LINE__);
  rope->forward(x, 10);  // reach 14 < 32: reset
  expect_state(0, 48, __LINE__);
  rope->forward(x, 0, std::nullopt, torch::tensor({0, 1, 2, 99}, torch::kLong).view({1, 4}));  // ids: reach 100
  expect_state(100, 1, __LINE__);

  // An unset max_position_embeddings is the module's max_seq_len.
  RotaryEmbedding implicit(RotaryEmbeddingOptions(8).max_seq_len(32).scaling(RopeScaling("dynamic").factor(2.0)));
  implicit->forward(x, 36);
  EXPECT_TRUE(torch::equal(implicit->inv_freq, rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, dyn, 40))));
}

TEST(ScalingModule, LongropeSwitchesFactors) {
  const auto lr = RopeScaling("longrope")
                      .short_factor({1.0, 1.5, 2.0, 2.5})
                      .long_factor({3.0, 5.0, 7.0, 9.0})
                      .original_max_position_embeddings(16)
                      .factor(4.0);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(64).interleaved(false).scaling(lr));
  const auto short_inv = rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, lr, 0));
  const auto long_inv = rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, lr, 17));
  EXPECT_DOUBLE_EQ(rope->attention_scaling, std::sqrt(1.0 + std::log(4.0) / std::log(16.0)));
  const auto x = torch::randn({2, 2, 4, 8});
  const std::vector<std::pair<int64_t, bool>> steps = {{0, false}, {12, false}, {13, true}, {40, true}, {11, false}};
  for (const auto& [start, is_long] : steps) {
    rope->forward(x, start);
    EXPECT_TRUE(torch::equal(rope->inv_freq, is_long ? long_inv : short_inv)) << "start " << start;
  }
  rope->forward(x, 0, torch::tensor({0, 13}, torch::kLong));  // offsets: 13 + 4 > 16
  EXPECT_TRUE(torch::equal(rope->inv_freq, long_inv));
}

TEST(ScalingModule, CloneKeepsBothBuffersAndTheState) {
  const auto dyn = RopeScaling("dynamic").factor(2.0).max_position_embeddings(32);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(32).scaling(dyn));
  rope->forward(torch::randn({1, 1, 8, 8}), 40);  // grown to 48 (row 0 alone)
  auto cloned = std::dynamic_pointer_cast<rotary::RotaryEmbeddingImpl>(rope->clone());
  ASSERT_TRUE(cloned);
  EXPECT_EQ(buffer_names(*cloned), (std::vector<std::string>{"freqs", "inv_freq"}));
  EXPECT_TRUE(torch::equal(cloned->freqs, rope->freqs));
  EXPECT_TRUE(torch::equal(cloned->inv_freq, rope->inv_freq));
  EXPECT_NE(cloned->freqs.data_ptr(), rope->freqs.data_ptr());
  EXPECT_NE(cloned->inv_freq.data_ptr(), rope->inv_freq.data_ptr());
  EXPECT_EQ(cloned->named_buffers()["inv_freq"].data_ptr(), cloned->inv_freq.data_ptr());
  EXPECT_EQ(cloned->freqs.size(0), 1);
  // the clone knows it was grown: going under max_position_embeddings resets it
  cloned->forward(torch::randn({1, 1, 2, 8}), 0);
  EXPECT_TRUE(torch::equal(cloned->inv_freq, rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, dyn))));
  EXPECT_EQ(cloned->freqs.size(0), 32);
  EXPECT_EQ(rope->freqs.size(0), 1);  // the original is untouched
}

TEST(ScalingModule, SaveLoadKeepsBothBuffers) {
  const auto options = RotaryEmbeddingOptions(16).max_seq_len(32).theta(777.0).scaling(yarn());
  RotaryEmbedding a(options);
  std::stringstream stream;
  torch::save(a, stream);
  RotaryEmbedding b(options);
  torch::NoGradGuard no_grad;
  b->inv_freq.mul_(2.0);  // loading must restore both buffers
  b->freqs.zero_();
  torch::load(b, stream);
  EXPECT_TRUE(torch::equal(b->freqs, a->freqs));
  EXPECT_TRUE(torch::equal(b->inv_freq, a->inv_freq));
  EXPECT_EQ(b->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(b->named_buffers()["inv_freq"].is_same(b->inv_freq));
  const auto x = torch::randn({1, 2, 4, 16});
  EXPECT_TRUE(torch::equal(a->forward(x, 3), b->forward(x, 3)));

  // Tables saved with other options are refused, never silently installed.
  std::stringstream again;
  torch::save(a, again);
  RotaryEmbedding other(RotaryEmbeddingOptions(16).max_seq_len(32));
  EXPECT_THROW(torch::load(other, again), c10::ValueError);
}

TEST(ScalingModule, DtypeCastsLeaveBothBuffers) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(32).scaling(yarn()));
  const auto freqs = rope->freqs.clone();
  const auto inv = rope->inv_freq.clone();
  rope->to(torch::kHalf);
  rope->to(torch::kBFloat16);
  rope->to(torch::kCPU, torch::kFloat);
  EXPECT_EQ(rope->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_EQ(rope->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(rope->freqs, freqs));
  EXPECT_TRUE(torch::equal(rope->inv_freq, inv));
}

}  // namespace
