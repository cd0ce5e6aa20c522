// The prologue op's checks (apply_qk_norm_rope): the rotation's call as
// check_rope_inputs builds it, extended with the norm's arguments. One
// validator for CPU, CUDA and Meta.
#pragma once

#include "checks.h"
#include "kv_checks.h"
#include "params/norm_params.h"

#include <initializer_list>
#include <utility>

namespace rotary {
namespace detail {

// The norm's arguments, in the field order of ROTARY_NORM_ARGS.
struct NormArgs {
  const std::optional<at::Tensor>& q_weight;
  const std::optional<at::Tensor>& k_weight;
  double eps = 1e-6;
  c10::string_view norm;
  double weight_offset = 0.0;
  const std::optional<at::Tensor>& q_fp8_scale;
};

// A call as validated: the rotation's, plus the norm's (Meta-safe).
struct NormCall {
  RopeCall rope;
  kernel::NormKind kind = kernel::NormKind::kHead;
  const at::Tensor* weight[2] = {nullptr, nullptr};  // q's, k's; null: ones
  double eps = 1e-6;
  double weight_offset = 0.0;
  const at::Tensor* q_fp8_scale = nullptr;  // out of place only: q returned as float8_e4m3fn
};

// norm "head" or "heads"; anything else a ValueError naming op.
kernel::NormKind parse_norm(const char* op, c10::string_view norm);

// in_place: the in-place ops (their q keeps its dtype: no q_fp8_scale).
NormCall check_norm_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm, bool in_place);
// The norm's part, for a rotation validated already (the KV op's).
NormCall check_norm_args(const char* op, RopeCall rope, const at::Tensor& q, const NormArgs& norm, bool in_place);

// The out-of-place q: q's dtype, or float8_e4m3fn with q_fp8_scale (Meta too).
at::Tensor make_q_output(const at::Tensor& q, const NormCall& call);

// The weights as the kernels read them, and the norm's launch description.
struct NormWeights {
  at::Tensor weight[2];  // what params.weight points at (undefined: none)
  kernel::NormParams params;
};
// In place, each weight must not overlap what the call writes (`written`).
NormWeights prepare_norm_weights(
    const char* op, const NormCall& call, const at::Tensor& q, bool in_place,
    std::initializer_list<std::pair<const char*, const at::Tensor*>> written);

struct PreparedNormRope {
  PreparedRope rope;
  NormWeights norm;
};

// Validates, allocates (or aliases, in place) and fills both launch
// descriptions; nothing is written before it returns.
PreparedNormRope prepare_norm_rope(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm, bool in_place);

struct PreparedNormKV {
  PreparedKV kv;  // q and k in place, and the caches
  NormWeights norm;
};

// The KV op's checks and preparation (kv_checks.h) plus the norm's; nothing
// is written before it returns.
PreparedNormKV prepare_norm_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv,
    const NormArgs& norm);

}  // namespace detail
}  // namespace rotary
