// The functional ops with their keyword arguments as options, as torch's
// C++ functional API takes them:
//
//   rotary::apply_rope(x, freqs, rotary::RopeFuncOptions().position_ids(ids).layout("BSHD"));
//   rotary::apply_qk_norm_rope(q, k, freqs, rotary::RopeFuncOptions().start_pos(4),
//                              rotary::QKNormFuncOptions().q_weight(wq).k_weight(wk));
//
// Each struct's fields, types and defaults are expanded from the argument
// lists of rotary/op_args.h, and each overload forwards to the positional
// one in rotary/ops.h: nothing here is written a second time.
#pragma once

#include <rotary/op_args.h>
#include <rotary/ops.h>

#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace rotary {
namespace detail {

// What an options struct keeps for an argument type of op_args.h (owned:
// a string, not a view of one), and the view the op takes back.
template <typename T>
struct Owned {
  using type = std::decay_t<T>;
  static const type& view(const type& v) { return v; }
};
template <>
struct Owned<c10::SymInt> {
  using type = int64_t;
  static c10::SymInt view(int64_t v) { return c10::SymInt(v); }
};
template <>
struct Owned<c10::string_view> {
  using type = std::string;
  static c10::string_view view(const std::string& v) { return v; }
};
template <>
struct Owned<at::OptionalIntArrayRef> {
  using type = std::optional<std::vector<int64_t>>;
  static at::OptionalIntArrayRef view(const type& v) {
    return v ? at::OptionalIntArrayRef(*v) : at::OptionalIntArrayRef();
  }
};

}  // namespace detail

#define ROTARY_FUNC_OPTION_(api, kernel, name, dflt, schema) \
  TORCH_ARG(typename ::rotary::detail::Owned<api>::type, name) = typename ::rotary::detail::Owned<api>::type(dflt);
#define ROTARY_FROM_O_(api, kernel, name, dflt, schema) , ::rotary::detail::Owned<api>::view(o.name())
#define ROTARY_FROM_N_(api, kernel, name, dflt, schema) , ::rotary::detail::Owned<api>::view(n.name())

// The arguments of apply_rope, apply_rope_qk and their in-place forms (and
// the rotation of apply_qk_norm_rope): start_pos, interleaved, offsets,
// position_ids, inverse, cu_seqlens, inv_freq, layout, rotary_offset,
// pair_axes, as rotary/ops.h documents them.
struct RopeFuncOptions {
  ROTARY_ROPE_ARGS(ROTARY_FUNC_OPTION_)
};

// apply_rope_with_kv_cache_'s: the rotation's, and cache_positions,
// slot_mapping, kv_layout, k_scale and v_scale.
struct KVCacheFuncOptions {
  ROTARY_KV_ARGS(ROTARY_FUNC_OPTION_)
};

// The prologue's norm: q_weight, k_weight, eps, norm, weight_offset,
// q_fp8_scale.
struct QKNormFuncOptions {
  ROTARY_NORM_ARGS(ROTARY_FUNC_OPTION_)
};

// apply_rope_cos_sin's: position_ids, interleaved (default false), layout,
// rotary_offset, inverse.
struct CosSinFuncOptions {
  ROTARY_COS_SIN_ARGS(ROTARY_FUNC_OPTION_)
};

inline at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs, const RopeFuncOptions& o) {
  return apply_rope(x, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_));
}

inline std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeFuncOptions& o) {
  return apply_rope_qk(q, k, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_));
}

inline at::Tensor& apply_rope_(at::Tensor& x, const at::Tensor& freqs, const RopeFuncOptions& o) {
  return apply_rope_(x, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_));
}

inline void apply_rope_qk_(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs, const RopeFuncOptions& o) {
  apply_rope_qk_(q, k, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_));
}

inline void apply_rope_with_kv_cache_(ROTARY_KV_TENSORS, const KVCacheFuncOptions& o) {
  apply_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_ARGS(ROTARY_FROM_O_));
}

inline std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeFuncOptions& o,
    const QKNormFuncOptions& n = {}) {
  return apply_qk_norm_rope(q, k, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_) ROTARY_NORM_ARGS(ROTARY_FROM_N_));
}

inline void apply_qk_norm_rope_(
    at::Tensor& q, at::Tensor& k, const at::Tensor& freqs, const RopeFuncOptions& o, const QKNormFuncOptions& n = {}) {
  apply_qk_norm_rope_(q, k, freqs ROTARY_ROPE_ARGS(ROTARY_FROM_O_) ROTARY_NORM_ARGS(ROTARY_FROM_N_));
}

inline void apply_qk_norm_rope_with_kv_cache_(
    ROTARY_KV_TENSORS, const KVCacheFuncOptions& o, const QKNormFuncOptions& n = {}) {
  apply_qk_norm_rope_with_kv_cache_(
      q, k, v, k_cache, v_cache, freqs ROTARY_KV_ARGS(ROTARY_FROM_O_) ROTARY_NORM_ARGS(ROTARY_FROM_N_));
}

inline std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const std::optional<at::Tensor>& sin,
    const CosSinFuncOptions& o) {
  return apply_rope_cos_sin(q, k, cos, sin ROTARY_COS_SIN_ARGS(ROTARY_FROM_O_));
}

#undef ROTARY_FUNC_OPTION_
#undef ROTARY_FROM_O_
#undef ROTARY_FROM_N_

}  // namespace rotary
