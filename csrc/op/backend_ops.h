// The four rotary ops for one backend, generated from that backend's single
// launch function, so CPU and CUDA share validation, allocation and the
// in-place rules, and differ only in how they run the kernel.
#pragma once

#include "checks/checks.h"
#include <rotary/op_args.h>

#include <ATen/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

namespace rotary {
namespace detail {

using OptTensor = std::optional<at::Tensor>;
using RunKernel = void (*)(const PreparedRope&, at::ScalarType);

template <RunKernel Run>
struct BackendOps {
  static at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS) {
    return launch("apply_rope", x, nullptr, freqs, {ROTARY_ROPE_NAME_LIST}, /*in_place=*/false).out_q;
  }

  static std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS) {
    auto r = launch("apply_rope_qk", q, &k, freqs, {ROTARY_ROPE_NAME_LIST}, /*in_place=*/false);
    return {r.out_q, r.out_k};
  }

  static void apply_rope_(at::Tensor& x, const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS) {
    launch("apply_rope_", x, nullptr, freqs, {ROTARY_ROPE_NAME_LIST}, /*in_place=*/true);
  }

  static void apply_rope_qk_(at::Tensor& q, at::Tensor& k, const at::Tensor& freqs ROTARY_ROPE_KERNEL_PARAMS) {
    launch("apply_rope_qk_", q, &k, freqs, {ROTARY_ROPE_NAME_LIST}, /*in_place=*/true);
  }

  static void register_all(torch::Library& m) {
    m.impl("apply_rope", &apply_rope);
    m.impl("apply_rope_qk", &apply_rope_qk);
    m.impl("apply_rope_", &apply_rope_);
    m.impl("apply_rope_qk_", &apply_rope_qk_);
  }

 private:
  static PreparedRope launch(
      const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
      bool in_place) {
    const c10::OptionalDeviceGuard guard(at::device_of(q));
    auto prepared = prepare_rope(op, q, k, freqs, args, in_place);
    if (prepared.params.batch * prepared.params.seq > 0) Run(prepared, q.scalar_type());
    return prepared;
  }
};

}  // namespace detail
}  // namespace rotary
