// Meta kernels: shapes and dtypes only, so torch.compile and export trace the
// ops without running them and without a Python fake implementation.
#include "checks/checks.h"
#include "checks/kv_checks.h"
#include "checks/norm_checks.h"
#include <rotary/op_args.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace rotary {
namespace {

using detail::RopeArgs;

// A symbolic start_pos is checked when the op runs; a known one here too.
int64_t known(const c10::SymInt& start_pos) {
  return start_pos.maybe_as_int().value_or(0);
}

// RopeArgs of a call, with a symbolic start_pos (the list's first) as
// known() reads it.
#define ROTARY_DROP_TWO_(empty, first, ...) __VA_ARGS__
#define ROTARY_DROP_TWO(...) ROTARY_DROP_TWO_(__VA_ARGS__)
#define ROTARY_META_ARGS known(start_pos), ROTARY_DROP_TWO(ROTARY_ROPE_NAMES)

at::Tensor apply_rope_meta(const at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  detail::check_rope_inputs("apply_rope", x, nullptr, freqs, {ROTARY_META_ARGS});
  return detail::make_output(x);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  detail::check_rope_inputs("apply_rope_qk", q, &k, freqs, {ROTARY_META_ARGS});
  return {detail::make_output(q), detail::make_output(k)};
}

void apply_rope_inplace_meta(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  detail::check_rope_inputs("apply_rope_", x, nullptr, freqs, {ROTARY_META_ARGS});
}

void apply_rope_qk_inplace_meta(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  detail::check_rope_inputs("apply_rope_qk_", q, &k, freqs, {ROTARY_META_ARGS});
}

void apply_rope_with_kv_cache_meta(ROTARY_KV_TENSORS ROTARY_KV_PARAMS) {
  detail::check_kv_inputs(
      "apply_rope_with_kv_cache_", q, k, v, k_cache, v_cache, freqs,
      {known(start_pos), interleaved, offsets, position_ids, inverse, cu_seqlens, inv_freq, layout, rotary_offset,
       pair_axes},
      {cache_positions, slot_mapping, kv_layout, k_scale, v_scale});
}

std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  const auto call = detail::check_norm_rope_inputs(
      "apply_qk_norm_rope", q, k, freqs, {ROTARY_META_ARGS}, {ROTARY_NORM_NAME_LIST}, /*in_place=*/false);
  return {detail::make_q_output(q, call), detail::make_output(k)};
}

void apply_qk_norm_rope_inplace_meta(
    at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  detail::check_norm_rope_inputs(
      "apply_qk_norm_rope_", q, k, freqs, {ROTARY_META_ARGS}, {ROTARY_NORM_NAME_LIST}, /*in_place=*/true);
}

void apply_qk_norm_rope_with_kv_cache_meta(ROTARY_KV_TENSORS ROTARY_KV_PARAMS ROTARY_NORM_PARAMS) {
  const char* op = "apply_qk_norm_rope_with_kv_cache_";
  const auto call = detail::check_kv_inputs(
      op, q, k, v, k_cache, v_cache, freqs,
      {known(start_pos), interleaved, offsets, position_ids, inverse, cu_seqlens, inv_freq, layout, rotary_offset,
       pair_axes},
      {cache_positions, slot_mapping, kv_layout, k_scale, v_scale});
  detail::check_norm_args(op, call.rope, q, {ROTARY_NORM_NAME_LIST}, /*in_place=*/true);
}

// A check that fails on symbolic sizes prints them as symbols ("got s0
// (shape [1, s27, s53, s0])"). NumberedErrors reruns the failed kernel on
// meta tensors of the sizes' hints, the values this trace was made for, so
// the error the user sees names numbers as the eager op's does. Only a
// failing call pays; its guards cost nothing, the trace ends there. Sizes
// without a hint (unbacked), or a rerun that passes (a check of devices or
// of storage the fresh tensors do not share), keep the original error.
struct Hints {
  bool symbolic = false, hinted = true;
  void see(const c10::SymInt& s) {
    if (!s.maybe_as_int()) symbolic = true, hinted = hinted && s.has_hint();
  }
  void see(c10::SymIntArrayRef a) {
    for (const auto& s : a) see(s);
  }
  void see(const at::Tensor& t) {
    if (t.defined()) see(t.sym_sizes()), see(t.sym_strides());
  }
  void see(const std::optional<at::Tensor>& t) {
    if (t) see(*t);
  }
  template <typename T>
  void see(const T&) {}
};
int64_t hint(const c10::SymInt& s) {
  const auto known = s.maybe_as_int();
  return known ? *known : s.guard_int(__FILE__, __LINE__);
}
std::vector<int64_t> hints(c10::SymIntArrayRef a) {
  std::vector<int64_t> out;
  for (const auto& s : a) out.push_back(hint(s));
  return out;
}
at::Tensor numbered(const at::Tensor& t) {  // on meta whatever device t shows
  if (!t.defined()) return t;
  return at::empty_strided(hints(t.sym_sizes()), hints(t.sym_strides()), t.options().device(at::kMeta));
}
std::optional<at::Tensor> numbered(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(numbered(*t)) : std::nullopt;
}
c10::SymInt numbered(const c10::SymInt& s) {
  return c10::SymInt(hint(s));
}
template <typename T>
T numbered(const T& v) {
  return v;
}

template <auto fn>
struct NumberedErrors;
template <typename R, typename... A, R (*fn)(A...)>
struct NumberedErrors<fn> {
  static R call(A... a) {
    try {
      return fn(a...);
    } catch (const c10::Error&) {
      Hints h;
      (h.see(a), ...);
      if (!h.symbolic || !h.hinted) throw;
      auto concrete = std::make_tuple(numbered(a)...);
      std::apply(fn, concrete);  // throws the same check's error, with numbers
      throw;
    }
  }
};
#define ROTARY_NUMBERED_ERRORS(fn) &NumberedErrors<fn>::call

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Meta, m) {
  ROTARY_IMPL_ALL(m, meta, ROTARY_NUMBERED_ERRORS);
  ROTARY_IMPL_NORM(m, meta, ROTARY_NUMBERED_ERRORS);
}

}  // namespace rotary
