#include "norm_checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace rotary {
namespace detail {
kernel::NormKind parse_norm(const char* op, c10::string_view norm) {
  if (norm == "head") return kernel::NormKind::kHead;
  TORCH_CHECK_VALUE(
      norm == "heads", op, ": norm must be 'head' (each head over its head_dim) or 'heads' (all heads of a ",
      "token together), got '", norm, "'");
  return kernel::NormKind::kHeads;
}

namespace {

// weight of the tensor `of` ([batch, heads, seq, head_dim] view v).
void check_weight(
    const char* op, const char* name, const at::Tensor& w, const char* of, const at::Tensor& v,
    const at::Tensor& q, kernel::NormKind kind) {
  check_float_dtype(op, name, w);
  TORCH_CHECK_VALUE(
      w.device() == q.device(), op, ": ", name, " is on ", w.device(), " but q is on ", q.device(),
      "; move both to the same device");
  const bool heads = kind == kernel::NormKind::kHeads;
  const c10::SymInt want = heads ? v.sym_size(1) * v.sym_size(3) : v.sym_size(3);
  TORCH_CHECK_VALUE(
      w.dim() == 1 && w.sym_size(0) == want, op, ": ", name, " must be 1-D ",
      heads ? "[heads * head_dim] = [" : "[head_dim] = [", want, "] for norm '", heads ? "heads" : "head",
      "' (", of, " has ", v.sym_size(1), " heads of head_dim ", v.sym_size(3), "), got shape ", w.sym_sizes());
}

}  // namespace

NormCall check_norm_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm, bool in_place) {
  return check_norm_args(op, check_rope_inputs(op, q, &k, freqs, args), q, norm, in_place);
}

at::Tensor make_q_output(const at::Tensor& q, const NormCall& call) {
  return make_output(q, call.q_fp8_scale ? std::optional<at::ScalarType>(at::kFloat8_e4m3fn) : std::nullopt);
}

NormCall check_norm_args(const char* op, RopeCall rope, const at::Tensor& q, const NormArgs& norm, bool in_place) {
  NormCall call;
  call.rope = std::move(rope);
  call.kind = parse_norm(op, norm.norm);
  TORCH_CHECK_VALUE(std::isfinite(norm.eps) && norm.eps >= 0, op, ": eps must be finite and >= 0, got ", norm.eps);
  TORCH_CHECK_VALUE(
      std::isfinite(norm.weight_offset), op, ": weight_offset must be finite, got ", norm.weight_offset);
  // Below float64 the norm accumulates in float32: a larger value would be inf there.
  if (q.scalar_type() != at::kDouble) {
    const double top = std::numeric_limits<float>::max();
    TORCH_CHECK_VALUE(norm.eps <= top, op, ": eps must be finite in float32 (the norm's accumulation type for ",
                      q.scalar_type(), " q), got ", norm.eps);
    TORCH_CHECK_VALUE(std::abs(norm.weight_offset) <= top, op, ": weight_offset must be finite in float32 (the ",
                      "norm's accumulation type for ", q.scalar_type(), " q), got ", norm.weight_offset);
    // A tiny eps would be added as 0: a zero head would divide by 0.
    TORCH_CHECK_VALUE(norm.eps == 0 || static_cast<float>(norm.eps) != 0.0f, op, ": eps is 0 in float32 (the ",
                      "norm's accumulation type for ", q.scalar_type(), " q), got ", norm.eps, "; pass 0 for no eps, ",
                      "or at least ", std::numeric_limits<float>::denorm_min());
  }
  call.eps = norm.eps;
  call.weight_offset = norm.weight_offset;
  if (norm.q_weight) {
    check_weight(op, "q_weight", *norm.q_weight, "q", call.rope.q, q, call.kind);
    call.weight[0] = &*norm.q_weight;
  }
  if (norm.k_weight) {
    check_weight(op, "k_weight", *norm.k_weight, "k", call.rope.k, q, call.kind);
    call.weight[1] = &*norm.k_weight;
  }
  if (norm.q_fp8_scale) {
    const at::Tensor& s = *norm.q_fp8_scale;
    check_defined(op, "q_fp8_scale", s);
    TORCH_CHECK_VALUE(
        !in_place, op, ": q_fp8_scale (q returned as float8_e4m3fn) needs the out-of-place apply_qk_norm_rope; ",
        "in place, q keeps its dtype");
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": q_fp8_scale must be float32, got ", s.scalar_type());
    TORCH_CHECK_VALUE(
        s.device() == q.device(), op, ": q_fp8_scale is on ", s.device(), " but q is on ", q.device(),
        "; move both to the same device");
    const c10::SymInt heads = call.rope.q.sym_size(1);
    TORCH_CHECK_VALUE(
        s.dim() == 0 || (s.dim() == 1 && (s.sym_size(0) == 1 || s.sym_size(0) == heads)), op,
        ": q_fp8_scale must be [], [1] or [heads] = [", heads, "] (per tensor or per q head), got shape ",
        s.sym_sizes());
    call.q_fp8_scale = &s;
  }
  return call;
}

