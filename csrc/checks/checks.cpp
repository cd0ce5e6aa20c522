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
    return canonical_view(x, layout, /*varlen=*/true);
  }
  const bool known = layout == Layout::kBHSD || layout == Layout::kBSHD || layout == Layout::kSBHD;
  TORCH_CHECK_VALUE(known, op, ": layout must be 'BHSD', 'BSHD' or 'SBHD', got '", args.layout, "'");
  TORCH_CHECK_VALUE(
      x.dim() == 4, op, ": ", name, " must be 4-D ", axes_of(layout).dims, ", got shape ", x.sym_sizes(), " (layout ",
      args.layout, ")", x.dim() == 3 ? "; a 3-D [total_tokens, heads, head_dim] input needs cu_seqlens" : "");
  return canonical_view(x, layout, /*varlen=*/false);
}

at::Tensor canonical_view(const at::Tensor& x, Layout layout, bool varlen) {
  if (varlen) return x.unsqueeze(0).transpose(1, 2);
  if (layout == Layout::kBSHD) return x.transpose(1, 2);
  if (layout == Layout::kSBHD) return x.permute({1, 2, 0, 3});
  return x;
}

namespace {

// Returns the canonical view after checking dtype, rank and head_dim.
at::Tensor check_head_tensor(const char* op, const char* name, const at::Tensor& x, const RopeArgs& args) {
  check_float_dtype(op, name, x);
  at::Tensor v = canonical_view(op, name, x, args);
  const auto head_dim = v.sym_size(3);
  TORCH_CHECK_VALUE(
      head_dim > 0 && head_dim % 2 == 0, op, ": ", name,
      ".size(-1) (head_dim) must be even and > 0, got ", head_dim, " (shape ", x.sym_sizes(), ")");
  return v;
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
  check_integer_dtype(op, name, p);
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
      // One start per sequence, as flash-attn's seqlen_offsets, TransformerEngine's start_positions and
      // FlashInfer's offsets with indptr: token i of sequence n is at start_pos + offsets[n] + i.
      const auto seqs = args.cu_seqlens->sym_size(0) - 1;
      TORCH_CHECK_VALUE(
          p.dim() == 0 || (p.dim() == 1 && (p.sym_size(0) == seqs || p.sym_size(0) == 1)), op,
          ": with cu_seqlens, offsets must have shape [] or [num_seqs] = [", seqs, "] (token i of sequence n is at ",
          "start_pos + offsets[n] + i); got ", p.sym_sizes(),
          p.dim() == 1 && p.sym_size(0) == seq ? "; for one absolute position per token pass position_ids" : "");
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
        p.dim() == 1 && p.sym_size(0) == batch ? "; for per-batch offsets [batch] pass offsets" : "",
        p.dim() == 1 && p.sym_size(0) == 1 ? "; one position for every token is [1, 1]" : "",
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
  // From C++, an undefined one is named first (not read as "both", nor by pair_axes' shape check).
  if (args.offsets) check_defined(op, "offsets", *args.offsets);
  if (args.position_ids) check_defined(op, "position_ids", *args.position_ids);
  if (args.cu_seqlens) {
    const auto& cu = *args.cu_seqlens;
    check_defined(op, "cu_seqlens", cu);
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
    check_same_dtype_as_q(op, *k, q);
    TORCH_CHECK_VALUE(
        kv.sym_size(0) == qv.sym_size(0) && kv.sym_size(2) == qv.sym_size(2) && kv.sym_size(3) == head_dim, op,
        ": k must match q in batch, seq_len and head_dim (all but the head count): q has shape ", q.sym_sizes(),
        ", k has shape ", k->sym_sizes());
    check_same_device(op, "k", *k, q);
  }

  check_defined(op, "freqs", freqs);
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
    check_defined(op, "inv_freq", inv);
    TORCH_CHECK_TYPE(inv.scalar_type() == at::kDouble, op, ": inv_freq must be float64, got ", inv.scalar_type());
    TORCH_CHECK_VALUE(
        inv.dim() == 1 && inv.sym_size(0) == freqs.sym_size(1), op,
        ": inv_freq must have shape [rotary_dim / 2] = [", freqs.sym_size(1), "] to match freqs, got ",
        inv.sym_sizes());
    check_same_device(op, "inv_freq", inv, q);
    // Rows past the table take its attention scaling from its first entry.
    TORCH_CHECK_VALUE(
        freqs.sym_size(0) > 0, op, ": inv_freq needs a table of at least one row (its first entry is the ",
        "attention scaling of the rows computed past it), got freqs ", freqs.sym_sizes());
  }
  if (args.pair_axes) check_axes_positions(op, qv, freqs, args);
  RopeCall call;
  call.q = qv;
  call.k = kv;
  call.freqs = &freqs;
  auto& pos = call.positions;
  if (args.offsets || args.position_ids) {
    check_positions_shape(op, qv, args);
    pos.given = args.position_ids ? &*args.position_ids : &*args.offsets;
    pos.kind = !args.position_ids ? Positions::Kind::kOffsets
        : args.pair_axes          ? Positions::Kind::kAxes
                                  : Positions::Kind::kIds;
    if (args.pair_axes) pos.pair_axes = *args.pair_axes;
    check_same_device(op, pos.name(), *pos.given, q);
  }
  check_start_pos(op, args.start_pos);
  pos.start_pos = args.start_pos;
  call.layout = args.layout.value;
  call.rotary_offset = args.rotary_offset;
  call.interleaved = args.interleaved;
  call.inverse = args.inverse;
  if (args.cu_seqlens) call.cu_seqlens = &*args.cu_seqlens;
  if (args.inv_freq) call.inv_freq = &*args.inv_freq;
  return call;
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK_VALUE(
      t.device() == q.device(), op, ": ", name, " is on ", t.device(), " but q/x is on ", q.device(),
      "; move both to the same device");
}

