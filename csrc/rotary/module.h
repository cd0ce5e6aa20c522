#pragma once

#include <rotary/front_end.h>
#include <rotary/kv_cache.h>
#include <rotary/options.h>
#include <rotary/tables.h>

#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <torch/detail/static.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>

#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

namespace rotary {

// Rotary position embedding with a cached complex64 table `freqs`
// [max_seq_len, dim / 2] and its float64 frequencies `inv_freq` [dim / 2],
// both filled by the frequency rule in options.scaling(). Both buffers keep
// their dtype under ->to(dtype) (q/k of any float dtype are rotated in fp32
// or better); ->to(device) moves them.
//
// Every decision about the tables (what to build, when the host-driven rules
// "dynamic" and "longrope" rebuild for a call's reach, how saved tables are
// checked and restored, the lock) is made by rotary::RopeTables
// (rotary/tables.h), which the Python RotaryEmbedding uses too. With
// offsets or position_ids a host-driven rule reads their maximum on the host
// (a sync on CUDA), so these two rules are not CUDA-graph safe.
//
// A call that throws leaves the module as it was: new tables are installed
// only after the op returned.
//
// Threads: forward() may be called on one module from several threads at
// once. It only reads the module, except for the two host-driven rules,
// whose calls are serialised by a lock (the table a call uses is the one
// built for its own reach). load(), reset(), to() and clone() must not run
// concurrently with forward().
//
// Loading (torch::load, or load_tables) never installs a table the options
// would not build: the saved buffers are checked against the options
// (check_saved_tables) and then rebuilt from them.
class RotaryEmbeddingImpl : public torch::nn::Cloneable<RotaryEmbeddingImpl> {
 public:
  explicit RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // A copy that runs what this module runs: the options in effect and their
  // state (a pending change to `options` stays pending in the copy too).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;

  // x: [batch, heads, seq, head_dim] with head_dim >= dim (or as `layout`
  // says: "BSHD", "SBHD"); rows start_pos .. start_pos + seq - 1, shifted
  // per batch by `offsets` ([] / [batch]), or the absolute `position_ids`
  // ([seq] / [batch, seq], start_pos 0); see rotary::apply_rope.
  torch::Tensor forward(
      const torch::Tensor& x,
      int64_t start_pos = 0,
      const std::optional<torch::Tensor>& offsets = std::nullopt,
      const std::optional<torch::Tensor>& position_ids = std::nullopt,
      c10::string_view layout = "BHSD");
  // q: [batch, heads_q, seq, head_dim], k: [batch, heads_k, seq, head_dim]
  // (or in `layout`), one launch.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& q,
      const torch::Tensor& k,
      int64_t start_pos = 0,
      const std::optional<torch::Tensor>& offsets = std::nullopt,
      const std::optional<torch::Tensor>& position_ids = std::nullopt,
      c10::string_view layout = "BHSD");

  // Decode with a cache: rotates q and k ([batch, heads, seq, head_dim], or
  // in `layout`) in place at positions start_pos .. (default: cache->length()) and appends
  // the rotated k and v at cache->length(), in one op
  // (rotary::apply_rope_with_kv_cache_). Returns (q, keys, values), keys and
  // values the filled cache as [batch, kv_heads, length, head_dim].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_with_cache(
      torch::Tensor& q,
      torch::Tensor& k,
      const torch::Tensor& v,
      KVCache& cache,
      std::optional<int64_t> start_pos = std::nullopt,
      c10::string_view layout = "BHSD");

  // Host-driven rules: make the tables right for a call whose largest
  // position is reach - 1. A no-op for the other rules.
  void update_for_reach(int64_t reach);

  // True for the rules whose tables follow the reach of each call.
  bool host_driven() const { return tables_.host_driven(); }
  // The state machine: its options() (defaults filled in) and state().
  const RopeTables& tables() const { return tables_; }

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
  // `state`: the one they were saved in, when known (a copy's), tried first.
  void load_tables(
      const std::optional<torch::Tensor>& freqs,
      const std::optional<torch::Tensor>& inv_freq,
      const std::string& who = "RotaryEmbedding.load",
      std::optional<int64_t> state = std::nullopt);

  // After a refused deletion of a buffer (torch.nn.utils.parametrize from
  // Python writes into it first): RopeTables::keep over freqs, inv_freq.
  void keep_tables();

  // What the next reset() builds (torch's convention): the module runs, and
  // pretty_prints, with tables().options(), which reset() sets from these.
  RotaryEmbeddingOptions options;
  torch::Tensor freqs;     // complex64 [rows, dim / 2], rows >= max_seq_len
  torch::Tensor inv_freq;  // float64 [dim / 2]
  // The factor folded into every table entry (YaRN / LongRoPE; else 1).
  double attention_scaling = 1.0;
  // The pair -> axis map of the options (pair_axes_of, rotary/axes.h); empty
  // for one position per token. Used when position_ids is 3-D [n_axes,
  // batch, seq]; other positions turn every pair by the one position.
  std::vector<int64_t> pair_axes;

 private:
  void install(const RopeTableSet& tables);
  ModuleBuffers module_buffers();
  at::OptionalIntArrayRef axes_for(const std::optional<torch::Tensor>& position_ids) const;
  template <typename Op>
  auto run(
      const torch::Tensor& q,
      int64_t start_pos,
      const std::optional<torch::Tensor>& offsets,
      const std::optional<torch::Tensor>& position_ids,
      c10::string_view layout,
      Op&& op);

  // Copied by clone(), so a copy keeps the host-driven state.
  RopeTables tables_;
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
