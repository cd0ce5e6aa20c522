#pragma once

#include <rotary/options.h>

#include <torch/detail/static.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <ostream>
#include <tuple>

namespace rotary {

// Rotary position embedding with a cached complex64 table `freqs`
// [max_seq_len, dim / 2] and its float64 frequencies `inv_freq` [dim / 2],
// both filled by the frequency rule in options.scaling(). Both buffers keep
// their dtype under ->to(dtype) (q/k of any float dtype are rotated in fp32
// or better); ->to(device) moves them.
//
// "dynamic" and "longrope" depend on how far a call reaches (one past its
// largest position, like HF's max(position_ids) + 1); forward() rebuilds the
// tables on the host when that crosses the rule's threshold, as Hugging
// Face's dynamic_rope_update does:
//   dynamic   grows when the reach exceeds the length the table was last
//             built for (the table gains rows to cover it), and returns to
//             the original frequencies when the reach drops back under
//             max_position_embeddings;
//   longrope  uses long_factor while the reach exceeds
//             original_max_position_embeddings, short_factor otherwise.
// With `positions` this reads their maximum on the host (a sync on CUDA), so
// these two rules are not CUDA-graph safe. The other rules never rebuild.
class RotaryEmbeddingImpl : public torch::nn::Cloneable<RotaryEmbeddingImpl> {
 public:
  explicit RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  // x: [batch, heads, seq, head_dim]; rows start_pos .. start_pos + seq - 1,
  // or as given by `positions` (offsets [] / [batch], or position ids
  // [batch, seq]; see rotary::apply_rope).
  torch::Tensor forward(
      const torch::Tensor& x,
      int64_t start_pos = 0,
      const std::optional<torch::Tensor>& positions = std::nullopt);
  // q: [batch, heads_q, seq, head_dim], k: [batch, heads_k, seq, head_dim], one launch.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& q,
      const torch::Tensor& k,
      int64_t start_pos = 0,
      const std::optional<torch::Tensor>& positions = std::nullopt);

  // Host-driven rules: make the tables right for a call whose largest
  // position is reach - 1 (see above). A no-op for the other rules.
  void update_for_reach(int64_t reach);

  // The table is complex64 by design; a dtype cast would destroy it, so the
  // overrides below only move it between devices.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  RotaryEmbeddingOptions options;
  torch::Tensor freqs;     // complex64 [rows, dim / 2], rows >= max_seq_len
  torch::Tensor inv_freq;  // float64 [dim / 2]
  // The factor folded into every table entry (YaRN / LongRoPE; else 1).
  double attention_scaling = 1.0;

 private:
  RopeScaling effective_scaling() const;
  void build_tables();
  void prepare(const torch::Tensor& q, int64_t start_pos, const std::optional<torch::Tensor>& positions);

  // State of the host-driven rules; survives clone() (reset() rebuilds from it).
  int64_t dynamic_len_ = 0;    // dynamic: length the table was grown for, 0 = not grown
  bool long_factors_ = false;  // longrope: long_factor in use
};

}  // namespace rotary

// forward() is overloaded (x, or q and k), so torch's has_forward probe
// (&C::forward) fails and ModuleHolder::operator() would be declared to
// return void. Say it has one: operator() then resolves the overload like a
// direct call, and rope(x) / rope(q, k) return what forward returns.
namespace torch {
namespace detail {
template <>
struct has_forward<rotary::RotaryEmbeddingImpl> {
  static constexpr bool value = true;
};
}  // namespace detail
}  // namespace torch

namespace rotary {

TORCH_MODULE(RotaryEmbedding);

}  // namespace rotary
