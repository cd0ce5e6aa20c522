#include <rotary/axes.h>
#include <rotary/bounds.h>
#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

namespace rotary {

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_)
    : options(options_), tables_(options_) {
  reset();
}

// Registers both buffers on the first call; later calls swap their contents
// (set_data), so the registered buffers and the members stay the same tensors.
void RotaryEmbeddingImpl::install(const RopeTableSet& tables) {
  const auto registered = named_buffers(/*recurse=*/false);
  if (registered.contains("freqs") && registered.contains("inv_freq")) {
    torch::NoGradGuard no_grad;
    freqs.set_data(tables.freqs);
    inv_freq.set_data(tables.inv_freq);
  } else {
    freqs = register_buffer("freqs", tables.freqs);
    inv_freq = register_buffer("inv_freq", tables.inv_freq);
  }
  attention_scaling = tables.attention_scaling;
}

void RotaryEmbeddingImpl::reset() {
  // A copy (clone()) keeps the host-driven state; other options start afresh.
  const bool same_rule = tables_.options().scaling().type() == options.scaling().type();
  RopeTables next(options, same_rule ? tables_.state() : 0);
  const RopeTableSet built = next.build(next.state(), freqs.defined() ? freqs.device() : torch::Device(torch::kCPU));
  std::vector<int64_t> axes = pair_axes_of(options);
  tables_ = next;
  install(built);
  pair_axes = std::move(axes);
}

void RotaryEmbeddingImpl::load(torch::serialize::InputArchive& archive) {
  // Read into fresh tensors (not into the buffers): nothing is installed
  // before it has been checked.
  torch::Tensor saved_freqs, saved_inv_freq;
  archive.read("freqs", saved_freqs, /*is_buffer=*/true);
  const bool has_inv = archive.try_read("inv_freq", saved_inv_freq, /*is_buffer=*/true);
  load_tables(saved_freqs, has_inv ? std::optional<torch::Tensor>(saved_inv_freq) : std::nullopt);
}

void RotaryEmbeddingImpl::load_tables(
    const std::optional<torch::Tensor>& saved_freqs,
    const std::optional<torch::Tensor>& saved_inv_freq,
    const std::string& who) {
  tables_.restore(saved_freqs, saved_inv_freq, who, freqs.device(), [&](const RopeTableSet& t) { install(t); });
}

void RotaryEmbeddingImpl::update_for_reach(int64_t reach) {
  tables_.run(reach, freqs.device(), [&](const RopeTableSet* fresh) {
    if (fresh) install(*fresh);
    return 0;
  });
}

// N-D positions come as [n_axes, batch, seq]; anything else is one position
// per token, which for M-RoPE is exactly the text-token rotation.
at::OptionalIntArrayRef RotaryEmbeddingImpl::axes_for(const std::optional<torch::Tensor>& position_ids) const {
  const bool nd = position_ids && position_ids->defined() && position_ids->dim() == 3;
  return pair_axes.empty() || !nd ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(pair_axes);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "rotary::RotaryEmbedding(dim=" << options.dim() << ", max_seq_len=" << options.max_seq_len()
         << ", theta=" << options.theta() << ", interleaved=" << (options.interleaved() ? "true" : "false");
  if (options.scaling().type() != "default") {
    stream << ", scaling=" << options.scaling().type();
    if (options.scaling().factor()) stream << "(factor=" << *options.scaling().factor() << ")";
  }
  if (options.angle_dtype() != torch::kFloat64) stream << ", angle_dtype=" << angle_dtype_name(options.angle_dtype());
  if (options.rotary_offset() != 0) stream << ", rotary_offset=" << options.rotary_offset();
  if (!options.mrope_section().empty()) {
    stream << ", mrope_section=" << c10::ArrayRef<int64_t>(options.mrope_section())
           << (options.mrope_interleaved() ? ", mrope_interleaved=true" : "");
  }
  if (!options.axes_dim().empty()) stream << ", axes_dim=" << c10::ArrayRef<int64_t>(options.axes_dim());
  stream << ")";
}

