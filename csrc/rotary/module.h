#pragma once

#include <rotary/options.h>

#include <torch/detail/static.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>

#include <mutex>
#include <optional>
#include <ostream>
#include <string>
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
//
// Threads: forward() may be called on one module from several threads at
// once. It only reads the module, except for the two host-driven rules,
// whose calls are serialised by a lock (the table a call uses is the one
// built for its own reach). load(), reset(), to() and clone() must not run
// concurrently with forward().
//
// Loading (torch::load, or load_tables from Python) never installs a table
// the options would not build: the saved buffers are checked against the
// options (check_saved_tables) and then rebuilt from them.
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

  // torch::load(module, path): reads `freqs` (and `inv_freq` when present),
  // throws c10::ValueError if they are not what these options build (another
  // theta, rule, max_seq_len or angle_dtype), else rebuilds both from the
  // options, restoring the host-driven state the saved tables were in.
  void load(torch::serialize::InputArchive& archive) override;
  // The same for tensors at hand (a Python state_dict). Either may be absent;
  // `who` starts an error message.
  void load_tables(
      const std::optional<torch::Tensor>& freqs,
      const std::optional<torch::Tensor>& inv_freq,
      const std::string& who = "RotaryEmbedding.load");

  RotaryEmbeddingOptions options;
  torch::Tensor freqs;     // complex64 [rows, dim / 2], rows >= max_seq_len
  torch::Tensor inv_freq;  // float64 [dim / 2]
  // The factor folded into every table entry (YaRN / LongRoPE; else 1).
  double attention_scaling = 1.0;

 private:
  RopeScaling effective_scaling() const;
  void build_tables();
  void prepare(const torch::Tensor& q, int64_t start_pos, const std::optional<torch::Tensor>& positions);

  // The tensor handed to the op as inv_freq: the float64 frequencies, so
  // positions past the table are computed exactly; none with float32 angles
  // (the on-the-fly path is float64 only).
  std::optional<torch::Tensor> past_table_inv_freq() const;

  // State of the host-driven rules; survives clone() (reset() rebuilds from it).
  int64_t dynamic_len_ = 0;    // dynamic: length the table was grown for, 0 = not grown
  bool long_factors_ = false;  // longrope: long_factor in use

  // Serialises forward() of the host-driven rules. A copy (clone()) gets a
  // fresh mutex.
  struct Lock {
    Lock() = default;
    Lock(const Lock&) {}
    Lock& operator=(const Lock&) { return *this; }
    std::recursive_mutex mutex;
  };
  mutable Lock host_driven_lock_;
};

// Checks tables saved from a RotaryEmbedding (its `freqs` complex64 [rows,
// dim / 2] and `inv_freq` float64 [dim / 2]; either may be absent) against
// what a module with `options` builds: dtype and shape, row count
// (max_seq_len; more for a grown "dynamic" rule), inv_freq to 1e-12 relative,
// and every table entry to 2^-22 (times the attention scaling), which tells
// another theta, rule, factor or angle_dtype apart. The host-driven rules
// may have been saved in any of their states. Returns the sequence length
// of the state that matches (0: the initial one; for compute_frequencies).
// Throws c10::ValueError naming the buffer, the options and the first
// mismatch. `who` starts the message.
int64_t check_saved_tables(
    const RotaryEmbeddingOptions& options,
    const std::optional<at::Tensor>& freqs,
    const std::optional<at::Tensor>& inv_freq,
    const std::string& who = "RotaryEmbedding.load");

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
