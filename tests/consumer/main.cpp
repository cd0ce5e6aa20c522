// Builds a tiny attention projection with rotary::RotaryEmbedding from the
// installed package, runs forward and backward, and checks the rotation
// against the float64 formula at one element.
#include <rotary/rotary.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>

bool save_load_round_trip(const std::string& path);  // save_load.cpp

int main(int argc, char** argv) {
  torch::manual_seed(0);
  const int64_t batch = 2, heads = 4, kv_heads = 2, seq = 8, dim = 16;
  torch::nn::Linear wq(32, heads * dim), wk(32, kv_heads * dim);
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(dim).max_seq_len(64));

  auto x = torch::randn({batch, seq, 32});
  auto q = wq(x).view({batch, seq, heads, dim}).transpose(1, 2);
  auto k = wk(x).view({batch, seq, kv_heads, dim}).transpose(1, 2);
  auto [rq, rk] = rope->forward(q, k, /*start_pos=*/5);
  auto scores = torch::matmul(rq, rk.repeat_interleave(heads / kv_heads, 1).transpose(-1, -2));
  scores.sum().backward();

  // Element (b=1, h=2, s=3, pair 1) of q, rotated by (5 + 3) * 10000^(-2/16).
  const double angle = 8.0 * std::pow(10000.0, -2.0 / 16.0);
  const double x0 = q[1][2][3][2].item<double>(), x1 = q[1][2][3][3].item<double>();
  const double expected = x0 * std::cos(angle) - x1 * std::sin(angle);
  const double got = rq[1][2][3][2].item<double>();
  const bool grads = wq->weight.grad().defined() && wk->weight.grad().abs().sum().item<double>() > 0;
  std::printf("consumer: rotated %.6f expected %.6f, gradients %s\n", got, expected, grads ? "ok" : "missing");
  const bool saved = save_load_round_trip(argc > 1 ? argv[1] : "rope.pt");
  return std::fabs(got - expected) < 1e-5 && grads && saved ? 0 : 1;
}
