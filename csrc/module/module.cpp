#include <rotary/axes.h>
#include <rotary/freqs.h>
#include <rotary/front_end.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <utility>

namespace rotary {

using OptTensor = std::optional<torch::Tensor>;

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
  // Afresh from `options`, as a new module: a host-driven rule's state too.
  RopeTables next(options);
  const RopeTableSet built = next.build(next.state(), freqs.defined() ? freqs.device() : torch::Device(torch::kCPU));
  std::vector<int64_t> axes = pair_axes_of(options);
  tables_ = next;
  install(built);
  tables_.own({freqs, inv_freq});
  pair_axes = std::move(axes);
}

std::shared_ptr<torch::nn::Module> RotaryEmbeddingImpl::clone(const std::optional<torch::Device>& device) const {
  // Not Cloneable::clone: it resets the copy from `options`, a pending change
  // included (which may not even build). The copy is built from the options
  // in effect, takes these tables and their state, then the pending change.
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<RotaryEmbeddingImpl>(tables_.options());
  copy->install({clone_buffer(freqs, device), clone_buffer(inv_freq, device), attention_scaling, tables_.state()});
  copy->tables_ = tables_;
  copy->tables_.own({copy->freqs, copy->inv_freq});
  copy->pair_axes = pair_axes;
  copy->options = options;
  copy->train(is_training());
  return copy;
}

void RotaryEmbeddingImpl::load(torch::serialize::InputArchive& archive) {
  // Read into fresh tensors (not into the buffers): nothing is installed
  // before it has been checked.
  torch::Tensor saved_freqs, saved_inv_freq;
  TORCH_CHECK_VALUE(archive.try_read("freqs", saved_freqs, /*is_buffer=*/true),
                    "RotaryEmbedding.load: the archive has no 'freqs' (torch::save of a RotaryEmbedding writes it)");
  const bool has_inv = archive.try_read("inv_freq", saved_inv_freq, /*is_buffer=*/true);
  load_tables(saved_freqs, has_inv ? std::optional<torch::Tensor>(saved_inv_freq) : std::nullopt);
}

void RotaryEmbeddingImpl::load_tables(
    const std::optional<torch::Tensor>& saved_freqs,
    const std::optional<torch::Tensor>& saved_inv_freq,
    const std::string& who,
    std::optional<int64_t> state) {
  tables_.restore(
      saved_freqs, saved_inv_freq, who, freqs.device(), [&](const RopeTableSet& t) { install(t); }, state);
}

void RotaryEmbeddingImpl::keep_tables() {
  tables_.keep({freqs, inv_freq}, "RotaryEmbedding", [&](const RopeTableSet& t) { install(t); });
}

void RotaryEmbeddingImpl::update_for_reach(int64_t reach) {
  tables_.check_reach(reach);
  tables_.run(reach, freqs.device(), [&] { return RopeTables::Held{freqs, inv_freq}; }, [&](const RopeTableSet* fresh) {
    if (fresh) install(*fresh);
    return 0;
  });
}

at::OptionalIntArrayRef RotaryEmbeddingImpl::axes_for(const std::optional<torch::Tensor>& position_ids) const {
  return module_pair_axes(tables_.options(), pair_axes, position_ids);
}

void RotaryEmbeddingImpl::pretty_print(std::ostream& stream) const {
  const auto& o = tables_.options();  // in effect: set by the last reset()
  stream << "rotary::RotaryEmbedding(dim=" << o.dim() << ", max_seq_len=" << o.max_seq_len()
         << ", theta=" << number_text(o.theta()) << ", interleaved=" << (o.interleaved() ? "true" : "false");
  if (o.scaling().type() != "default") {
    stream << ", scaling=" << o.scaling().type();
    if (o.scaling().factor()) stream << "(factor=" << number_text(*o.scaling().factor()) << ")";
  }
  if (o.angle_dtype() != torch::kFloat64) stream << ", angle_dtype=" << angle_dtype_name(o.angle_dtype());
  if (o.rotary_offset() != 0) stream << ", rotary_offset=" << o.rotary_offset();
  if (!o.mrope_section().empty()) {
    stream << ", mrope_section=" << c10::ArrayRef<int64_t>(o.mrope_section())
           << (o.mrope_interleaved() ? ", mrope_interleaved=true" : "");
  }
  if (!o.axes_dim().empty()) stream << ", axes_dim=" << c10::ArrayRef<int64_t>(o.axes_dim());
  if (!o.axes_theta().empty()) {
    const char* sep = ", axes_theta=[";
    for (const double t : o.axes_theta()) stream << std::exchange(sep, ", ") << number_text(t);
    stream << "]";
  }
  if (o.axes_shared_spectrum()) stream << ", axes_shared_spectrum=true";
  if (!o.pair_axes().empty()) stream << ", pair_axes=" << c10::ArrayRef<int64_t>(o.pair_axes());
  stream << ")";
}

ModuleBuffers RotaryEmbeddingImpl::module_buffers() {
  return {[this] { return RopeTables::Held{freqs, inv_freq}; }, [this](const RopeTableSet& t) { install(t); }};
}

// The shared shell (rotary/front_end.h): host checks, then op(freqs,
// inv_freq) with the tables right for this call.
template <typename Op>
auto RotaryEmbeddingImpl::run(
    const torch::Tensor& q,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids,
    c10::string_view layout,
    Op&& op) {
  const int64_t seq_axis = module_seq_axis(layout, "RotaryEmbedding");  // before the rows are checked
  if (q.dim() == 4) check_span(tables_.options(), q);  // other ranks: the op names the shape
  const int64_t seq_len = q.dim() == 4 ? q.size(seq_axis) : 0;
  return run_module_call(tables_, module_buffers(), seq_len, start_pos, offsets, position_ids, std::forward<Op>(op));
}

torch::Tensor RotaryEmbeddingImpl::forward(
    const torch::Tensor& x,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids,
    c10::string_view layout) {
  const auto& o = tables_.options();
  return run(x, start_pos, offsets, position_ids, layout, [&](const torch::Tensor& f, const OptTensor& inv) {
    return apply_rope(x, f, start_pos, o.interleaved(), offsets, position_ids, false, std::nullopt, inv, layout,
                      o.rotary_offset(), axes_for(position_ids));
  });
}

std::tuple<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    int64_t start_pos,
    const std::optional<torch::Tensor>& offsets,
    const std::optional<torch::Tensor>& position_ids,
    c10::string_view layout) {
  const auto& o = tables_.options();
  return run(q, start_pos, offsets, position_ids, layout, [&](const torch::Tensor& f, const OptTensor& inv) {
    return apply_rope_qk(q, k, f, start_pos, o.interleaved(), offsets, position_ids, false, std::nullopt, inv, layout,
                         o.rotary_offset(), axes_for(position_ids));
  });
}

// The fused op writes the rows; the cache only learns its new length.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward_with_cache(
    torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v, KVCache& cache, std::optional<int64_t> start_pos,
    c10::string_view layout) {
  return rotary::forward_with_cache(tables_, module_buffers(), q, k, v, *cache, start_pos, layout);
}

// Only the device changes: the table stays complex64 and inv_freq float64
// whatever dtype the rest of the model is cast to.
void RotaryEmbeddingImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool non_blocking) {
  to(device, non_blocking);
}

void RotaryEmbeddingImpl::to(torch::Dtype /*dtype*/, bool /*non_blocking*/) {}

void RotaryEmbeddingImpl::to(torch::Device device, bool non_blocking) {
  refuse_meta_move("rotary::RotaryEmbedding", device);
  torch::nn::Module::to(device, non_blocking);
}

}  // namespace rotary
