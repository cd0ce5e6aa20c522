#include "checks.h"

#include "checks_positions.h"
#include "overlap.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace rotary {
namespace detail {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool is_varlen(const RopeArgs& args) {
  return args.cu_seqlens.has_value();
}

}  // namespace

at::Tensor canonical_view(const char* op, const char* name, const at::Tensor& x, const RopeArgs& args) {
  const Layout layout = args.layout.value;
  if (is_varlen(args)) {
    TORCH_CHECK_VALUE(
        x.dim() == 3, op, ": with cu_seqlens, ", name, " must be 3-D [total_tokens, heads, head_dim], got shape ",
        x.sym_sizes());
    TORCH_CHECK_VALUE(
        layout == Layout::kBHSD || layout == Layout::kTHD, op, ": with cu_seqlens the layout is 'THD', got '",
        args.layout, "'");
    return x.unsqueeze(0).transpose(1, 2);
  }
  const bool known = layout == Layout::kBHSD || layout == Layout::kBSHD || layout == Layout::kSBHD;
  TORCH_CHECK_VALUE(known, op, ": layout must be 'BHSD', 'BSHD' or 'SBHD', got '", args.layout, "'");
  const char* dims = layout == Layout::kBSHD ? "[batch, seq_len, heads, head_dim]"
      : layout == Layout::kSBHD              ? "[seq_len, batch, heads, head_dim]"
                                             : "[batch, heads, seq_len, head_dim]";
  TORCH_CHECK_VALUE(
      x.dim() == 4, op, ": ", name, " must be 4-D ", dims, ", got shape ", x.sym_sizes(), " (layout ",
      args.layout, ")", x.dim() == 3 ? "; a 3-D [total_tokens, heads, head_dim] input needs cu_seqlens" : "");
  if (layout == Layout::kBSHD) return x.transpose(1, 2);
  if (layout == Layout::kSBHD) return x.permute({1, 2, 0, 3});
  return x;
}

namespace {

// Returns the canonical view after checking dtype, rank and head_dim.
at::Tensor check_head_tensor(const char* op, const char* name, const at::Tensor& x, const RopeArgs& args) {
  TORCH_CHECK_TYPE(
      is_supported_float(x.scalar_type()), op, ": ", name,
      " must be float32, float64, float16 or bfloat16, got ", x.scalar_type());
  at::Tensor v = canonical_view(op, name, x, args);
  const auto head_dim = v.sym_size(3);
  TORCH_CHECK_VALUE(
      head_dim > 0 && head_dim % 2 == 0, op, ": ", name,
      ".size(-1) (head_dim) must be even and > 0, got ", head_dim, " (shape ", x.sym_sizes(), ")");
  return v;
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK_VALUE(
      t.device() == q.device(), op, ": ", name, " is on ", t.device(), " but q/x is on ", q.device(),
      "; move both to the same device");
}

// offsets: [] or [batch] (per-sequence start), position_ids: [seq] or
// [batch, seq] (absolute, as in Hugging Face); packed: [] / [total_tokens].
// Each message names the other argument, so the two are never confused.
void check_positions_shape(const char* op, const at::Tensor& q_view, const RopeArgs& args) {
  TORCH_CHECK_VALUE(
      !(args.offsets && args.position_ids), op,
      ": pass offsets (per-sequence starts) or position_ids (absolute ids), not both");
  // Absolute ids leave no room for a second origin: refuse rather than add.
  TORCH_CHECK_VALUE(
      !args.position_ids || args.start_pos == 0, op, ": start_pos must be 0 with position_ids (they are ",
      "absolute positions), got start_pos = ", args.start_pos,
      "; add it to the ids, or pass offsets for per-sequence starts");
  const bool ids = args.position_ids.has_value();
  const at::Tensor& p = ids ? *args.position_ids : *args.offsets;
  const char* name = ids ? "position_ids" : "offsets";
  TORCH_CHECK_TYPE(
      at::isIntegralType(p.scalar_type(), /*includeBool=*/false), op, ": ", name, " must have an integer dtype (int64 or int32 are read ",
      "without a copy), got ", p.scalar_type());
  if (args.pair_axes) return;  // N-D shapes: check_axes_positions
  const auto batch = q_view.sym_size(0);
  const auto seq = q_view.sym_size(2);
  if (is_varlen(args)) {
    if (ids) {
      TORCH_CHECK_VALUE(
          p.dim() == 1 && p.sym_size(0) == seq, op, ": with cu_seqlens, position_ids must have shape ",
          "[total_tokens] = [", seq, "] (absolute position of each token); got ", p.sym_sizes(),
          p.dim() == 0 ? "; for one offset added to each sequence's index pass offsets" : "");
    } else {
      TORCH_CHECK_VALUE(
          p.dim() == 0, op, ": with cu_seqlens, offsets must have shape [] (added to the index within each ",
          "sequence); got ", p.sym_sizes(), p.dim() == 1 ? "; for one absolute position per token pass position_ids" : "");
    }
    return;
  }
  if (ids) {
    const bool ok = (p.dim() == 1 && p.sym_size(0) == seq) ||
        (p.dim() == 2 && (p.sym_size(0) == batch || p.sym_size(0) == 1) &&
         (p.sym_size(1) == seq || p.sym_size(1) == 1));
    TORCH_CHECK_VALUE(
        ok, op, ": position_ids must have shape [seq_len] or [batch, seq_len] (absolute positions, as in Hugging ",
        "Face) with batch = ", batch, ", seq_len = ", seq, "; got ", p.sym_sizes(),
        p.dim() == 0 ? "; for one offset added to start_pos + s pass offsets" : "",
        p.dim() == 1 ? "; for per-batch offsets [batch] pass offsets" : "",
        p.dim() == 3 ? "; for N-D positions [n_axes, batch, seq_len] pass pair_axes" : "");
    return;
  }
  const bool ok = p.dim() == 0 || (p.dim() == 1 && (p.sym_size(0) == batch || p.sym_size(0) == 1));
  TORCH_CHECK_VALUE(
      ok, op, ": offsets must have shape [] or [batch] (position = start_pos + offsets[b] + s) with batch = ", batch,
      "; got ", p.sym_sizes(), p.dim() >= 1 ? "; for absolute ids [seq_len] or [batch, seq_len] pass position_ids" : "");
}

}  // namespace

