// The version bump of every tensor an op writes, as torch's own in-place
// ops do it: in the ADInplaceOrView kernel, which runs under
// torch.inference_mode() too (the Autograd kernels do not). A tensor saved
// for backward and then rotated in place under inference mode makes that
// backward raise instead of reading the rotated values. Unboxed: a decode
// step's in-place call pays one more dispatch, not a boxing of its arguments.
#include <rotary/op_args.h>
#include <rotary/ops.h>

#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <initializer_list>

namespace rotary {
namespace {

// After the kernel: a refused call wrote nothing and bumps nothing. An
// inference tensor has no version (outside inference mode the op refuses
// it before writing).
void bump(std::initializer_list<const at::Tensor*> written) {
  for (const at::Tensor* t : written) {
    if (!t->is_inference()) torch::autograd::increment_version(*t);
  }
}

void apply_rope_inplace_view(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_(x, freqs ROTARY_ROPE_NAMES);
  }
  bump({&x});
}

void apply_rope_qk_inplace_view(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_qk_(q, k, freqs ROTARY_ROPE_NAMES);
  }
  bump({&q, &k});
}

void apply_rope_with_kv_cache_view(ROTARY_KV_TENSORS ROTARY_KV_PARAMS) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES);
  }
  bump({&q, &k, &k_cache, &v_cache});
}

void apply_qk_norm_rope_inplace_view(
    at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_PARAMS ROTARY_NORM_PARAMS) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_qk_norm_rope_(q, k, freqs ROTARY_ROPE_NAMES ROTARY_NORM_NAMES);
  }
  bump({&q, &k});
}

void apply_qk_norm_rope_with_kv_cache_view(ROTARY_KV_TENSORS ROTARY_KV_PARAMS ROTARY_NORM_PARAMS) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    apply_qk_norm_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs ROTARY_KV_NAMES ROTARY_NORM_NAMES);
  }
  bump({&q, &k, &k_cache, &v_cache});
}

}  // namespace

// The ops that write their arguments (Tensor(a!) in the schema).
TORCH_LIBRARY_IMPL(rotary, ADInplaceOrView, m) {
  m.impl("apply_rope_", TORCH_FN(apply_rope_inplace_view));
  m.impl("apply_rope_qk_", TORCH_FN(apply_rope_qk_inplace_view));
  m.impl("apply_rope_with_kv_cache_", TORCH_FN(apply_rope_with_kv_cache_view));
  m.impl("apply_qk_norm_rope_", TORCH_FN(apply_qk_norm_rope_inplace_view));
  m.impl("apply_qk_norm_rope_with_kv_cache_", TORCH_FN(apply_qk_norm_rope_with_kv_cache_view));
}

}  // namespace rotary
