// prepare_rope: what a validated call writes and where (outputs, aliasing
// of in-place targets, positions checked by value on the host) and the
// framework-free launch description the kernels read.
#include "checks.h"

#include "checks_positions.h"
#include "overlap.h"
#include <rotary/bounds.h>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace rotary {
namespace detail {

at::Tensor make_output(const at::Tensor& x, std::optional<at::ScalarType> dtype) {
  const auto options = x.options().dtype(dtype.value_or(x.scalar_type()));
  // x's own strides where they are dense: empty_like gives those on a real
  // device but re-derives them on Meta, where size-1 and empty dims then
  // differ from what the kernel returns.
  if (x.is_non_overlapping_and_dense()) return at::empty_strided_symint(x.sym_sizes(), x.sym_strides(), options);
  return at::empty_like(x, options);
}

namespace {

void fill_head_tensor(kernel::HeadTensor& t, const at::Tensor& in, const at::Tensor& out) {
  t.in = in.data_ptr();
  t.out = out.data_ptr();
  t.heads = in.size(1);
  for (int d = 0; d < 4; ++d) {
    t.in_stride[d] = in.stride(d);
    t.out_stride[d] = out.stride(d);
  }
}

void check_cu_seqlens_values(const char* op, const at::Tensor& cu, int64_t total_tokens) {
  const auto values = cu.to(at::kLong).contiguous();
  const int64_t* v = values.data_ptr<int64_t>();
  const int64_t n = values.numel();
  bool ok = v[0] == 0 && v[n - 1] == total_tokens;
  for (int64_t i = 1; ok && i < n; ++i) ok = v[i] >= v[i - 1];
  if (ok) return;
  std::string shown = "[";
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) shown += (i ? ", " : "") + std::to_string(v[i]);
  shown += n > 16 ? ", ...]" : "]";
  TORCH_CHECK_VALUE(
      false, op, ": cu_seqlens must start at 0, never decrease, and end at total_tokens = ", total_tokens,
      "; got ", shown);
}

}  // namespace

void check_distinct(const char* op, const char* name, const at::Tensor& x) {
  // torch refuses the version bump of an inference tensor only after the
  // kernel ran: refused here, before anything is written.
  TORCH_CHECK_VALUE(!x.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
                    " is an inference tensor (made under torch.inference_mode()), which cannot be updated in place ",
                    "outside it; call under torch.inference_mode(), or pass a clone");
  const Overlap o = self_overlap(x);
  TORCH_CHECK_VALUE(
      o != Overlap::Yes, op, ": ", name,
      " has elements sharing memory (an expanded view?); an in-place write needs distinct elements");
  TORCH_CHECK_VALUE(
      o != Overlap::Unknown, op, ": could not prove that the elements of ", name,
      " are distinct in memory (its strides are too irregular to check exactly); rotate a clone in place, or use ",
      "the out-of-place op");
}

namespace {

// Meta, fake and functional tensors (tracing: compile, export, the vmap
// rule under them) have no addresses to compare; every one would read as 0.
// The call on real tensors, which the traced graph makes, is checked. A
// subclass over real memory (Tensor._make_subclass) has addresses.
bool has_addresses(const at::Tensor& t) {
  if (!t.has_storage() || t.key_set().has(c10::DispatchKey::Functionalize)) return false;
  try {
    const c10::Storage& st = t.storage();
    return st.device_type() != c10::DeviceType::Meta && st.data() != nullptr;
  } catch (const c10::Error&) {  // a wrapper subclass: no storage of its own to read
    return false;
  }
}

}  // namespace

void check_disjoint(
    const char* op, const char* written, const at::Tensor& w, const char* other, const at::Tensor& t,
    const char* why) {
  if (!has_addresses(w) || !has_addresses(t)) return;
  const Overlap o = mutual_overlap(w, t);
  TORCH_CHECK_VALUE(o != Overlap::Yes, op, ": ", written, " and ", other, " overlap in memory; in place, ", why);
  TORCH_CHECK_VALUE(
      o != Overlap::Unknown, op, ": could not prove that ", written, " and ", other,
      " do not overlap in memory (their strides are too irregular to check exactly); pass a clone of one of them");
}

