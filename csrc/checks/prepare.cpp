// prepare_rope: what a validated call writes and where (outputs, aliasing
// of in-place targets, positions checked by value on the host) and the
// framework-free launch description the kernels read.
#include "checks.h"

#include "checks_positions.h"
#include "overlap.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace rotary {
namespace detail {

at::Tensor make_output(const at::Tensor& x) {
  return at::empty_like(x);
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
  const Overlap o = self_overlap(x);
  TORCH_CHECK_VALUE(
      o != Overlap::Yes, op, ": ", name,
      " has elements sharing memory (an expanded view?); an in-place rotation needs distinct elements");
  TORCH_CHECK_VALUE(
      o != Overlap::Unknown, op, ": could not prove that the elements of ", name,
      " are distinct in memory (its strides are too irregular to check exactly); rotate a clone in place, or use ",
      "the out-of-place op");
}

void check_disjoint(
    const char* op, const char* written, const at::Tensor& w, const char* other, const at::Tensor& t,
    const char* why) {
  const Overlap o = mutual_overlap(w, t);
  TORCH_CHECK_VALUE(o != Overlap::Yes, op, ": ", written, " and ", other, " overlap in memory; in place, ", why);
  TORCH_CHECK_VALUE(
      o != Overlap::Unknown, op, ": could not prove that ", written, " and ", other,
      " do not overlap in memory (their strides are too irregular to check exactly); pass a clone of one of them");
}

namespace {

// Exact for any strides (overlap.h): packed qkv slices are accepted, any
// shared element between the written tensors or with a read-only input is not.
void check_in_place_targets(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args) {
  const char* q_name = k ? "q" : "x";
  check_distinct(op, q_name, q);
  if (k) {
    check_distinct(op, "k", *k);
    check_disjoint(op, "q", q, "k", *k, "each element must belong to one of them");
  }
  for (const at::Tensor* w : {&q, k}) {
    if (!w) continue;
    const char* name = w == &q ? q_name : "k";
    check_disjoint(op, name, *w, "freqs", freqs);
    if (args.offsets) check_disjoint(op, name, *w, "offsets", *args.offsets);
    if (args.position_ids) check_disjoint(op, name, *w, "position_ids", *args.position_ids);
    if (args.cu_seqlens) check_disjoint(op, name, *w, "cu_seqlens", *args.cu_seqlens);
    if (args.inv_freq) check_disjoint(op, name, *w, "inv_freq", *args.inv_freq);
  }
}

}  // namespace

PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
    bool in_place) {
  return prepare_rope(op, q, k, freqs, args, in_place, check_rope_inputs(op, q, k, freqs, args));
}

PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
    bool in_place, const RopeCall& call) {
  TORCH_CHECK_VALUE(args.start_pos >= 0, op, ": start_pos must be >= 0, got ", args.start_pos);
  const at::Tensor& qv = call.q;
  const at::Tensor& kv = call.k;
  if (in_place) check_in_place_targets(op, qv, k ? &kv : nullptr, freqs, args);

  PreparedRope r;
  r.out_q = in_place ? q : make_output(q);
  if (k) r.out_k = in_place ? *k : make_output(*k);
  auto& p = r.params;
  fill_head_tensor(p.q, qv, canonical_view(op, "q", r.out_q, args));
  if (k) fill_head_tensor(p.k, kv, canonical_view(op, "k", r.out_k, args));
  p.batch = qv.size(0);
  p.seq = qv.size(2);
  p.head_dim = qv.size(3);
  p.rotary_dim = 2 * freqs.size(1);
  p.rotary_offset = args.rotary_offset;
  p.in_place = in_place;
  const at::Tensor table = freqs.is_complex() ? freqs : at::view_as_complex(freqs);
  p.freqs = reinterpret_cast<const float*>(table.data_ptr());
  p.freqs_len = table.size(0);
  p.freqs_stride_pos = table.stride(0);
  p.freqs_stride_pair = table.stride(1);
  p.start_pos = args.start_pos;
  p.interleaved = args.interleaved;
  // A lazily conjugated table (freqs.conj()) holds e^{-i angle}: the same
  // memory read with the inverse rotation.
  p.inverse = freqs.is_conj() ? !args.inverse : args.inverse;
  if (args.inv_freq) {
    p.inv_freq = args.inv_freq->data_ptr<double>();
    p.inv_freq_stride = args.inv_freq->stride(0);
  }
  if (args.cu_seqlens) {
    const auto& cu = *args.cu_seqlens;
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_stride = cu.stride(0);
    p.cu_seqlens_int32 = cu.scalar_type() == at::kInt;
    p.num_seqs = cu.size(0) - 1;
    if (cu.is_cpu()) check_cu_seqlens_values(op, cu, p.seq);
    TORCH_CHECK_VALUE(p.num_seqs >= 1 || p.seq == 0, op, ": cu_seqlens has no sequence but there are ", p.seq, " tokens");
  }
  if (args.offsets || args.position_ids) {
    const at::Tensor& given = args.position_ids ? *args.position_ids : *args.offsets;
    r.positions = widen_positions(op, args.position_ids ? "position_ids" : "offsets", given);
    const auto& pos = r.positions;
    p.positions = pos.data_ptr();
    p.positions_int32 = pos.scalar_type() == at::kInt;
    p.positions_are_offsets = !args.position_ids;
    if (args.pair_axes) {
      fill_axes(p, pos, args);
    } else if (args.position_ids && pos.dim() == 1) {  // [seq] or packed [total_tokens]
      if (pos.size(0) > 1) p.pos_stride_s = pos.stride(0);
    } else {
      if (pos.dim() >= 1 && pos.size(0) > 1) p.pos_stride_b = pos.stride(0);
      if (pos.dim() == 2 && pos.size(1) > 1) p.pos_stride_s = pos.stride(1);
    }
  }
  check_start_pos(op, args.start_pos);  // >= 0 was checked first, above
  // Positions known on the host are checked by value: a CPU positions tensor,
  // or none at all (start_pos + local index).
  const bool host_positions = r.params.positions == nullptr || r.positions.is_cpu();
  const bool host_seqlens = !args.cu_seqlens || args.cu_seqlens->is_cpu();
  if (host_positions && host_seqlens && p.batch * p.seq > 0) {
    if (p.positions == nullptr && !args.cu_seqlens) {
      TORCH_CHECK_INDEX(
          p.inv_freq != nullptr || p.seq <= p.freqs_len - args.start_pos, op, ": start_pos + seq_len = ",
          args.start_pos, " + ", p.seq, " = ", args.start_pos + p.seq,
          " exceeds the freqs table length (max_seq_len) ", p.freqs_len,
          "; pass inv_freq or build a longer table (max_seq_len > ", args.start_pos + p.seq - 1, ")");
    } else if (p.num_axes > 0) {
      check_axes_in_table(op, p);
    } else {
      check_positions_in_table(op, p);
    }
  }
  return r;
}

}  // namespace detail
}  // namespace rotary
