// The arguments the RoPE ops take after their tensors, written once as an
// X-macro: X(dispatcher type, kernel type, name, C++ default, schema text),
// in schema order (also the field order of detail::RopeArgs). Everything
// else is expanded from it: the declarations in rotary/ops.h, the schemas
// and entry points (csrc/op/ops.cpp), the backends, Meta and Autograd; the
// Python wrappers are generated from the registered schemas.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>

#define ROTARY_OPT_TENSOR_ const std::optional<at::Tensor>&
#define ROTARY_OPT_TENSOR_ARG_(X, name) \
  X(ROTARY_OPT_TENSOR_, ROTARY_OPT_TENSOR_, name, std::nullopt, "Tensor? " #name "=None")

// The RoPE ops' arguments; everything after interleaved is keyword-only.
#define ROTARY_ROPE_ARGS(X)                                                      \
  X(c10::SymInt, int64_t, start_pos, 0, "SymInt start_pos=0")                    \
  X(bool, bool, interleaved, true, "bool interleaved=True")                      \
  X(ROTARY_OPT_TENSOR_, ROTARY_OPT_TENSOR_, offsets, std::nullopt, "*, Tensor? offsets=None") \
  ROTARY_OPT_TENSOR_ARG_(X, position_ids)                                           \
  X(bool, bool, inverse, false, "bool inverse=False")                            \
  ROTARY_OPT_TENSOR_ARG_(X, cu_seqlens)                                             \
  ROTARY_OPT_TENSOR_ARG_(X, inv_freq)                                               \
  X(c10::string_view, c10::string_view, layout, "BHSD", "str layout=\"BHSD\"")   \
  X(int64_t, int64_t, rotary_offset, 0, "int rotary_offset=0")                   \
  X(at::OptionalIntArrayRef, at::OptionalIntArrayRef, pair_axes, std::nullopt, "int[]? pair_axes=None")

// apply_rope_with_kv_cache_'s, after q, k, v, k_cache, v_cache and freqs:
// its own order (the cache arguments came first; the rotation features that
// every op takes were appended), start_pos first as above.
#define ROTARY_KV_ARGS(X)                                                        \
  X(c10::SymInt, int64_t, start_pos, 0, "SymInt start_pos=0")                    \
  X(bool, bool, interleaved, true, "bool interleaved=True")                      \
  X(ROTARY_OPT_TENSOR_, ROTARY_OPT_TENSOR_, offsets, std::nullopt, "*, Tensor? offsets=None") \
  ROTARY_OPT_TENSOR_ARG_(X, position_ids)                                           \
  ROTARY_OPT_TENSOR_ARG_(X, cu_seqlens)                                             \
  ROTARY_OPT_TENSOR_ARG_(X, inv_freq)                                               \
  X(c10::string_view, c10::string_view, layout, "BHSD", "str layout=\"BHSD\"")   \
  ROTARY_OPT_TENSOR_ARG_(X, cache_positions)                                        \
  ROTARY_OPT_TENSOR_ARG_(X, slot_mapping)                                           \
  X(c10::string_view, c10::string_view, kv_layout, "BHSD", "str kv_layout=\"BHSD\"") \
  ROTARY_OPT_TENSOR_ARG_(X, k_scale)                                                \
  ROTARY_OPT_TENSOR_ARG_(X, v_scale)                                                \
  X(bool, bool, inverse, false, "bool inverse=False")                            \
  X(int64_t, int64_t, rotary_offset, 0, "int rotary_offset=0")                   \
  X(at::OptionalIntArrayRef, at::OptionalIntArrayRef, pair_axes, std::nullopt, "int[]? pair_axes=None")

// The q/k norm of apply_qk_norm_rope (after the RoPE arguments, so also
// keyword-only), in the field order of detail::NormArgs.
#define ROTARY_NORM_ARGS(X)                                                      \
  ROTARY_OPT_TENSOR_ARG_(X, q_weight)                                               \
  ROTARY_OPT_TENSOR_ARG_(X, k_weight)                                               \
  X(double, double, eps, 1e-6, "float eps=1e-06")                                \
  X(c10::string_view, c10::string_view, norm, "head", "str norm=\"head\"")       \
  X(double, double, weight_offset, 0.0, "float weight_offset=0.0")               \
  ROTARY_OPT_TENSOR_ARG_(X, q_fp8_scale)

// Each with a leading comma, to follow the tensors of a parameter list.
#define ROTARY_ARG_DECL(api, kernel, name, dflt, schema) , api name = dflt
#define ROTARY_ARG_PARAM(api, kernel, name, dflt, schema) , api name
#define ROTARY_ARG_KERNEL_PARAM(api, kernel, name, dflt, schema) , kernel name
#define ROTARY_ARG_TYPE(api, kernel, name, dflt, schema) , api
#define ROTARY_ARG_NAME(api, kernel, name, dflt, schema) , name
#define ROTARY_ARG_SCHEMA(api, kernel, name, dflt, schema) ", " schema

// Declarations with defaults (rotary/ops.h), definitions, kernel parameter
// lists, types, forwarded names and the schema text.
#define ROTARY_ROPE_DECLS ROTARY_ROPE_ARGS(ROTARY_ARG_DECL)
#define ROTARY_ROPE_PARAMS ROTARY_ROPE_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_ROPE_KERNEL_PARAMS ROTARY_ROPE_ARGS(ROTARY_ARG_KERNEL_PARAM)
#define ROTARY_ROPE_TYPES ROTARY_ROPE_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_ROPE_NAMES ROTARY_ROPE_ARGS(ROTARY_ARG_NAME)
#define ROTARY_ROPE_SCHEMA ROTARY_ROPE_ARGS(ROTARY_ARG_SCHEMA)
#define ROTARY_KV_DECLS ROTARY_KV_ARGS(ROTARY_ARG_DECL)
#define ROTARY_KV_PARAMS ROTARY_KV_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_KV_KERNEL_PARAMS ROTARY_KV_ARGS(ROTARY_ARG_KERNEL_PARAM)
#define ROTARY_KV_TYPES ROTARY_KV_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_KV_NAMES ROTARY_KV_ARGS(ROTARY_ARG_NAME)
#define ROTARY_KV_SCHEMA ROTARY_KV_ARGS(ROTARY_ARG_SCHEMA)
#define ROTARY_NORM_DECLS ROTARY_NORM_ARGS(ROTARY_ARG_DECL)
#define ROTARY_NORM_PARAMS ROTARY_NORM_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_NORM_KERNEL_PARAMS ROTARY_NORM_ARGS(ROTARY_ARG_KERNEL_PARAM)
#define ROTARY_NORM_TYPES ROTARY_NORM_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_NORM_NAMES ROTARY_NORM_ARGS(ROTARY_ARG_NAME)
#define ROTARY_NORM_SCHEMA ROTARY_NORM_ARGS(ROTARY_ARG_SCHEMA)
// The tensors of the KV op, before its arguments.
#define ROTARY_KV_TENSORS \
  at::Tensor& q, at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& freqs
#define ROTARY_KV_TENSOR_TYPES at::Tensor&, at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&
// The names without the leading comma (a braced RopeArgs initialiser).
#define ROTARY_DROP_FIRST_(first, ...) __VA_ARGS__
#define ROTARY_DROP_FIRST(...) ROTARY_DROP_FIRST_(__VA_ARGS__)
#define ROTARY_ROPE_NAME_LIST ROTARY_DROP_FIRST(ROTARY_ROPE_NAMES)
#define ROTARY_NORM_NAME_LIST ROTARY_DROP_FIRST(ROTARY_NORM_NAMES)

// apply_rope_cos_sin's, after q, k, cos and sin (keyword-only): the tables
// as callers hand them, so its own list and defaults (rotate_half tables).
#define ROTARY_COS_SIN_ARGS(X)                                                   \
  X(ROTARY_OPT_TENSOR_, ROTARY_OPT_TENSOR_, position_ids, std::nullopt, "*, Tensor? position_ids=None") \
  X(bool, bool, interleaved, false, "bool interleaved=False")                    \
  X(c10::string_view, c10::string_view, layout, "BHSD", "str layout=\"BHSD\"")   \
  X(int64_t, int64_t, rotary_offset, 0, "int rotary_offset=0")                   \
  X(bool, bool, inverse, false, "bool inverse=False")
#define ROTARY_COS_SIN_DECLS ROTARY_COS_SIN_ARGS(ROTARY_ARG_DECL)
#define ROTARY_COS_SIN_PARAMS ROTARY_COS_SIN_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_COS_SIN_TYPES ROTARY_COS_SIN_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_COS_SIN_NAMES ROTARY_COS_SIN_ARGS(ROTARY_ARG_NAME)
#define ROTARY_COS_SIN_SCHEMA ROTARY_COS_SIN_ARGS(ROTARY_ARG_SCHEMA)

// Registers one dispatch key's five kernels in a TORCH_LIBRARY_IMPL, named
// after the op and the key (apply_rope_meta; in place: apply_rope_inplace_meta),
// each through wrap (a macro taking the function's address; empty: as it is).
#define ROTARY_IMPL_ALL(m, suffix, wrap)                                         \
  m.impl("apply_rope", wrap(&apply_rope_##suffix));                              \
  m.impl("apply_rope_qk", wrap(&apply_rope_qk_##suffix));                        \
  m.impl("apply_rope_", wrap(&apply_rope_inplace_##suffix));                     \
  m.impl("apply_rope_qk_", wrap(&apply_rope_qk_inplace_##suffix));               \
  m.impl("apply_rope_with_kv_cache_", wrap(&apply_rope_with_kv_cache_##suffix))
// The same for the prologue ops (registered from their own files).
#define ROTARY_IMPL_NORM(m, suffix, wrap)                                        \
  m.impl("apply_qk_norm_rope", wrap(&apply_qk_norm_rope_##suffix));              \
  m.impl("apply_qk_norm_rope_", wrap(&apply_qk_norm_rope_inplace_##suffix));     \
  m.impl("apply_qk_norm_rope_with_kv_cache_", wrap(&apply_qk_norm_rope_with_kv_cache_##suffix))
