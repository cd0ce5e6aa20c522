// Framework-free description of the q/k RMSNorm that the prologue op
// (apply_qk_norm_rope) applies before the rotation, shared by the CPU and
// CUDA kernels. No torch headers: the CUDA translation units include it.
#pragma once

#include "fp8.h"
#include "rope_params.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

enum class NormKind : uint8_t {
  kHead,   // each head vector over its head_dim (Qwen3, Gemma 3)
  kHeads,  // all heads of one token together (OLMo2)
};

struct NormParams {
  NormKind kind = NormKind::kHead;
  // q's and k's weight, contiguous: [head_dim] for kHead, [heads *
  // head_dim] of that tensor for kHeads; null for none (ones). Both are read
  // in the accumulation type (double for float64 tensors, float otherwise)
  // when weight_acc, else in the tensors' dtype: the caller's own weights,
  // no per-call copy. One flag for both, so the CUDA kernel reads it from
  // the parameters. weight_offset is added as weight_of says.
  const void* weight[2] = {nullptr, nullptr};
  bool weight_acc = true;
  double weight_offset = 0;
  double eps = 0;
  // q written as float8_e4m3fn (q.out then holds bytes): (value / scale)
  // clamped to +-448, rounded to nearest even; the scale of q head h at
  // q_scale[h * q_scale_stride] (stride 0: one per tensor). Null: q as k.
  const float* q_scale = nullptr;
  int64_t q_scale_stride = 0;
};

// 1 / sqrt(mean square + eps). Division and square root are correctly
// rounded on the host and on the device (nvcc's defaults), so the host
// emulation gives the kernel's bits for the same sum.
template <typename acc_t>
ROTARY_HOST_DEVICE acc_t rms_scale(acc_t sumsq, int64_t count, double eps) {
  const acc_t ms = sumsq / static_cast<acc_t>(count) + static_cast<acc_t>(eps);
#if defined(__CUDA_ARCH__)
  return acc_t(1) / sqrt(ms);
#else
  return acc_t(1) / std::sqrt(ms);
#endif
}

// Element d of a weight as the norm multiplies by it: w[d] (1 without a
// weight) in acc_t, plus the offset when there is one (Gemma's 1 + w; added
// only when non-zero, so a -0 weight keeps its sign as it would unshifted).
// weight_element: the same for a weight known to be stored as E (null: none).
template <typename E, typename acc_t>
ROTARY_HOST_DEVICE acc_t weight_element(const E* w, acc_t offset, int64_t d) {
  const acc_t x = w != nullptr ? static_cast<acc_t>(w[d]) : acc_t(1);
  return offset != acc_t(0) ? x + offset : x;
}
template <typename T, typename acc_t>
ROTARY_HOST_DEVICE acc_t weight_of(const void* w, bool in_acc, acc_t offset, int64_t d) {
  // One dtype: no flag to test.
  if (std::is_same_v<T, acc_t> || w == nullptr || in_acc) {
    return weight_element(static_cast<const acc_t*>(w), offset, d);
  }
  return weight_element(static_cast<const T*>(w), offset, d);
}

// One element normalized: x times its vector's scale, then its weight (the
// order of Hugging Face's RMSNorm), all in acc_t.
template <typename acc_t>
ROTARY_HOST_DEVICE acc_t normalized(acc_t x, acc_t scale, acc_t weight) {
  return (x * scale) * weight;
}

}  // namespace kernel
}  // namespace rotary