namespace {

// Exact for any strides (overlap.h): packed qkv slices are accepted, any
// shared element between the written tensors or with a read-only input is not.
void check_in_place_targets(const char* op, const at::Tensor& q, const at::Tensor* k, const RopeCall& call) {
  const char* q_name = k ? "q" : "x";
  check_distinct(op, q_name, q);
  if (k) {
    check_distinct(op, "k", *k);
    check_disjoint(op, "q", q, "k", *k, "each element must belong to one of them");
  }
  const std::pair<const char*, const at::Tensor*> read[] = {
      {"freqs", call.freqs}, {call.positions.name(), call.positions.given}, {"cu_seqlens", call.cu_seqlens},
      {"inv_freq", call.inv_freq}};
  for (const at::Tensor* w : {&q, k}) {
    if (!w) continue;
    for (const auto& [name, t] : read) {
      if (t) check_disjoint(op, w == &q ? q_name : "k", *w, name, *t);
    }
  }
}

void fill_positions(kernel::RopeParams& p, at::Tensor& wide, const char* op, const Positions& pos) {
  p.start_pos = pos.start_pos;
  if (pos.kind == Positions::Kind::kLocal) return;
  wide = widen_positions(op, pos.name(), *pos.given);
  p.positions = wide.data_ptr();
  p.positions_int32 = wide.scalar_type() == at::kInt;
  p.positions_are_offsets = pos.kind == Positions::Kind::kOffsets;
  if (pos.kind == Positions::Kind::kAxes) {
    fill_axes(p, wide, pos.pair_axes);
  } else if (pos.kind == Positions::Kind::kIds && wide.dim() == 1) {  // [seq] or packed [total_tokens]
    if (wide.size(0) > 1) p.pos_stride_s = wide.stride(0);
  } else {
    if (wide.dim() >= 1 && wide.size(0) > 1) p.pos_stride_b = wide.stride(0);
    if (wide.dim() == 2 && wide.size(1) > 1) p.pos_stride_s = wide.stride(1);
  }
}

// Positions known on the host are checked by value: a CPU positions tensor,
// or none at all (start_pos + local index).
void check_host_positions(const char* op, const kernel::RopeParams& p, const PreparedRope& r, const RopeCall& call) {
  const bool host_positions = p.positions == nullptr || r.positions.is_cpu();
  const bool host_seqlens = !call.cu_seqlens || call.cu_seqlens->is_cpu();
  if (!host_positions || !host_seqlens || p.batch * p.seq == 0) return;
  // Each axis's largest frequency, when inv_freq is on the host (rows past
  // the table turn by it); 1-D positions read every pair on axis 0.
  double axis_max[kernel::kMaxAxes] = {};
  if (p.inv_freq != nullptr && call.inv_freq && call.inv_freq->is_cpu()) {
    for (int64_t j = 0; j < p.rotary_dim / 2; ++j) {
      const double f = p.inv_freq[j * p.inv_freq_stride];
      // std::max would drop a NaN: rows past the table would be NaN.
      TORCH_CHECK_VALUE(std::isfinite(f), op, ": inv_freq[", j, "] must be finite, got ", f);
      double& m = axis_max[p.pair_axis[j]];
      m = std::max(m, std::abs(f));
    }
  }
  const double max_inv_freq = axis_max[0];
  if (p.positions == nullptr && !call.cu_seqlens) {
    TORCH_CHECK_INDEX(
        p.seq <= kMaxPosition - p.start_pos, op, ": start_pos + seq_len = ", p.start_pos, " + ", p.seq,
        " reaches past the last position, 2^60 - 1");
    TORCH_CHECK_INDEX(
        p.inv_freq != nullptr || p.seq <= p.freqs_len - p.start_pos, op, ": start_pos + seq_len = ", p.start_pos,
        " + ", p.seq, " = ", p.start_pos + p.seq, " exceeds the freqs table length (max_seq_len) ", p.freqs_len,
        "; build the table with max_seq_len > ", p.start_pos + p.seq - 1, " (the ops also take inv_freq)");
    const int64_t last = p.start_pos + p.seq - 1;
    if (!keeps_phase(p, last, max_inv_freq)) far_angle_error(op, last, max_inv_freq, "the last token");
  } else if (p.num_axes > 0) {
    check_axes_in_table(op, p, axis_max);
  } else {
    check_positions_in_table(op, p, max_inv_freq);
  }
}

}  // namespace

