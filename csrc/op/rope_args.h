// The arguments the RoPE ops take after their tensors, written once as
// an X-macro: X(dispatcher type, kernel type, name), in schema order (also
// the field order of detail::RopeArgs). The entry points (ops.cpp), the
// backends (backend_ops.h), Meta and Autograd expand it; the schema text
// (ops.cpp), the documented declarations (rotary/ops.h) and the Python
// wrappers spell it out for their readers, and a mismatch with those fails
// to compile, link or register.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>

#define ROTARY_ROPE_ARGS(X)                                                        \
  X(c10::SymInt, int64_t, start_pos)                                               \
  X(bool, bool, interleaved)                                                       \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, offsets)      \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, position_ids) \
  X(bool, bool, inverse)                                                           \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, cu_seqlens)   \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, inv_freq)     \
  X(c10::string_view, c10::string_view, layout)                                    \
  X(int64_t, int64_t, rotary_offset)                                               \
  X(at::OptionalIntArrayRef, at::OptionalIntArrayRef, pair_axes)

// apply_rope_with_kv_cache_'s, after q, k, v, k_cache, v_cache and freqs:
// its own order (the cache arguments came first; the rotation features that
// every op takes were appended), start_pos first as above.
#define ROTARY_KV_ARGS(X)                                                           \
  X(c10::SymInt, int64_t, start_pos)                                                \
  X(bool, bool, interleaved)                                                        \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, offsets)         \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, position_ids)    \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, cu_seqlens)      \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, inv_freq)        \
  X(c10::string_view, c10::string_view, layout)                                     \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, cache_positions) \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, slot_mapping)    \
  X(c10::string_view, c10::string_view, kv_layout)                                  \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, k_scale)         \
  X(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, v_scale)         \
  X(bool, bool, inverse)                                                            \
  X(int64_t, int64_t, rotary_offset)                                                \
  X(at::OptionalIntArrayRef, at::OptionalIntArrayRef, pair_axes)

// Each with a leading comma, to follow the tensors of a parameter list.
#define ROTARY_ARG_PARAM(api, kernel, name) , api name
#define ROTARY_ARG_KERNEL_PARAM(api, kernel, name) , kernel name
#define ROTARY_ARG_TYPE(api, kernel, name) , api
#define ROTARY_ARG_NAME(api, kernel, name) , name

// The parameter lists, the types and the forwarded names.
#define ROTARY_ROPE_PARAMS ROTARY_ROPE_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_ROPE_KERNEL_PARAMS ROTARY_ROPE_ARGS(ROTARY_ARG_KERNEL_PARAM)
#define ROTARY_ROPE_TYPES ROTARY_ROPE_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_ROPE_NAMES ROTARY_ROPE_ARGS(ROTARY_ARG_NAME)
#define ROTARY_KV_PARAMS ROTARY_KV_ARGS(ROTARY_ARG_PARAM)
#define ROTARY_KV_KERNEL_PARAMS ROTARY_KV_ARGS(ROTARY_ARG_KERNEL_PARAM)
#define ROTARY_KV_TYPES ROTARY_KV_ARGS(ROTARY_ARG_TYPE)
#define ROTARY_KV_NAMES ROTARY_KV_ARGS(ROTARY_ARG_NAME)
// The tensors of the KV op, before its arguments.
#define ROTARY_KV_TENSORS \
  at::Tensor& q, at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& freqs
#define ROTARY_KV_TENSOR_TYPES at::Tensor&, at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&
// The names without the leading comma (a braced RopeArgs initialiser).
#define ROTARY_DROP_FIRST_(first, ...) __VA_ARGS__
#define ROTARY_DROP_FIRST(...) ROTARY_DROP_FIRST_(__VA_ARGS__)
#define ROTARY_ROPE_NAME_LIST ROTARY_DROP_FIRST(ROTARY_ROPE_NAMES)
