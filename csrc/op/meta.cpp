// Meta kernels: shapes and dtypes only, so torch.compile and export trace the
// ops without running them and without a Python fake implementation.
#include "checks/checks.h"
#include "checks/kv_checks.h"
#include "checks/norm_checks.h"
#include "numbered_errors.h"
#include <rotary/op_args.h>

#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_IMPL(rotary, Meta, m) {
  ROTARY_IMPL_ALL(m, meta, ROTARY_NUMBERED_ERRORS);
  ROTARY_IMPL_NORM(m, meta, ROTARY_NUMBERED_ERRORS);
}

}  // namespace rotary
