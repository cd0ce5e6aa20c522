// Validation and launch description of apply_rope_with_kv_cache_, on top of
// the RoPE ones (checks.h): every backend and Meta share the messages.
#pragma once

#include "checks.h"
#include "params/kv_params.h"

namespace rotary {
namespace detail {

// The cache arguments, in schema order.
struct KVArgs {
  const std::optional<at::Tensor>& cache_positions;  // contiguous caches: row of each token
  const std::optional<at::Tensor>& slot_mapping;     // paged caches: flat slot of each token, -1 skips
  CacheLayoutName kv_layout;                          // BHSD, BSHD (contiguous), NHD, HND (paged)
  const std::optional<at::Tensor>& k_scale;           // float8_e4m3fn caches: float32 [] / [1] / [heads]
  const std::optional<at::Tensor>& v_scale;
};

// The KV op's call as validated: the RoPE call it extends and the views
// of v and of the caches ([outer, heads, inner, head_dim], kv_params.h).
struct KVCall {
  RopeCall rope;
  at::Tensor v, k_cache, v_cache;
  c10::SymIntArrayRef k_cache_shape;  // as passed, for messages
};

// Shape, dtype and device checks that need no tensor values (Meta-safe).
KVCall check_kv_inputs(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv);

struct PreparedKV {
  PreparedRope rope;  // q and k in place
  at::Tensor dest;    // slot_mapping / cache_positions as read (int32 or int64)
  kernel::KVCacheParams params;
};

// A host fp8 scale divides every value written: 0, NaN, inf or a negative
// one would write inf / NaN / flipped signs, so each is refused by name
// (`stored`: what holds x / scale, for the message). Device scales are not
// read (that would sync).
void check_scale_values(
    const char* op, const char* name, const std::optional<at::Tensor>& s, const char* stored = "the cache stores");

// Everything check_kv_inputs checks, plus aliasing, and by value every slot
// and cache position known on the host. Nothing is written before it returns.
PreparedKV prepare_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv);
// The same for a call check_kv_inputs has validated already.
PreparedKV prepare_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& freqs,
    const KVCall& call, const KVArgs& kv);

}  // namespace detail
}  // namespace rotary
