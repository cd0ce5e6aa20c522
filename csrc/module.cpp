#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>

namespace rotary {

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_) : options(options_) {
  reset();
}

RopeScaling RotaryEmbeddingImpl::effective_scaling() const {
  RopeScaling s = options.scaling();
  if (s.type() == "dynamic" && !s.max_position_embeddings()) s.max_position_embeddings(options.max_seq_len());
  return s;
}

// (Re)computes both buffers for the current rule state. The first call
// registers them; later calls swap their contents in place (set_data), so
// the registered buffers and the members stay the same tensors.
void RotaryEmbeddingImpl::build_tables() {
  const RopeScaling s = effective_scaling();
  int64_t seq_len = 0;  // the frequencies a model starts with
  int64_t rows = options.max_seq_len();
  if (s.type() == "dynamic" && dynamic_len_ > 0) {
    seq_len = dynamic_len_;
    rows = std::max(rows, dynamic_len_);
  } else if (s.type() == "longrope" && long_factors_) {
    seq_len = *s.original_max_position_embeddings() + 1;
  }
  const RopeFrequencies f = compute_frequencies(options.dim(), options.theta(), s, seq_len);
  auto table = freqs_table(f, rows);
  auto inv = inv_freq_tensor(f);
  if (freqs.defined()) table = table.to(freqs.device());
  if (inv_freq.defined()) inv = inv.to(inv_freq.device());
  attention_scaling = f.attention_scaling;

  const auto registered = named_buffers(/*recurse=*/false);
  if (registered.contains("freqs") && registered.contains("inv_freq")) {
    torch::NoGradGuard no_grad;
    freqs.set_data(table);
    inv_freq.set_data(inv);
  } else {
    freqs = register_buffer("freqs", table);
    inv_freq = register_buffer("inv_freq", inv);
  }
}

void RotaryEmbeddingImpl::reset() {
  TORCH_CHECK_VALUE(
      options.dim() > 0 && options.dim() % 2 == 0, "RotaryEmbedding: dim must be even and > 0, got ",
      options.dim());
  TORCH_CHECK_VALUE(
      options.max_seq_len() > 0, "RotaryEmbedding: max_seq_len must be > 0, got ", options.max_seq_len());
  TORCH_CHECK_VALUE(
      std::isfinite(options.theta()) && options.theta() > 0.0,
      "RotaryEmbedding: theta must be finite and > 0, got ", options.theta());
  build_tables();
}

void RotaryEmbeddingImpl::update_for_reach(int64_t reach) {
  const RopeScaling s = effective_scaling();
  if (s.type() == "dynamic") {
    const int64_t original = *s.max_position_embeddings();
    const int64_t cached = dynamic_len_ > 0 ? dynamic_len_ : original;
    if (reach > cached) {  // grow
      dynamic_len_ = reach;
      build_tables();
    } else if (reach < original && cached > original) {  // back to the original frequencies
      dynamic_len_ = 0;
      build_tables();
    }
  } else if (s.type() == "longrope") {
    const bool want_long = reach > *s.original_max_position_embeddings();
    if (want_long != long_factors_) {
      long_factors_ = want_long;
      build_tables();
    }
  }
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "rotary::RotaryEmbedding(dim=" << options.dim() << ", max_seq_len=" << options.max_seq_len()
         << ", theta=" << options.theta() << ", interleaved=" << (options.interleaved() ? "true" : "false");
  if (options.scaling().type() != "default") {
    stream << ", scaling=" << options.scaling().type();
    if (options.scaling().factor()) stream << "(factor=" << *options.scaling().factor() << ")";
  }
  stream << ")";
}

// Host-side checks and, for the host-driven rules, the table update.
void RotaryEmbeddingImpl::prepare(
    const torch::Tensor& q,
    int64_t start_pos,
    const std::optional<torch::Tensor>& positions) {
  if (q.dim() != 4) return;  // the op reports the shape error
  TORCH_CHECK_VALUE(start_pos >= 0, "RotaryEmbedding: start_pos must be >= 0, got ", start_pos);
  TORCH_CHECK_INDEX(start_pos < (int64_t{1} << 60), "RotaryEmbedding: start_pos must be < 2^60, got ", start_pos);
  const int64_t seq_len = q.size(2);
  if (depends_on_seq_len(options.scaling()) && seq_len > 0) {
    // One past the largest position this call touches.
    int64_t reach = start_pos + seq_len;
    if (positions && positions->defined() && positions->numel() > 0) {
      const int64_t top = positions->max().item<int64_t>();
      reach = positions->dim() == 2 ? start_pos + top + 1 : start_pos + top + seq_len;
    }
    update_for_reach(reach);
  }
}

torch::Tensor RotaryEmbeddingImpl::forward(
    const torch::Tensor& x,
    int64_t start_pos,
    const std::optional<torch::Tensor>& positions) {
  prepare(x, start_pos, positions);
  return apply_rope(x, freqs, start_pos, options.interleaved(), positions, false, std::nullopt, inv_freq);
}

std::tuple<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    int64_t start_pos,
    const std::optional<torch::Tensor>& positions) {
  prepare(q, start_pos, positions);
  return apply_rope_qk(q, k, freqs, start_pos, options.interleaved(), positions, false, std::nullopt, inv_freq);
}

// Only the device changes: the table stays complex64 and inv_freq float64
// whatever dtype the rest of the model is cast to.
void RotaryEmbeddingImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  to(device, non_blocking);
}

void RotaryEmbeddingImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

void RotaryEmbeddingImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

}  // namespace rotary
