// The prologue op's checks (apply_qk_norm_rope): the rotation's call as
// check_rope_inputs builds it, extended with the norm's arguments. One
// validator for CPU, CUDA and Meta.
#pragma once

#include "checks.h"
#include "params/norm_params.h"

namespace rotary {
namespace detail {

// The norm's arguments, in the field order of ROTARY_NORM_ARGS.
struct NormArgs {
  const std::optional<at::Tensor>& q_weight;
  const std::optional<at::Tensor>& k_weight;
  double eps = 1e-6;
  c10::string_view norm;
  double weight_offset = 0.0;
};

// A call as validated: the rotation's, plus the norm's (Meta-safe).
struct NormCall {
  RopeCall rope;
  kernel::NormKind kind = kernel::NormKind::kHead;
  const at::Tensor* weight[2] = {nullptr, nullptr};  // q's, k's; null: ones
  double eps = 1e-6;
  double weight_offset = 0.0;
};

NormCall check_norm_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm);

// The heads axis of q / k as passed (the norm "heads" reduces over it and
// head_dim).
int64_t heads_axis(Layout layout, bool varlen);

struct PreparedNormRope {
  PreparedRope rope;
  at::Tensor weight[2];  // weight + weight_offset, in the accumulation type
  kernel::NormParams norm;
};

// Validates, allocates (or aliases, in place) and fills both launch
// descriptions; nothing is written before it returns.
PreparedNormRope prepare_norm_rope(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
    const NormArgs& norm, bool in_place);

}  // namespace detail
}  // namespace rotary
