#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

namespace rotary {

namespace {

RopeScaling effective_scaling_of(const RotaryEmbeddingOptions& options) {
  RopeScaling s = options.scaling();
  if (s.type() == "dynamic" && !s.max_position_embeddings()) s.max_position_embeddings(options.max_seq_len());
  return s;
}

std::string describe(const RotaryEmbeddingOptions& o) {
  std::ostringstream os;
  os << "dim=" << o.dim() << ", max_seq_len=" << o.max_seq_len() << ", theta=" << o.theta()
     << ", rope_type=" << o.scaling().type() << ", angle_dtype=" << angle_dtype_name(o.angle_dtype());
  return os.str();
}

void check_options(const RotaryEmbeddingOptions& options) {
  TORCH_CHECK_VALUE(
      options.dim() > 0 && options.dim() % 2 == 0, "RotaryEmbedding: dim must be even and > 0, got ",
      options.dim());
  TORCH_CHECK_VALUE(
      options.max_seq_len() > 0, "RotaryEmbedding: max_seq_len must be > 0, got ", options.max_seq_len());
  TORCH_CHECK_VALUE(
      std::isfinite(options.theta()) && options.theta() > 0.0,
      "RotaryEmbedding: theta must be finite and > 0, got ", options.theta());
  check_angle_dtype(options.angle_dtype(), "RotaryEmbedding");
}

// Rows a module with these options holds in the state reached with seq_len.
int64_t rows_for(const RotaryEmbeddingOptions& o, const RopeScaling& s, int64_t seq_len) {
  if (s.type() == "dynamic" && seq_len > *s.max_position_embeddings()) return std::max(o.max_seq_len(), seq_len);
  return o.max_seq_len();
}

}  // namespace

int64_t check_saved_tables(
    const RotaryEmbeddingOptions& options,
    const std::optional<at::Tensor>& freqs,
    const std::optional<at::Tensor>& inv_freq,
    const std::string& who) {
  check_options(options);
  const bool has_freqs = freqs && freqs->defined();
  const bool has_inv = inv_freq && inv_freq->defined();
  const RopeScaling s = effective_scaling_of(options);
  validate(s, options.dim());
  const int64_t pairs = options.dim() / 2;
  const std::string desc = describe(options);
  const std::string hint =
      "; it was saved from a module with other options: build this one with those (theta, max_seq_len, "
      "scaling, angle_dtype), or leave 'freqs' and 'inv_freq' out of what you load";

  at::Tensor f_saved, inv_saved;
  int64_t rows = 0;
  if (has_freqs) {
    TORCH_CHECK_VALUE(
        freqs->scalar_type() == at::kComplexFloat && freqs->dim() == 2 && freqs->size(1) == pairs, who,
        ": the saved 'freqs' must be complex64 [rows, dim / 2] = [*, ", pairs, "], got ", freqs->scalar_type(), " ",
        freqs->sizes(), " (module: ", desc, ")");
    rows = freqs->size(0);
    const bool grows = s.type() == "dynamic";
    TORCH_CHECK_VALUE(
        grows ? rows >= options.max_seq_len() : rows == options.max_seq_len(), who, ": the saved 'freqs' has ",
        rows, " rows but this module's max_seq_len is ", options.max_seq_len(), " (", desc, ")", hint);
    f_saved = freqs->detach().to(at::kCPU).resolve_conj().contiguous();
  }
  if (has_inv) {
    TORCH_CHECK_VALUE(
        inv_freq->scalar_type() == at::kDouble && inv_freq->dim() == 1 && inv_freq->size(0) == pairs, who,
        ": the saved 'inv_freq' must be float64 [dim / 2] = [", pairs, "], got ", inv_freq->scalar_type(), " ",
        inv_freq->sizes(), " (module: ", desc, ")");
    inv_saved = inv_freq->detach().to(at::kCPU).contiguous();
  }
  if (!has_freqs && !has_inv) return 0;

  // The states the saved tables may be in: the initial one, longrope's long
  // factors, a grown dynamic base (its length recovered from inv_freq[1] or
  // from the table's row count).
  std::vector<int64_t> states = {0};
  if (s.type() == "longrope") states.push_back(*s.original_max_position_embeddings() + 1);
  if (s.type() == "dynamic") {
    const int64_t m = *s.max_position_embeddings();
    if (has_freqs && rows > options.max_seq_len()) states.push_back(rows);
    const double* inv = has_inv ? inv_saved.const_data_ptr<double>() : nullptr;
    if (inv && pairs >= 2 && std::isfinite(inv[1]) && inv[1] > 0.0) {
      // inv[1] = base^(-2/d), base = theta * (factor * L / m - (factor - 1))^(d / (d - 2)).
      const double d = static_cast<double>(options.dim());
      const double base = std::pow(inv[1], -d / 2.0);
      const double factor = *s.factor();
      const double ratio = std::pow(base / options.theta(), (d - 2.0) / d);
      const double len = static_cast<double>(m) * (ratio + factor - 1.0) / factor;
      if (std::isfinite(len) && len > static_cast<double>(m) && len < 9.0e15) {
        const auto l = static_cast<int64_t>(std::llround(len));
        for (int64_t c = l - 1; c <= l + 1; ++c) {
          if (c > m) states.push_back(c);
        }
      }
    }
  }

  std::string first_mismatch;
  for (const int64_t seq_len : states) {
    const RopeFrequencies f = compute_frequencies(options.dim(), options.theta(), s, seq_len);
    std::ostringstream why;
    bool ok = true;
    if (has_inv) {
      const double* a = inv_saved.const_data_ptr<double>();
      for (int64_t j = 0; j < pairs && ok; ++j) {
        const double b = f.inv_freq[j];
        if (!(std::abs(a[j] - b) <= 1e-12 * std::abs(b))) {
          ok = false;
          why.precision(17);
          why << "'inv_freq'[" << j << "] = " << a[j] << " but these options give " << b;
        }
      }
    }
    if (ok && has_freqs) {
      if (rows_for(options, s, seq_len) != rows) {
        ok = false;
        why << "'freqs' has " << rows << " rows, this state of the rule has " << rows_for(options, s, seq_len);
      } else {
        const at::Tensor expected = freqs_table(f, rows, options.angle_dtype());
        const at::Tensor diff = at::nan_to_num((f_saved - expected).abs(), std::numeric_limits<double>::infinity());
        const double tol = std::ldexp(1.0, -22) * std::max(1.0, std::abs(f.attention_scaling));
        if (diff.numel() > 0) {
          const int64_t worst = diff.flatten().argmax().item<int64_t>();
          const double err = diff.flatten()[worst].item<double>();
          if (!(err <= tol)) {
            ok = false;
            const auto got = f_saved.flatten()[worst].item<c10::complex<float>>();
            const auto want = expected.flatten()[worst].item<c10::complex<float>>();
            why << "'freqs' row " << worst / pairs << ", pair " << worst % pairs << " differs by " << err
                << " from what these options build (saved " << got.real() << (got.imag() < 0 ? "" : "+")
                << got.imag() << "i, expected " << want.real() << (want.imag() < 0 ? "" : "+") << want.imag()
                << "i)";
          }
        }
      }
    }
    if (ok) return seq_len;
    if (first_mismatch.empty()) first_mismatch = why.str();
  }
  TORCH_CHECK_VALUE(false, who, ": the saved tables do not match this module (", desc, "): ", first_mismatch, hint);
  return 0;
}

RotaryEmbeddingImpl::RotaryEmbeddingImpl(const RotaryEmbeddingOptions& options_) : options(options_) {
  reset();
}

RopeScaling RotaryEmbeddingImpl::effective_scaling() const {
  return effective_scaling_of(options);
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
  auto table = freqs_table(f, rows, options.angle_dtype());
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
  check_options(options);
  build_tables();
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
  std::lock_guard<std::recursive_mutex> lock(host_driven_lock_.mutex);
  const int64_t seq_len = check_saved_tables(options, saved_freqs, saved_inv_freq, who);
  const RopeScaling s = effective_scaling();
  dynamic_len_ = s.type() == "dynamic" && seq_len > *s.max_position_embeddings() ? seq_len : 0;
  long_factors_ = s.type() == "longrope" && seq_len > *s.original_max_position_embeddings();
  build_tables();
}

std::optional<torch::Tensor> RotaryEmbeddingImpl::past_table_inv_freq() const {
  if (options.angle_dtype() == torch::kFloat32) return std::nullopt;
  return inv_freq;
}

void RotaryEmbeddingImpl::update_for_reach(int64_t reach) {
  std::lock_guard<std::recursive_mutex> lock(host_driven_lock_.mutex);
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
  if (options.angle_dtype() != torch::kFloat64) stream << ", angle_dtype=" << angle_dtype_name(options.angle_dtype());
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
  if (options.angle_dtype() == torch::kFloat32 && !positions && seq_len > 0) {
    TORCH_CHECK_INDEX(
        seq_len <= freqs.size(0) - start_pos, "RotaryEmbedding(angle_dtype=float32): start_pos + seq_len = ",
        start_pos, " + ", seq_len, " = ", start_pos + seq_len, " exceeds max_seq_len ", freqs.size(0),
        "; float32-angle tables are not extended on the fly (that path is float64): build the module with a "
        "larger max_seq_len");
  }
}

torch::Tensor RotaryEmbeddingImpl::forward(
    const torch::Tensor& x,
    int64_t start_pos,
    const std::optional<torch::Tensor>& positions) {
  std::unique_lock<std::recursive_mutex> lock(host_driven_lock_.mutex, std::defer_lock);
  if (depends_on_seq_len(options.scaling())) lock.lock();  // prepare() may rebuild the tables
  prepare(x, start_pos, positions);
  return apply_rope(
      x, freqs, start_pos, options.interleaved(), positions, false, std::nullopt, past_table_inv_freq());
}

std::tuple<torch::Tensor, torch::Tensor> RotaryEmbeddingImpl::forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    int64_t start_pos,
    const std::optional<torch::Tensor>& positions) {
  std::unique_lock<std::recursive_mutex> lock(host_driven_lock_.mutex, std::defer_lock);
  if (depends_on_seq_len(options.scaling())) lock.lock();  // prepare() may rebuild the tables
  prepare(q, start_pos, positions);
  return apply_rope_qk(
      q, k, freqs, start_pos, options.interleaved(), positions, false, std::nullopt, past_table_inv_freq());
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
