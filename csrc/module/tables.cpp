#include <rotary/axes.h>
#include <rotary/bounds.h>
#include <rotary/freqs.h>
#include <rotary/tables.h>

#include "checks/checks.h"
#include "module/replay_notes.h"
#include "module/tables_detail.h"
#include "checks/checks_positions.h"
#include "freqs/host_tensor.h"
#include "op/func_node.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>


#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

namespace rotary {

namespace detail {

RotaryEmbeddingOptions with_defaults(RotaryEmbeddingOptions o) {
  RopeScaling s = o.scaling();
  if (rope_type_of(s) == RopeType::Dynamic && !s.max_position_embeddings()) {
    s.max_position_embeddings(o.max_seq_len());
  }
  return o.scaling(s);
}

std::string describe_options(const RotaryEmbeddingOptions& o) {
  std::ostringstream os;
  os << "dim=" << o.dim() << ", max_seq_len=" << o.max_seq_len() << ", theta=" << number_text(o.theta())
     << ", rope_type=" << o.scaling().type() << ", angle_dtype=" << angle_dtype_name(o.angle_dtype());
  return os.str();
}

RopeFrequencies frequencies_of(const RotaryEmbeddingOptions& o, const RopeScaling& s, int64_t seq_len) {
  if (o.axes_dim().empty()) return compute_frequencies(o.dim(), o.theta(), s, seq_len);
  const std::vector<double> thetas = o.axes_theta().empty() ? std::vector<double>{o.theta()} : o.axes_theta();
  return axial_rope(o.axes_dim(), thetas, o.axes_shared_spectrum(), "RotaryEmbedding").freqs;
}

void check_options(const RotaryEmbeddingOptions& options) {
  TORCH_CHECK_VALUE(
      options.dim() > 0 && options.dim() % 2 == 0, "RotaryEmbedding: dim must be even and > 0, got ",
      options.dim());
  TORCH_CHECK_VALUE(options.dim() <= kMaxRotaryDim, "RotaryEmbedding: dim must be <= 2^20 (the rotated width of a ",
                    "head), got ", options.dim());
  TORCH_CHECK_VALUE(
      options.max_seq_len() > 0, "RotaryEmbedding: max_seq_len must be > 0, got ", options.max_seq_len());
  TORCH_CHECK_VALUE(
      std::isfinite(options.theta()) && options.theta() > 0.0,
      "RotaryEmbedding: theta must be finite and > 0, got ", options.theta());
  check_angle_dtype(options.angle_dtype(), "RotaryEmbedding");
  TORCH_CHECK_VALUE(
      options.rotary_offset() >= 0, "RotaryEmbedding: rotary_offset must be >= 0, got ", options.rotary_offset());
  // A flag of a rule that is not chosen would be dropped without a word.
  const bool mrope = !options.mrope_section().empty(), axial = !options.axes_dim().empty();
  TORCH_CHECK_VALUE(
      int(mrope) + int(axial) + int(!options.pair_axes().empty()) <= 1, "RotaryEmbedding: mrope_section (M-RoPE), ",
      "axes_dim (axial RoPE) and pair_axes (an explicit map) are three N-D rules; pass one of them");
  TORCH_CHECK_VALUE(
      mrope || !options.mrope_interleaved(), "RotaryEmbedding: mrope_interleaved=True needs mrope_section (the ",
      "sections it lays out)");
  TORCH_CHECK_VALUE(
      axial || (options.axes_theta().empty() && !options.axes_shared_spectrum()), "RotaryEmbedding: ",
      options.axes_theta().empty() ? "axes_shared_spectrum=True" : "axes_theta", " needs axes_dim (the dims per axis)");
  pair_axes_of(options);  // the sections or axes, entry by entry (rotary/axes.h)
  if (axial) {
    const auto& d = options.axes_dim();
    const int64_t sum = std::accumulate(d.begin(), d.end(), int64_t{0});
    TORCH_CHECK_VALUE(
        sum == options.dim(), "RotaryEmbedding: axes_dim ", c10::ArrayRef<int64_t>(d), " must sum to dim = ",
        options.dim(), ", got ", sum);
    TORCH_CHECK_VALUE(
        options.scaling().type() == "default", "RotaryEmbedding: axes_dim (axial RoPE) sets the frequencies; it ",
        "takes no scaling rule (got '", options.scaling().type(), "')");
  }
}

// A grown dynamic base changes every row, so with float64 angles the table
// keeps row 0 alone (the op reads the attention scaling there): every other
// position is computed on the fly, and a decode step that grows the base
// costs the frequencies, not a table of its reach.
int64_t rows_for(const RotaryEmbeddingOptions& o, int64_t seq_len) {
  const RopeScaling& s = o.scaling();
  if (rope_type_of(s) == RopeType::Dynamic && seq_len > *s.max_position_embeddings()) {
    if (o.angle_dtype() == at::kDouble) return 1;
    return std::max(o.max_seq_len(), std::min(seq_len, RopeTables::kMaxGrownRows));
  }
  return o.max_seq_len();
}

double table_tolerance(double attention_scaling) {
  return std::ldexp(1.0, -22) * std::max(1.0, std::abs(attention_scaling));
}

}  // namespace detail

using detail::check_options;
using detail::describe_options;
using detail::frequencies_of;
using detail::rows_for;
using detail::with_defaults;

RopeTables::RopeTables(RotaryEmbeddingOptions options, int64_t state) : options_(std::move(options)) {
  check_options(options_);
  options_ = with_defaults(options_);
  validate(options_.scaling(), options_.dim());
  host_driven_ = depends_on_seq_len(options_.scaling());
  state_ = host_driven_ ? std::max<int64_t>(state, 0) : 0;
  attention_scaling_ = frequencies_of(options_, options_.scaling(), state_).attention_scaling;
}

RopeTables::RopeTables(const RopeTables& other)
    : options_(other.options_),
      host_driven_(other.host_driven_),
      state_(other.state_),
      attention_scaling_(other.attention_scaling_) {}

RopeTables& RopeTables::operator=(const RopeTables& other) {
  if (this != &other) {
    options_ = other.options_;
    host_driven_ = other.host_driven_;
    state_ = other.state_;
    attention_scaling_ = other.attention_scaling_;
    built_.clear();  // the other's tables are not this one's
    notes_.reset();  // nor its calls' states
  }
  return *this;
}

void RopeTables::follow(const Held& held) {
  const auto& [freqs, inv_freq] = held;
  // unsafe_storage: a functional or fake tensor under tracing has one of its own (unknown here).
  const c10::StorageImpl* impl = storage_of(freqs);
  if (impl == nullptr) return;
  const c10::StorageImpl* inv_impl = storage_of(inv_freq);
  prune_built();
  const auto versions = versions_of(held);
  // Fake, functional and transform-wrapped tensors (a trace, torch.func) hold no values to read,
  // and under a transform a read would be wrapped: the current state holds there.
  const auto readable_table = [](const at::Tensor& t) {
    return t.defined() && !t.is_meta() && t.has_storage() &&
        !t.key_set().has_any(c10::DispatchKeySet(
            {c10::DispatchKey::Python, c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchGradWrapper,
             c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::BatchedNestedTensor}));
  };
  const auto can_read = [&] {
    return !detail::under_func_transforms() && readable_table(inv_freq) && readable_table(freqs);
  };
  // Both storages: the module's freqs with another inv_freq (or the other way round) is another pair.
  const auto known =
      std::find_if(built_.begin(), built_.end(), [&](const Built& b) { return b.is(impl, inv_impl); });
  bool written = false;
  int64_t own = state_;  // committed once the read succeeded: a read that throws changes nothing
  double own_scaling = attention_scaling_;
  if (known != built_.end()) {
    // No counter (inference tensors): no write can show, and a read per call would cost a device sync.
    // A pair noted unread (under a transform) is read once it can be.
    if ((!versions || known->versions == versions) && (known->read || !can_read())) {
      state_ = known->state;
      attention_scaling_ = known->attention_scaling;
      servable_ = known->servable;
      return;
    }
    written = known->written || known->versions != versions;  // else first met under a transform
    if (written) {  // its own state, not the last call's (functional_call's tables may have switched it)
      own = known->state;
      own_scaling = known->attention_scaling;
    }
  }
  const bool readable = can_read();
  bool serves = false;
  if (readable) {  // its values say its state (its own is tried first, bit for bit: a DDP step's)
    const int64_t state = holds_state_inv(inv_freq, own)
        ? own
        : saved_state(std::nullopt, inv_freq, "RotaryEmbedding: the tables it holds", own);
    // freqs must be the table of the state inv_freq holds: a pair it never met made of two states'
    // pieces (functional_call given one table of another state) has no one rotation and is refused.
    const std::string mismatch = freqs_mismatch(freqs, state);
    TORCH_CHECK_VALUE(
        written || mismatch.empty(), "RotaryEmbedding(", describe(), "): the tables it holds are not one pair: ",
        "'inv_freq' is that of ", state == 0 ? "the rule's initial state" : "the state at seq_len " +
        std::to_string(state), ", but ", mismatch, "; pass 'freqs' and 'inv_freq' of one state (functional_call: ",
        "both, from one module's buffers)");
    // Tables it never met (a move, a copy, functional_call's) bring their state. A pair written over
    // its own (rank 0's, by DDP) does not: the module keeps its own (a dynamic rule's history) and
    // rebuilds at the next call when they hold another, or a freqs not of its state.
    if (!written && state != own) {
      own = state;
      own_scaling = frequencies_of(options_, options_.scaling(), state).attention_scaling;
    }
    serves = state == own && mismatch.empty();
  } else {
    // Written with values it cannot read here: its own state's are rebuilt. Else the current state
    // holds (a trace's fake tables may have symbolic sizes: not compared).
    serves = !written && servable_;
  }
  if (known != built_.end()) built_.erase(known);
  state_ = own;
  attention_scaling_ = own_scaling;
  servable_ = serves;
  built_.push_back({*weak_storage(freqs), weak_storage(inv_freq), state_, attention_scaling_, versions, servable_,
                    readable, written});
}

void RopeTables::own(const Held& held) {
  const c10::StorageImpl* impl = storage_of(held.first);
  if (!host_driven_ || impl == nullptr) return;  // a trace's: met as follow() meets it
  const c10::StorageImpl* inv_impl = storage_of(held.second);
  std::lock_guard<std::mutex> lock(lock_.mutex);
  prune_built();
  built_.erase(std::remove_if(built_.begin(), built_.end(), [&](const Built& b) { return b.is(impl, inv_impl); }),
               built_.end());
  built_.push_back({*weak_storage(held.first), weak_storage(held.second), state_, attention_scaling_, versions_of(held),
                    servable_, true, false});
}

const c10::StorageImpl* RopeTables::storage_of(const at::Tensor& t) {
  return t.defined() ? t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() : nullptr;
}

std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> RopeTables::weak_storage(const at::Tensor& t) {
  if (storage_of(t) == nullptr) return std::nullopt;
  return t.unsafeGetTensorImpl()->unsafe_storage().getWeakStorageImpl();
}

std::string RopeTables::freqs_mismatch(const at::Tensor& freqs, int64_t state) const {
  const RopeFrequencies f = frequencies_of(options_, options_.scaling(), state);
  const int64_t rows = rows_for(options_, state), pairs = static_cast<int64_t>(f.inv_freq.size());
  std::ostringstream why;
  if (freqs.scalar_type() != at::kComplexFloat || freqs.dim() != 2 || freqs.size(0) != rows ||
      freqs.size(1) != pairs) {
    const bool complex64 = freqs.scalar_type() == at::kComplexFloat;
    why << "'freqs' is " << (complex64 ? "complex64" : c10::toString(freqs.scalar_type())) << " " << freqs.sizes()
        << " where that state's is complex64 ["
        << rows << ", " << pairs << "]";
    return why.str();
  }
  std::vector<int64_t> at_rows = {0, std::min<int64_t>(1, rows - 1), rows - 1};
  at_rows.erase(std::unique(at_rows.begin(), at_rows.end()), at_rows.end());
  const at::Tensor positions = at::tensor(at_rows, at::kLong);
  const at::Tensor got =
      freqs.detach().index_select(0, positions.to(freqs.device())).to(at::kCPU).resolve_conj().resolve_neg();
  const at::Tensor diff = at::nan_to_num((got - freqs_at(f, positions, options_.angle_dtype())).abs(),
                                         std::numeric_limits<double>::infinity());
  const double tol = detail::table_tolerance(f.attention_scaling);  // a load's
  const int64_t worst = diff.flatten().argmax().item<int64_t>();
  const double err = diff.flatten()[worst].item<double>();
  if (err <= tol) return {};
  why << "'freqs' row " << at_rows[worst / pairs] << ", pair " << worst % pairs << " differs from that state's by "
      << err;
  return why.str();
}

bool RopeTables::holds_state_inv(const at::Tensor& inv_freq, int64_t state) const {
  const std::vector<double> want = frequencies_of(options_, options_.scaling(), state).inv_freq;
  if (inv_freq.scalar_type() != at::kDouble || inv_freq.dim() != 1 ||
      inv_freq.size(0) != static_cast<int64_t>(want.size())) {
    return false;
  }
  const at::Tensor got = inv_freq.detach().to(at::kCPU).resolve_neg().contiguous();
  return std::equal(want.begin(), want.end(), got.const_data_ptr<double>());
}

RopeTables::Versions RopeTables::versions_of(const Held& held) noexcept {
  const auto& f = held.first.unsafeGetTensorImpl()->version_counter();
  const auto& inv = held.second.defined() ? held.second.unsafeGetTensorImpl()->version_counter() : f;
  if (!f.enabled() || !inv.enabled()) return std::nullopt;
  return std::make_pair(f.current_version(), inv.current_version());
}

void RopeTables::prune_built() {
  built_.erase(std::remove_if(built_.begin(), built_.end(),
                              [](const Built& b) { return b.freqs.expired() || (b.inv_freq && b.inv_freq->expired()); }),
               built_.end());
}

std::string RopeTables::describe() const {
  return describe_options(options_);
}

RopeTableSet RopeTables::build(int64_t state, c10::Device device) const {
  // Tables become module buffers: built under inference mode they would be
  // inference tensors, and every later call with autograd would fail.
  c10::InferenceMode normal_tensors(/*enabled=*/false);
  RopeTableSet out;
  try {
    const RopeFrequencies f = frequencies_of(options_, options_.scaling(), state);
    const int64_t rows = rows_for(options_, state);
    const auto pairs = std::to_string(f.inv_freq.size());
    // Grown past max_seq_len for this call's reach: max_seq_len is not the way out.
    out.freqs = rows <= options_.max_seq_len()
                    ? freqs_table(f, rows, options_.angle_dtype())
                    : detail::freqs_table_worded(
                          f, rows, options_.angle_dtype(),
                          "the dynamic rule's float32-angle table, grown for this call's reach to " +
                              std::to_string(rows) + " rows (at most 2^20) x dim // 2 = " + pairs + " pairs,",
                          "pass angle_dtype=float64 (its grown positions are then computed on the fly), or "
                          "reach fewer positions");
    out.inv_freq = inv_freq_tensor(f);
    out.attention_scaling = f.attention_scaling;
  } catch (const c10::ValueError& e) {
    // Name the options: the field at fault may be theta or angle_dtype.
    TORCH_CHECK_VALUE(false, "RotaryEmbedding(", describe(), "): ", e.what_without_backtrace());
  }
  out.state = state;
  if (device != out.freqs.device()) {
    out.freqs = out.freqs.to(device);
    out.inv_freq = out.inv_freq.to(device);
  }
  return out;
}

int64_t RopeTables::state_for_reach(int64_t reach) const {
  const RopeScaling& s = options_.scaling();
  switch (rope_type_of(s)) {
    case RopeType::Dynamic: {
      const int64_t original = *s.max_position_embeddings();
      const int64_t cached = state_ > 0 ? state_ : original;
      if (reach > cached) return reach;                             // grow
      if (reach < original && cached > original) return 0;          // back to the original frequencies
      return state_;
    }
    case RopeType::LongRope: {
      const int64_t original = *s.original_max_position_embeddings();
      return reach > original ? original + 1 : 0;
    }
    default:
      return state_;
  }
}

int64_t RopeTables::reach_of(
    int64_t seq_len,
    int64_t start_pos,
    const std::optional<at::Tensor>& offsets,
    const std::optional<at::Tensor>& position_ids) {
  if (seq_len <= 0) return 0;
  const bool ids = position_ids && position_ids->defined();
  const std::optional<at::Tensor>& given = ids ? position_ids : offsets;
  if (!given || !given->defined()) return start_pos + seq_len;
  const char* name = ids ? "position_ids" : "offsets";
  // Before max(): the op's words, not max's (sparse, nested) or item's (meta).
  detail::check_dense("apply_rope", name, *given);
  TORCH_CHECK_VALUE(!given->is_meta(), "RotaryEmbedding: a host-driven rule (dynamic, longrope) sizes its table by ",
                    "the call's largest position, read on the host; ", name,
                    " on the meta device hold no values: pass them on q's device");
  if (given->numel() == 0) return start_pos + seq_len;
  detail::check_integer_dtype("apply_rope", name, *given);
  // Under vmap each sample's positions are its own: no one largest to size one table by.
  const int64_t top = detail::item_or_refuse<int64_t>(
      detail::widen_positions("RotaryEmbedding", name, *given).max(), "RotaryEmbedding: a host-driven rule ",
      "(dynamic, longrope) sizes its table by the call's largest position, read on the host; under ",
      "torch.func.vmap per-sample ", name, " have no one largest: pass ", name, " shared by every sample (in_dims=",
      "None), or use a rule that is not host-driven");
  // Out of range: the op refuses these positions; nothing is rebuilt for them.
  if (!bounds::position_in_range(top)) return 0;
  return ids ? start_pos + top + 1 : start_pos + top + seq_len;
}

void RopeTables::check_start_pos(int64_t start_pos) {
  detail::check_start_pos("RotaryEmbedding", start_pos);
}

void RopeTables::check_reach(int64_t reach) const {
  TORCH_CHECK_VALUE(reach >= 0 && reach <= kMaxPosition, "RotaryEmbedding(", describe(),
                    ").update_for_reach: reach (one past the largest position of a call) must be in [0, 2^60], got ",
                    reach);
}

void RopeTables::check_rows(int64_t seq_len, int64_t start_pos, bool has_positions, int64_t rows) const {
  if (!extends_past_table() && !has_positions && seq_len > 0) {
    const bool grown = rows > options_.max_seq_len();  // a dynamic table at kMaxGrownRows
    TORCH_CHECK_INDEX(
        seq_len <= rows - start_pos, "RotaryEmbedding(angle_dtype=float32): start_pos + seq_len = ", start_pos,
        " + ", seq_len, " = ", start_pos + seq_len, grown ? " exceeds the rows a dynamic table grows to, " : "",
        grown ? "" : " exceeds max_seq_len ", rows,
        "; float32-angle tables are not extended on the fly (that path is float64): build the module with a "
        "larger max_seq_len", grown ? " or angle_dtype=float64" : "");
  }
}

int64_t RopeTables::saved_state(
    const std::optional<at::Tensor>& freqs,
    const std::optional<at::Tensor>& inv_freq,
    const std::string& who,
    std::optional<int64_t> tried) const {
  const int64_t seq_len = check_saved_tables(options_, freqs, inv_freq, who, tried);
  return host_driven_ ? seq_len : 0;
}

}  // namespace rotary
