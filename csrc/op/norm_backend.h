// The prologue op's two kernels for one backend, from that backend's single
// launch function, as backend_ops.h does for the RoPE ops: validation,
// allocation and the in-place rules are shared by CPU and CUDA.
#pragma once

#include "checks/norm_checks.h"
#include <rotary/op_args.h>

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

namespace rotary {
namespace detail {

using RunNormKernel = void (*)(const PreparedNormRope&, at::ScalarType);

template <RunNormKernel Run>
struct NormBackendOps {
  static std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope(
      const at::Tensor& q, const at::Tensor& k,
      const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS ROTARY_NORM_KERNEL_PARAMS) {
    auto r = launch("apply_qk_norm_rope", q, k, freqs, {ROTARY_ROPE_NAME_LIST}, {ROTARY_NORM_NAME_LIST}, false);
    return {r.rope.out_q, r.rope.out_k};
  }

  static void apply_qk_norm_rope_(
      at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS ROTARY_NORM_KERNEL_PARAMS) {
    launch("apply_qk_norm_rope_", q, k, freqs, {ROTARY_ROPE_NAME_LIST}, {ROTARY_NORM_NAME_LIST}, true);
  }

  static void register_all(torch::Library& m) {
    m.impl("apply_qk_norm_rope", &apply_qk_norm_rope);
    m.impl("apply_qk_norm_rope_", &apply_qk_norm_rope_);
  }

 private:
  static PreparedNormRope launch(
      const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, const RopeArgs& args,
      const NormArgs& norm, bool in_place) {
    const c10::OptionalDeviceGuard guard(at::device_of(q));
    auto prepared = prepare_norm_rope(op, q, k, freqs, args, norm, in_place);
    const auto& p = prepared.rope.params;
    if (p.batch * p.seq > 0) Run(prepared, q.scalar_type());
    return prepared;
  }
};

}  // namespace detail
}  // namespace rotary