RopeCall check_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args) {
  const char* q_name = k ? "q" : "x";
  if (args.cu_seqlens) {
    const auto& cu = *args.cu_seqlens;
    TORCH_CHECK_TYPE(
        cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, op,
        ": cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK_VALUE(
        cu.dim() == 1 && cu.sym_size(0) >= 1, op,
        ": cu_seqlens must be 1-D [num_seqs + 1] (0, end of sequence 0, ..., total_tokens), got shape ",
        cu.sym_sizes());
    check_same_device(op, "cu_seqlens", cu, q);
  }
  const at::Tensor qv = check_head_tensor(op, q_name, q, args);
  const auto head_dim = qv.sym_size(3);
  at::Tensor kv;
  if (k) {
    kv = check_head_tensor(op, "k", *k, args);
    TORCH_CHECK_TYPE(
        k->scalar_type() == q.scalar_type(), op, ": k has dtype ", k->scalar_type(), " but q has dtype ",
        q.scalar_type(), "; q and k must share one dtype");
    TORCH_CHECK_VALUE(
        kv.sym_size(0) == qv.sym_size(0) && kv.sym_size(2) == qv.sym_size(2) && kv.sym_size(3) == head_dim, op,
        ": k must match q in batch, seq_len and head_dim (all but the head count): q has shape ", q.sym_sizes(),
        ", k has shape ", k->sym_sizes());
    check_same_device(op, "k", *k, q);
  }

  // torch.view_as_real(freqs) is the same table: the inductor cannot
  // decompose an in-place custom op with a complex input, so compiled
  // in-place calls pass this view (the Python wrappers do).
  const bool real_view = freqs.scalar_type() == at::kFloat && freqs.dim() == 3;
  if (real_view) {
    TORCH_CHECK_VALUE(
        freqs.sym_size(2) == 2 && freqs.sym_stride(2) == 1 && freqs.sym_stride(0) % 2 == 0 &&
            freqs.sym_stride(1) % 2 == 0 && freqs.sym_storage_offset() % 2 == 0,
        op, ": a float32 freqs must be torch.view_as_real of the complex64 table, [max_seq_len, rotary_dim / 2, 2] ",
        "with its last dim contiguous; got shape ", freqs.sym_sizes(), " and strides ", freqs.sym_strides());
  } else {
    TORCH_CHECK_TYPE(
        freqs.scalar_type() == at::kComplexFloat, op,
        ": freqs must be complex64 (the table from rotary.freqs_table or RotaryEmbedding.freqs) or its ",
        "torch.view_as_real view, got ", freqs.scalar_type());
  }
  TORCH_CHECK_VALUE(
      freqs.dim() == (real_view ? 3 : 2) && freqs.sym_size(1) > 0 && freqs.sym_size(1) * 2 <= head_dim, op,
      ": freqs must have shape [max_seq_len, rotary_dim / 2] with 0 < rotary_dim <= head_dim = ", head_dim,
      " (full rotation: [*, ", head_dim / 2, "]), got ", freqs.sym_sizes());
  check_same_device(op, "freqs", freqs, q);
  check_rotary_span(op, head_dim, freqs, args);

  if (args.inv_freq) {
    const auto& inv = *args.inv_freq;
    TORCH_CHECK_TYPE(inv.scalar_type() == at::kDouble, op, ": inv_freq must be float64, got ", inv.scalar_type());
    TORCH_CHECK_VALUE(
        inv.dim() == 1 && inv.sym_size(0) == freqs.sym_size(1), op,
        ": inv_freq must have shape [rotary_dim / 2] = [", freqs.sym_size(1), "] to match freqs, got ",
        inv.sym_sizes());
    check_same_device(op, "inv_freq", inv, q);
  }
  if (args.pair_axes) check_axes_positions(op, qv, freqs, args);
  if (args.offsets || args.position_ids) {
    check_positions_shape(op, qv, args);
    check_same_device(op, args.position_ids ? "position_ids" : "offsets",
                      args.position_ids ? *args.position_ids : *args.offsets, q);
  }
  return {qv, kv};
}

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
