// Op schemas and the C++ entry points that call them through the dispatcher.
#include <rotary/ops.h>

#include <rotary/op_args.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace rotary {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  static auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES)>("rotary::apply_rope");
  return op.call(x, freqs ROTARY_ROPE_NAMES);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES)>("rotary::apply_rope_qk");
  return op.call(q, k, freqs ROTARY_ROPE_NAMES);
}

at::Tensor& apply_rope_(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  static auto op = find_op<void(at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES)>("rotary::apply_rope_");
  op.call(x, freqs ROTARY_ROPE_NAMES);
  return x;
}

void apply_rope_qk_(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  static auto op =
      find_op<void(at::Tensor&, at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES)>("rotary::apply_rope_qk_");
  op.call(q, k, freqs ROTARY_ROPE_NAMES);
}

void apply_rope_with_kv_cache_(ROTARY_KV_TENSORS ROTARY_KV_PARAMS) {
  static auto op = find_op<void(ROTARY_KV_TENSOR_TYPES ROTARY_KV_TYPES)>("rotary::apply_rope_with_kv_cache_");
  op.call(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES);
}

std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES ROTARY_NORM_TYPES)>(
      "rotary::apply_qk_norm_rope");
  return op.call(q, k, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
}

void apply_qk_norm_rope_(
    at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  static auto op = find_op<void(at::Tensor&, at::Tensor&, const at::Tensor& ROTARY_ROPE_TYPES ROTARY_NORM_TYPES)>(
      "rotary::apply_qk_norm_rope_");
  op.call(q, k, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
}

void apply_qk_norm_rope_with_kv_cache_(ROTARY_KV_TENSORS ROTARY_KV_PARAMS ROTARY_NORM_PARAMS) {
  static auto op = find_op<void(ROTARY_KV_TENSOR_TYPES ROTARY_KV_TYPES ROTARY_NORM_TYPES)>(
      "rotary::apply_qk_norm_rope_with_kv_cache_");
  op.call(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES ROTARY_NORM_NAMES);
}

std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
    const std::optional<at::Tensor>& sin ROTARY_COS_SIN_PARAMS) {
  static auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>& ROTARY_COS_SIN_TYPES)>(
      "rotary::apply_rope_cos_sin");
  return op.call(q, k, cos, sin ROTARY_COS_SIN_NAMES);
}

TORCH_LIBRARY(rotary, m) {
  m.def("apply_rope(Tensor x, Tensor freqs" ROTARY_ROPE_SCHEMA ") -> Tensor");
  m.def("apply_rope_qk(Tensor q, Tensor k, Tensor freqs" ROTARY_ROPE_SCHEMA ") -> (Tensor, Tensor)");
  // The in-place ops return nothing (torch.compile cannot functionalize a
  // custom op whose output aliases an input); the C++ and Python wrappers
  // hand back the rotated tensors.
  m.def("apply_rope_(Tensor(a!) x, Tensor freqs" ROTARY_ROPE_SCHEMA ") -> ()");
  m.def("apply_rope_qk_(Tensor(a!) q, Tensor(b!) k, Tensor freqs" ROTARY_ROPE_SCHEMA ") -> ()");
  // Every tensor it writes is annotated, so functionalization sees them all.
  m.def(
      "apply_rope_with_kv_cache_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor freqs" ROTARY_KV_SCHEMA ") -> ()");
  m.def("apply_qk_norm_rope(Tensor q, Tensor k, Tensor freqs" ROTARY_ROPE_SCHEMA ROTARY_NORM_SCHEMA
        ") -> (Tensor, Tensor)");
  m.def("apply_qk_norm_rope_(Tensor(a!) q, Tensor(b!) k, Tensor freqs" ROTARY_ROPE_SCHEMA ROTARY_NORM_SCHEMA ") -> ()");
  m.def(
      "apply_qk_norm_rope_with_kv_cache_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor(c!) k_cache, "
      "Tensor(d!) v_cache, Tensor freqs" ROTARY_KV_SCHEMA ROTARY_NORM_SCHEMA ") -> ()");
  m.def("apply_rope_cos_sin(Tensor q, Tensor k, Tensor cos, Tensor? sin" ROTARY_COS_SIN_SCHEMA ") -> (Tensor, Tensor)");
}

}  // namespace rotary
