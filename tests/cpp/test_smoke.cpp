#include <rotary/rotary.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
TEST(Smoke, Runs) {
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(8).max_seq_len(16));
  auto x = torch::randn({2, 3, 5, 8});
  auto y = rope->forward(x, 2);
  EXPECT_EQ(y.sizes(), x.sizes());
}
