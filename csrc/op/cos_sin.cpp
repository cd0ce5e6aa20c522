// apply_rope_cos_sin: RoPE from cos/sin tables as callers hand them (Hugging
// Face's per-token pair, vLLM's and FlashInfer's cos_sin_cache with position
// ids). A composite over apply_rope_qk, so every backend, Meta, Autograd and
// torch.compile come from that op: the rows this call uses become its float32
// table view [rows, R / 2, 2] in one pass over cos/sin (small next to q and
// k), and q and k are read and written once, by apply_rope_qk's kernels.
#include <rotary/op_args.h>
#include <rotary/ops.h>

#include "checks/checks.h"
#include "checks/checks_positions.h"
#include "op/func_node.h"
#include "op/numbered_errors.h"
#include "op/rope_state.h"
#include "params/layouts.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

namespace rotary {
namespace {

constexpr const char* kOp = "apply_rope_cos_sin";

// The half of a width-R row a pairing reads, and the half that repeats it:
// rotate_half tables are [c | c], repeat_interleave'd ones [c0 c0 c1 c1 ...].
at::Tensor half(const at::Tensor& t, bool interleaved, bool second) {
  const c10::SymInt r = t.sym_size(-1);
  if (interleaved) return t.slice_symint(-1, second ? 1 : 0, r, 2);
  return t.narrow_symint(-1, second ? r / 2 : c10::SymInt(0), r / 2);
}

void check_table(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), kOp, ": ", name, " must be a float tensor, got ",
                   t.scalar_type());
  detail::check_same_device(kOp, name, t, q);
  TORCH_CHECK_VALUE(!(at::GradMode::is_enabled() && t.requires_grad()), kOp, ": ", name,
                    " requires grad, but gradients with respect to the tables are not supported; pass ", name,
                    ".detach()");
  TORCH_CHECK_VALUE((t.dim() == 2 || t.dim() == 3) && t.sym_size(-1) > 0 && t.sym_size(-1) % 2 == 0, kOp, ": ",
                    name, " must be [seq, R] or [batch, seq, R] (with position_ids: [max_pos, R]) with R = rotary_dim ",
                    "even and > 0, got shape ", t.sym_sizes());
}

// Values can be read on the host: not on a device, and not while tracing
// (fake and functional tensors have none).
bool concrete_cpu(const at::Tensor& t) {
  const auto keys = t.key_set();
  return t.device().is_cpu() && !t.is_meta() && !keys.has(c10::DispatchKey::Python) &&
      !keys.has(c10::DispatchKey::Functionalize);
}

// A check's value, read on the host. Under vmap of grad / jvp this composite
// runs above the per-slice vmap rule, where a per-sample table or id has no
// single value to read: refused by name.
template <typename T>
T host_value(const at::Tensor& t, const char* what) {
  return detail::item_or_refuse<T>(
      t, kOp, ": ", what, " differ per sample under torch.func.vmap of grad or jvp, where their values cannot be ",
      "checked on the host: share them across the vmapped dim (in_dims=None), vmap without grad / jvp, or use ",
      "apply_rope_qk with a freqs table and position_ids");
}