NormWeights prepare_norm_weights(
    const char* op, const NormCall& call, const at::Tensor& q, bool in_place,
    std::initializer_list<std::pair<const char*, const at::Tensor*>> written) {
  const char* names[2] = {"q_weight", "k_weight"};
  if (in_place) {
    for (int i = 0; i < 2; ++i) {
      if (!call.weight[i]) continue;
      for (const auto& [name, t] : written) check_disjoint(op, name, *t, names[i], *call.weight[i]);
    }
  }
  NormWeights r;
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // The kernels read both weights in q's dtype when both are contiguous in
  // it, else both in the accumulation type: a weight that is neither, or
  // strided, is converted here (a copy per call only for that weight).
  auto as_is = [&](int i, at::ScalarType t) {
    return !call.weight[i] || (call.weight[i]->is_contiguous() && call.weight[i]->scalar_type() == t);
  };
  r.params.weight_acc = !(as_is(0, q.scalar_type()) && as_is(1, q.scalar_type()));
  for (int i = 0; i < 2; ++i) {
    if (!call.weight[i]) continue;  // ones: nothing to read
    r.weight[i] = !r.params.weight_acc || as_is(i, acc) ? *call.weight[i] : call.weight[i]->to(acc).contiguous();
    r.params.weight[i] = r.weight[i].data_ptr();
  }
  r.params.weight_offset = call.weight_offset;
  r.params.kind = call.kind;
  r.params.eps = call.eps;
  if (call.q_fp8_scale) {
    const at::Tensor& s = *call.q_fp8_scale;
    check_scale_values(op, "q_fp8_scale", s, "q is returned as");
    r.params.q_scale = s.data_ptr<float>();
    r.params.q_scale_stride = s.dim() == 1 && s.size(0) > 1 ? s.stride(0) : 0;
  }
  return r;
}

PreparedNormRope prepare_norm_rope(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm, bool in_place) {
  const NormCall call = check_norm_rope_inputs(op, q, k, freqs, args, norm, in_place);
  PreparedNormRope r;
  r.norm = prepare_norm_weights(op, call, q, in_place, {{"q", &q}, {"k", &k}});
  // With q_fp8_scale, q comes out as float8_e4m3fn bytes (its own strides).
  const at::Tensor fp8_q = call.q_fp8_scale ? make_q_output(q, call) : at::Tensor();
  r.rope = prepare_rope(op, q, &k, call.rope, in_place, fp8_q.defined() ? &fp8_q : nullptr);
  return r;
}

PreparedNormKV prepare_norm_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv,
    const NormArgs& norm) {
  const KVCall call = check_kv_inputs(op, q, k, v, k_cache, v_cache, freqs, args, kv);
  const NormCall n = check_norm_args(op, call.rope, q, norm, /*in_place=*/true);
  PreparedNormKV r;
  r.norm = prepare_norm_weights(
      op, n, q, /*in_place=*/true, {{"q", &q}, {"k", &k}, {"k_cache", &k_cache}, {"v_cache", &v_cache}});
  r.kv = prepare_kv(op, q, k, v, freqs, call, kv);
  return r;
}

}  // namespace detail
}  // namespace rotary
