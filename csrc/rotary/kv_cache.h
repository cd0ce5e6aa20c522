// rotary::KVCache: the k and v buffers of one attention layer, written by
// RotaryEmbedding::forward_with_cache (rotate q and k, append k and v, one op).
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <atomic>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace rotary {

struct KVCacheOptions {
  KVCacheOptions(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim)
      : batch_(batch), kv_heads_(kv_heads), capacity_(capacity), head_dim_(head_dim) {}
  TORCH_ARG(int64_t, batch);
  TORCH_ARG(int64_t, kv_heads);
  TORCH_ARG(int64_t, capacity);  // max_seq_len: positions 0 .. capacity - 1
  TORCH_ARG(int64_t, head_dim);
  // "BHSD" [batch, kv_heads, capacity, head_dim] or "BSHD" (flash-attn's
  // k_cache layout) [batch, capacity, kv_heads, head_dim].
  TORCH_ARG(std::string, layout) = "BHSD";
  // The dtype of k and v, or torch::kFloat8_e4m3fn (stored as x / scale).
  // Casting a parent module leaves it as it is (to(dtype) moves nothing).
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat32;
  // float8_e4m3fn only: finite and > 0 (unset: 1).
  TORCH_ARG(std::optional<double>, k_scale) = std::nullopt;
  TORCH_ARG(std::optional<double>, v_scale) = std::nullopt;
  // float8_e4m3fn only, instead of k_scale / v_scale: one scale per kv head
  // (kv_heads entries, each finite and > 0); the scale buffer is [kv_heads].
  TORCH_ARG(std::vector<double>, k_head_scales) = {};
  TORCH_ARG(std::vector<double>, v_head_scales) = {};
};

// Buffers `k` and `v` (registered, so they move with ->to(device) and are
// saved), plus the number of positions filled. Every sequence of the batch
// has the same length.
class KVCacheImpl : public torch::nn::Cloneable<KVCacheImpl> {
 public:
  explicit KVCacheImpl(const KVCacheOptions& options_);

  // Fresh zero buffers for the options (changed ones too) and length 0.
  // truncate(0) empties the cache without reallocating.
  void reset() override;
  // A copy of the buffers, their options in effect and the length (a pending
  // change to `options` stays pending in the copy).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;
  void pretty_print(std::ostream& stream) const override;
  // The buffers, length() and layout; load refuses an archive without any
  // of them, then is load_state's.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  // Restores a saved state (load, and Python's load_state_dict and pickle):
  // every piece is checked against this cache (shape and dtype of each
  // buffer, the layout, the length within the capacity) before any is
  // copied, so a cache of other options is refused by name instead of read
  // as other bytes. An undefined tensor, or no length or layout, keeps what
  // the cache holds.
  void load_state(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_scale,
                  const torch::Tensor& v_scale, std::optional<int64_t> length, const std::optional<std::string>& layout,
                  const char* who);
  // Only the device changes: the cache keeps the dtype of its options.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  int64_t length() const { return length_; }
  // The options of the last reset(), which the buffers hold: a change to
  // `options` waits for reset(), as RotaryEmbedding's does.
  const KVCacheOptions& options_in_effect() const { return in_effect_; }
  // Forget the contents past `length` (0 empties the cache); nothing is freed.
  void truncate(int64_t length);
  // Called by forward_with_cache after it wrote `tokens` rows at length().
  void advance(int64_t tokens);

  // The filled part, [batch, kv_heads, length, head_dim] views whatever the
  // layout; float8 caches are dequantised into new tensors of `dtype` (a
  // floating dtype; other caches ignore it).
  std::pair<torch::Tensor, torch::Tensor> keys_values(torch::Dtype dtype = torch::kFloat32) const;

  // One writer at a time: forward_with_cache reads length(), writes its rows
  // there and advances, so two at once would write the same rows. While a
  // Writing lives, another begin_write (forward_with_cache, truncate,
  // reset, load_state) is refused, naming `who`. A process forked during a
  // write holds a write that never ends: only reset() takes it over.
  struct Busy {  // a copy is not being written
    std::atomic<bool> on{false};
    std::atomic<long> writer{0};  // the writing process's pid; 0 while none or not yet noted
    Busy() = default;
    Busy(const Busy&) {}
    Busy& operator=(const Busy&) { return *this; }
  };
  class Writing {
   public:
    explicit Writing(Busy* busy) : busy_(busy) {}
    Writing(Writing&& other) noexcept : busy_(std::exchange(other.busy_, nullptr)) {}
    Writing(const Writing&) = delete;
    Writing& operator=(const Writing&) = delete;
    Writing& operator=(Writing&&) = delete;
    ~Writing() {
      if (!busy_) return;
      busy_->writer.store(0, std::memory_order_relaxed);
      busy_->on.store(false, std::memory_order_release);
    }

   private:
    Busy* busy_;
  };
  [[nodiscard]] Writing begin_write(const char* who, bool resets = false);

  KVCacheOptions options;
  torch::Tensor k, v;
  torch::Tensor k_scale, v_scale;  // float32 [] or [kv_heads], for float8 caches (else undefined)

 private:
  KVCacheOptions in_effect_;
  int64_t length_ = 0;
  Busy busy_;
};

TORCH_MODULE(KVCache);

}  // namespace rotary
