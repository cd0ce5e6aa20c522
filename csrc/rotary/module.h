#pragma once

#include <rotary/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <ostream>
#include <tuple>

namespace rotary {

// Rotary position embedding with a cached complex64 table `freqs`
// [max_seq_len, dim / 2]. The table keeps its dtype under ->to(dtype): it is
// always complex64, and q/k of any float dtype are rotated in fp32 or better.
class RotaryEmbeddingImpl : public torch::nn::Cloneable<RotaryEmbeddingImpl> {
 public:
  explicit RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  // x: [batch, heads, seq, dim]; rows start_pos .. start_pos + seq - 1.
  torch::Tensor forward(const torch::Tensor& x, int64_t start_pos = 0);
  // q: [batch, heads_q, seq, dim], k: [batch, heads_k, seq, dim], one launch.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& q,
      const torch::Tensor& k,
      int64_t start_pos = 0);

  // The table is complex64 by design; a dtype cast would destroy it, so the
  // overrides below only move it between devices.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  RotaryEmbeddingOptions options;
  torch::Tensor freqs;

 private:
  void check_range(int64_t start_pos, int64_t seq_len) const;
};

TORCH_MODULE(RotaryEmbedding);

}  // namespace rotary