// Host-side checks, then op(freqs, inv_freq) with the tables right for this
// call; new tables are installed only when op returned.
template <typename Op>
auto RotaryEmbeddingImpl::run(
    const torch::Tensor& q,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids,
    Op&& op) {
  const bool has_positions = (offsets && offsets->defined()) || (position_ids && position_ids->defined());
  const int64_t seq_len = q.dim() == 4 ? q.size(2) : 0;  // the op reports a wrong shape
  TORCH_CHECK_VALUE(
      q.dim() != 4 || bounds::span_fits(options.rotary_offset(), options.dim(), q.size(3)), "RotaryEmbedding(dim=",
      options.dim(), "): head_dim must be >= ",
      // Both are >= 0 (check_options), so their sum fits in uint64.
      options.rotary_offset() ? "rotary_offset + dim = " +
              std::to_string(static_cast<uint64_t>(options.rotary_offset()) + static_cast<uint64_t>(options.dim())) +
              " (the rotated span)"
                              : std::string("dim (the rotated width)"),
      ", got head_dim ", q.size(3), " (shape ", q.sizes(), ")");
  RopeTables::check_start_pos(start_pos);
  const int64_t reach =
      tables_.host_driven() ? RopeTables::reach_of(seq_len, start_pos, offsets, position_ids) : 0;
  // Under the lock of a host-driven rule from here on.
  return tables_.run(reach, freqs.device(), [&](const RopeTableSet* fresh) {
    const torch::Tensor& f = fresh ? fresh->freqs : freqs;
    tables_.check_rows(seq_len, start_pos, has_positions, f.size(0));
    // inv_freq only where the call may reach past the table: a short decode
    // step skips its checks (the kernel reads the table either way).
    const bool within = !has_positions && q.dim() == 4 && start_pos + seq_len <= f.size(0);
    std::optional<torch::Tensor> inv;
    if (tables_.extends_past_table() && !within) inv = fresh ? fresh->inv_freq : inv_freq;
    auto out = op(f, inv);
    if (fresh) install(*fresh);
    return out;
  });
}

torch::Tensor RotaryEmbeddingImpl::forward(
    const torch::Tensor& x,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids) {
  return run(x, start_pos, offsets, position_ids, [&](const torch::Tensor& f, const std::optional<torch::Tensor>& inv) {
    return apply_rope(
        x, f, start_pos, options.interleaved(), offsets, position_ids, false, std::nullopt, inv, "BHSD",
        options.rotary_offset(), axes_for(position_ids));
  });
}

std::tuple<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids) {
  return run(q, start_pos, offsets, position_ids, [&](const torch::Tensor& f, const std::optional<torch::Tensor>& inv) {
    return apply_rope_qk(
        q, k, f, start_pos, options.interleaved(), offsets, position_ids, false, std::nullopt, inv, "BHSD",
        options.rotary_offset(), axes_for(position_ids));
  });
}

// The fused op writes the rows; the cache only learns its new length.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward_with_cache(
    torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v, KVCache& cache, std::optional<int64_t> start_pos) {
  auto& c = *cache;
  TORCH_CHECK_VALUE(q.dim() == 4, "RotaryEmbedding.forward_with_cache: q must be 4-D [batch, heads, seq, head_dim], got ",
                    q.sizes());
  const auto cache_dtype = c.options.dtype();
  TORCH_CHECK_TYPE(
      cache_dtype == k.scalar_type() || cache_dtype == torch::kFloat8_e4m3fn, "RotaryEmbedding.forward_with_cache: ",
      "the KVCache holds ", cache_dtype, " but k is ", k.scalar_type(), "; build the KVCache with dtype=",
      k.scalar_type(), " (or float8_e4m3fn), or cast k");
  const int64_t seq = q.size(2), filled = c.length();
  TORCH_CHECK_INDEX(filled + seq <= c.options.capacity(), "RotaryEmbedding.forward_with_cache: appending ", seq,
                    " positions to a cache holding ", filled, " exceeds its capacity ", c.options.capacity());
  const int64_t pos = start_pos.value_or(filled);
  // Rows go at length() .. even when the rotation is elsewhere (start_pos).
  std::optional<torch::Tensor> rows;
  if (pos != filled) rows = torch::arange(filled, filled + seq, torch::dtype(torch::kLong).device(q.device())).expand({q.size(0), seq});
  run(q, pos, std::nullopt, std::nullopt, [&](const torch::Tensor& f, const std::optional<torch::Tensor>& inv) {
    apply_rope_with_kv_cache_(q, k, v, c.k, c.v, f, pos, options.interleaved(), std::nullopt, std::nullopt, std::nullopt,
                              inv, "BHSD", rows, std::nullopt, c.options.layout(),
                              c.k_scale.defined() ? std::optional<torch::Tensor>(c.k_scale) : std::nullopt,
                              c.v_scale.defined() ? std::optional<torch::Tensor>(c.v_scale) : std::nullopt,
                              /*inverse=*/false, options.rotary_offset());
    return 0;
  });
  c.advance(seq);
  auto [keys, values] = c.keys_values(q.scalar_type());
  return {q, keys, values};
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