void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is an undefined tensor (C++ at::Tensor()); pass a tensor, or ",
                    "std::nullopt where the argument is optional");
}

void check_dense(const char* op, const char* name, const at::Tensor& t) {
  if (!t.defined() || (t.layout() == at::kStrided && !t.is_nested() && !t.is_quantized())) return;
  const char* what = t.is_nested()                ? "a nested"
      : t.is_quantized()                          ? "a quantized"
      : t.layout() == at::kSparse                 ? "a sparse COO"
      : t.layout() == at::kMkldnn                 ? "an mkldnn"
                                                  : "a sparse compressed";
  const char* fix = t.is_nested()    ? "pad it (torch.nested.to_padded_tensor), or pack its sequences with cu_seqlens"
      : t.is_quantized()             ? "pass an unquantized one (.dequantize(), .int_repr())"
                                     : "pass a dense one (.to_dense())";
  TORCH_CHECK_TYPE(false, op, ": ", name, " must be a dense (strided) tensor, got ", what, " tensor; ", fix);
}

void refuse_not_dense(const std::string& op, const std::vector<std::pair<std::string, at::Tensor>>& args) {
  for (const auto& [name, t] : args) check_dense(op.c_str(), name.c_str(), t);
  TORCH_CHECK_TYPE(false, op, ": every tensor argument must be a dense (strided) tensor");
}

void check_integer_dtype(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  TORCH_CHECK_TYPE(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), op, ": ", name,
                   " must have an integer dtype (int64 or int32 are read without a copy), got ", t.scalar_type());
}

void check_same_dtype_as_q(const char* op, const at::Tensor& k, const at::Tensor& q) {
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), op, ": k has dtype ", k.scalar_type(), " but q has dtype ",
                   q.scalar_type(), "; q and k must share one dtype");
}

void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  check_defined(op, name, t);
  const auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kDouble || d == at::kHalf || d == at::kBFloat16, op, ": ", name,
                   " must be float32, float64, float16 or bfloat16, got ", d);
}

at::Tensor RopeCall::table() const {
  return freqs->is_complex() ? *freqs : at::view_as_complex(*freqs);
}

}  // namespace detail
}  // namespace rotary