void check_cuda_extents(const char* op, int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t v_dim) {
  TORCH_CHECK_VALUE(q_heads + k_heads <= kMaxCudaExtent, op, ": q heads + k heads = ", q_heads, " + ",
                    k_heads, " is more than the CUDA kernels take in one call, 2^30 (they count a row's heads in 32 ",
                    "bits); split the call over heads");
  TORCH_CHECK_VALUE(head_dim <= kMaxCudaExtent && v_dim <= kMaxCudaExtent, op, ": ",
                    head_dim > kMaxCudaExtent ? "head_dim = " : "v's head_dim = ",
                    head_dim > kMaxCudaExtent ? head_dim : v_dim,
                    " is more than the CUDA kernels take, 2^30 elements a head (they count them in 32 bits)");
}

PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
    bool in_place) {
  return prepare_rope(op, q, k, check_rope_inputs(op, q, k, freqs, args), in_place);
}

PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const RopeCall& call, bool in_place,
    const at::Tensor* out_q) {
  const at::Tensor& qv = call.q;
  const at::Tensor& kv = call.k;
  if (in_place) check_in_place_targets(op, qv, k ? &kv : nullptr, call);
  if (qv.is_cuda()) check_cuda_extents(op, qv.size(1), k ? kv.size(1) : 0, qv.size(3));  // before any output exists

  PreparedRope r;
  r.out_q = in_place ? q : out_q ? *out_q : make_output(q);
  if (k) r.out_k = in_place ? *k : make_output(*k);
  auto& p = r.params;
  fill_head_tensor(p.q, qv, in_place ? qv : canonical_view(r.out_q, call.layout, call.cu_seqlens != nullptr));
  if (k) fill_head_tensor(p.k, kv, in_place ? kv : canonical_view(r.out_k, call.layout, call.cu_seqlens != nullptr));
  p.batch = qv.size(0);
  p.seq = qv.size(2);
  p.head_dim = qv.size(3);
  p.rotary_dim = 2 * call.freqs->size(1);
  p.rotary_offset = call.rotary_offset;
  p.in_place = in_place;
  const at::Tensor table = call.table();
  p.freqs = reinterpret_cast<const float*>(table.data_ptr());
  p.freqs_len = table.size(0);
  p.freqs_stride_pos = table.stride(0);
  p.freqs_stride_pair = table.stride(1);
  p.interleaved = call.interleaved;
  // A lazily conjugated table (freqs.conj()) holds e^{-i angle}: the same
  // memory read with the inverse rotation.
  p.inverse = table.is_conj() ? !call.inverse : call.inverse;
  if (call.inv_freq) {
    p.inv_freq = call.inv_freq->data_ptr<double>();
    p.inv_freq_stride = call.inv_freq->stride(0);
  }
  if (call.cu_seqlens) {
    const auto& cu = *call.cu_seqlens;
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_stride = cu.stride(0);
    p.cu_seqlens_int32 = cu.scalar_type() == at::kInt;
    p.num_seqs = cu.size(0) - 1;
    if (cu.is_cpu()) check_cu_seqlens_values(op, cu, p.seq);
    TORCH_CHECK_VALUE(p.num_seqs >= 1 || p.seq == 0, op, ": cu_seqlens has no sequence but there are ", p.seq, " tokens");
  }
  fill_positions(p, r.positions, op, call.positions);
  check_host_positions(op, p, r, call);
  return r;
}

}  // namespace detail
}  // namespace rotary