// The rows of `t` for the tokens, [1 | batch, seq, R]: the given per-token
// table, or the ids' rows of a [max_pos, R] one.
at::Tensor rows_of(const at::Tensor& t, const char* name, const std::optional<at::Tensor>& ids) {
  if (!ids) return t.dim() == 2 ? t.unsqueeze(0) : t;
  TORCH_CHECK_VALUE(t.dim() == 2, kOp, ": with position_ids, ", name, " must be a [max_pos, R] table, got shape ",
                    t.sym_sizes());
  // index_select takes int32 and int64 ids only.
  const at::Tensor wide = detail::widen_positions(kOp, "position_ids", *ids);
  if (concrete_cpu(wide) && wide.numel() > 0) {
    const int64_t lo = host_value<int64_t>(wide.min(), "position_ids");
    const int64_t hi = host_value<int64_t>(wide.max(), "position_ids");
    TORCH_CHECK_INDEX(lo >= 0 && hi < t.sym_size(0), kOp, ": position_ids must be in [0, ", t.sym_size(0),
                      ") (the rows of ", name, "), got values in [", lo, ", ", hi, "]");
  } else if (wide.key_set().has(c10::DispatchKey::Python) || wide.key_set().has(c10::DispatchKey::Functionalize)) {
    // Traced: the inductor's index_select wraps a negative id to a row from
    // the end (eager's refuses it), so the graph checks the ids itself.
    // The values are unknown here; the bound is named when it is known.
    const auto rows = t.sym_size(0).maybe_as_int();
    const std::string why = std::string(kOp) + ": position_ids must be in [0, " +
        (rows ? std::to_string(*rows) : std::string("rows")) + ") (the rows of " + name + ")";
    at::_assert_async(at::logical_and(wide.ge(0), wide.lt(t.sym_size(0))).all(), why);
  }  // eager on a device: index_select's own bounds check
  auto shape = wide.sym_sizes().vec();
  shape.push_back(t.sym_size(1));
  at::Tensor out = t.index_select(0, wide.reshape(-1)).view_symint(shape);
  return wide.dim() == 1 ? out.unsqueeze(0) : out;
}

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin_composite(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const std::optional<at::Tensor>& sin ROTARY_COS_SIN_PARAMS) {
  // A composite: it runs for every layout, so it refuses the ones the kernels have no strides for first
  // (and an undefined tensor, None from Python, before its rank or dtype is read).
  detail::check_defined(kOp, "q", q);
  detail::check_defined(kOp, "k", k);
  detail::check_defined(kOp, "cos", cos);
  detail::check_dense(kOp, "q", q);
  detail::check_dense(kOp, "k", k);
  detail::check_dense(kOp, "cos", cos);
  if (sin) {
    detail::check_defined(kOp, "sin", *sin);
    detail::check_dense(kOp, "sin", *sin);
  }
  if (position_ids) detail::check_dense(kOp, "position_ids", *position_ids);
  TORCH_CHECK_VALUE(q.dim() == 3 || q.dim() == 4, kOp, ": q must be [batch, heads, seq, head_dim] in layout, or ",
                    "[tokens, heads, head_dim], got shape ", q.sym_sizes());
  TORCH_CHECK_VALUE(k.dim() == q.dim(), kOp, ": k must have q's rank ", q.dim(), ", got shape ", k.sym_sizes());
  const bool tokens = q.dim() == 3;  // vLLM's [tokens, heads, head_dim]: one sequence
  TORCH_CHECK_VALUE(!tokens || layout == "BHSD", kOp, ": layout applies to 4-D q and k; 3-D ones are ",
                    "[tokens, heads, head_dim], got layout '", layout, "'");
  const Layout lay = tokens ? Layout::kBSHD : parse_layout(layout);
  TORCH_CHECK_VALUE(lay == Layout::kBHSD || lay == Layout::kBSHD || lay == Layout::kSBHD, kOp,
                    ": layout must be 'BHSD', 'BSHD' or 'SBHD', got '", layout, "'");
  const at::Tensor q4 = tokens ? q.unsqueeze(0) : q, k4 = tokens ? k.unsqueeze(0) : k;
  const auto axes = axes_of(lay);
  // q and k as this op's caller named them (apply_rope_qk checks them again).
  detail::check_float_dtype(kOp, "q", q);
  detail::check_float_dtype(kOp, "k", k);
  detail::check_same_dtype_as_q(kOp, k, q);
  const int heads = 3 - axes.batch - axes.seq;  // the axis k may size apart from q
  for (int d = 0; d < 4; ++d) {
    TORCH_CHECK_VALUE(d == heads || k4.sym_size(d) == q4.sym_size(d), kOp, ": k must match q in all but the head ",
                      "count, got q ", q.sym_sizes(), " and k ", k.sym_sizes(), " (layout ",
                      tokens ? "[tokens, heads, head_dim]" : axes.dims, ")");
  }
  detail::check_no_tangent(kOp, {{"cos", &cos}, {"sin", detail::or_null(sin)}});  // q's and k's: apply_rope_qk's
  const c10::SymInt batch = q4.sym_size(axes.batch), seq = q4.sym_size(axes.seq);

  check_table(cos, "cos", q);
  if (position_ids) {
    detail::check_integer_dtype(kOp, "position_ids", *position_ids);
    detail::check_same_device(kOp, "position_ids", *position_ids, q);
    const auto& p = *position_ids;
    const bool per_token = p.dim() == 1 && p.sym_size(0) == seq;
    // [1, seq] broadcasts over the batch, as with every other op.
    const bool per_row = !tokens && p.dim() == 2 && (p.sym_size(0) == batch || p.sym_size(0) == 1) &&
        p.sym_size(1) == seq;
    TORCH_CHECK_VALUE(per_token || !tokens, kOp, ": position_ids must be [seq] = [", seq,
                      "] (q is [tokens, heads, head_dim]), got shape ", p.sym_sizes());
    TORCH_CHECK_VALUE(per_token || per_row, kOp, ": position_ids must be [seq] = [", seq, "] or [batch, seq] = [",
                      batch, ", ", seq, "] (batch may be 1), got shape ", p.sym_sizes());
  }
  at::Tensor c, s;
  if (sin) {
    check_table(*sin, "sin", q);
    TORCH_CHECK_VALUE(sin->sym_sizes() == cos.sym_sizes(), kOp, ": sin must have cos's shape ", cos.sym_sizes(),
                      ", got ", sin->sym_sizes());
    const at::Tensor cr = rows_of(cos, "cos", position_ids), sr = rows_of(*sin, "sin", position_ids);
    // Only a table that repeats its values is a rotation: check it, or a
    // non-RoPE table would be read as one (one more pass; asynchronous). A
    // NaN repeated is a repeat: it reaches the output, as in the formula.
    const auto repeats = [&](const at::Tensor& t) {
      const at::Tensor a = half(t, interleaved, false), b = half(t, interleaved, true);
      return at::logical_or(at::eq(a, b), at::logical_and(at::isnan(a), at::isnan(b))).all();
    };
    const at::Tensor same = at::logical_and(repeats(cr), repeats(sr));
    const char* const why = interleaved
        ? "apply_rope_cos_sin: with interleaved=True, cos and sin must repeat each value twice ([c0, c0, c1, c1, "
          "...], repeat_interleave'd); these do not, so they are not RoPE tables for that pairing"
        : "apply_rope_cos_sin: cos and sin must be rotate_half tables, their two halves equal ([c | c]); these "
          "are not (for repeat_interleave'd tables pass interleaved=True; a table of one value per pair, as "
          "gpt-oss builds, is read as torch.cat([cos, cos], -1))";
    if (concrete_cpu(cr) && concrete_cpu(sr)) {
      TORCH_CHECK_VALUE(host_value<bool>(same, "cos and sin"), why);  // on the host: a ValueError, as every other check
    } else {
      at::_assert_async(same, why);  // elsewhere reading it would sync (or trace data)
    }
    c = half(cr, interleaved, false);
    s = half(sr, interleaved, false);
  } else {
    TORCH_CHECK_VALUE(position_ids.has_value(), kOp, ": sin=None reads cos as a cos_sin_cache [max_pos, R] (R/2 cos ",
                      "then R/2 sin per row), which needs position_ids");
    const at::Tensor rows = rows_of(cos, "cos (the cos_sin_cache)", position_ids);
    c = half(rows, false, false);
    s = half(rows, false, true);
  }
  const c10::SymInt rows = c.sym_size(0);
  TORCH_CHECK_VALUE(c.sym_size(1) == seq && (rows == 1 || rows == batch), kOp,
                    ": cos and sin must have one row per token of q: [seq] = [", seq, "] rows, or [1 or batch, seq] = [",
                    batch, ", ", seq, "], got ", sin ? cos.sym_sizes() : c.sym_sizes());
  const c10::SymInt head_dim = q4.sym_size(3), width = c.sym_size(2) * 2;
  // Named here, with the caller's shape (the rotation below sees a 4-D view).
  TORCH_CHECK_VALUE(head_dim % 2 == 0, kOp, ": q.size(-1) (head_dim) must be even, got ", head_dim, " (shape ",
                    q.sym_sizes(), ")");
  TORCH_CHECK_VALUE(rotary_offset >= 0 && rotary_offset <= head_dim - width, kOp, ": the tables rotate R = ", width,
                    " dims from rotary_offset = ", rotary_offset, ", which must fit in head_dim = ", head_dim,
                    " (0 <= rotary_offset, rotary_offset + R <= head_dim)");
  const at::Tensor table = at::stack({c.to(at::kFloat), s.to(at::kFloat)}, -1).reshape_symint({rows * seq, c.sym_size(2), 2});
  std::optional<at::Tensor> offsets;
  if (rows != 1) {  // token s of batch b reads row b * seq + s
    offsets = at::arange(c10::Scalar(rows), q.options().dtype(at::kLong)).mul(c10::Scalar(seq));
  }
  auto [qo, ko] = apply_rope_qk(q4, k4, table, 0, interleaved, offsets, std::nullopt, inverse, std::nullopt,
                                std::nullopt, tokens ? c10::string_view("BSHD") : layout, rotary_offset, std::nullopt);
  if (tokens) return {qo.squeeze(0), ko.squeeze(0)};
  return {qo, ko};
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CompositeImplicitAutograd, m) {
  m.impl("apply_rope_cos_sin", ROTARY_NUMBERED_ERRORS(&apply_rope_cos_sin_composite));
}

}  // namespace rotary
