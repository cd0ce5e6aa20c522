// Op schemas and the C++ entry points that call them through the dispatcher.
#include <rotary/ops.h>

#include "rope_args.h"

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

// The schema spelling of ROTARY_ROPE_ARGS (rope_args.h).
#define ROTARY_OPTIONAL_ARGS                                                                          \
  "SymInt start_pos=0, bool interleaved=True, *, Tensor? offsets=None, Tensor? position_ids=None, " \
  "bool inverse=False, Tensor? cu_seqlens=None, Tensor? inv_freq=None, str layout=\"BHSD\", " \
  "int rotary_offset=0, int[]? pair_axes=None"

TORCH_LIBRARY(rotary, m) {
  m.def("apply_rope(Tensor x, Tensor freqs, " ROTARY_OPTIONAL_ARGS ") -> Tensor");
  m.def("apply_rope_qk(Tensor q, Tensor k, Tensor freqs, " ROTARY_OPTIONAL_ARGS ") -> (Tensor, Tensor)");
  // The in-place ops return nothing (torch.compile cannot functionalize a
  // custom op whose output aliases an input); the C++ and Python wrappers
  // hand back the rotated tensors.
  m.def("apply_rope_(Tensor(a!) x, Tensor freqs, " ROTARY_OPTIONAL_ARGS ") -> ()");
  m.def("apply_rope_qk_(Tensor(a!) q, Tensor(b!) k, Tensor freqs, " ROTARY_OPTIONAL_ARGS ") -> ()");
  // Every tensor it writes is annotated, so functionalization sees them all.
  m.def(
      "apply_rope_with_kv_cache_(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor freqs, SymInt start_pos=0, bool interleaved=True, *, Tensor? offsets=None, Tensor? position_ids=None, "
      "Tensor? cu_seqlens=None, Tensor? inv_freq=None, str layout=\"BHSD\", Tensor? cache_positions=None, "
      "Tensor? slot_mapping=None, str kv_layout=\"BHSD\", Tensor? k_scale=None, Tensor? v_scale=None, "
      "bool inverse=False, int rotary_offset=0, int[]? pair_axes=None) -> ()");
}

}  // namespace rotary
