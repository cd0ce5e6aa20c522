#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <c10/util/Exception.h>

namespace rotary {

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_) : options(options_) {
  reset();
}

void RotaryEmbeddingImpl::reset() {
  TORCH_CHECK_VALUE(
      options.dim() > 0 && options.dim() % 2 == 0, "RotaryEmbedding: dim must be even and > 0, got ",
      options.dim());
  TORCH_CHECK_VALUE(
      options.max_seq_len() > 0, "RotaryEmbedding: max_seq_len must be > 0, got ", options.max_seq_len());
  auto table = rope_freqs(options.dim(), options.max_seq_len(), options.theta());
  if (freqs.defined()) table = table.to(freqs.device());
  freqs = register_buffer("freqs", table);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "rotary::RotaryEmbedding(dim=" << options.dim() << ", max_seq_len=" << options.max_seq_len()
         << ", theta=" << options.theta() << ", interleaved=" << (options.interleaved() ? "true" : "false")
         << ")";
}

void RotaryEmbeddingImpl::check_range(int64_t start_pos, int64_t seq_len) const {
  TORCH_CHECK_VALUE(start_pos >= 0, "RotaryEmbedding: start_pos must be >= 0, got ", start_pos);
  TORCH_CHECK_INDEX(
      start_pos + seq_len <= options.max_seq_len(), "RotaryEmbedding: start_pos + seq_len = ", start_pos,
      " + ", seq_len, " = ", start_pos + seq_len, " exceeds max_seq_len ", options.max_seq_len(),
      "; construct the module with a larger max_seq_len");
}

torch::Tensor RotaryEmbeddingImpl::forward(const torch::Tensor& x, int64_t start_pos) {
  if (x.dim() == 4) check_range(start_pos, x.size(2));
  return apply_rope(x, freqs, start_pos, options.interleaved());
}

std::tuple<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    int64_t start_pos) {
  if (q.dim() == 4) check_range(start_pos, q.size(2));
  return apply_rope_qk(q, k, freqs, start_pos, options.interleaved());
}

// Only the device changes: the table stays complex64 whatever dtype the rest
// of the model is cast to.
void RotaryEmbeddingImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  to(device, non_blocking);
}

void RotaryEmbeddingImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

void RotaryEmbeddingImpl::to(torch::Device device, bool non_blocking) {
  torch::nn::Module::to(device, non_blocking);
}

}  // namespace rotary
