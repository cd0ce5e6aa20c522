// float8_e4m3fn encoding shared by the KV-cache write and the prologue's
// fp8 q: framework-free, host and device.
#pragma once

#include "rope_params.h"

#include <cstdint>
#include <cstring>

namespace rotary {
namespace kernel {

// float -> float8_e4m3fn bits, round to nearest even; |f| >= 480 and NaN give
// NaN (0x7f). The same arithmetic as c10's fp8e4m3fn_from_fp32_value, so the
// cache holds the bits torch's .to(torch.float8_e4m3fn) gives.
ROTARY_HOST_DEVICE uint8_t fp8_e4m3fn_bits(float f) {
  uint32_t bits = bits_of_float(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (1087u << 20)) {
    result = 0x7f;
  } else if (bits < (121u << 23)) {  // below 2^-6: subnormal, rounded by a float add
    constexpr uint32_t denorm_bits = 141u << 23;
    const float summed = float_of_bits(bits) + float_of_bits(denorm_bits);
    result = static_cast<uint8_t>(bits_of_float(summed) - denorm_bits);
  } else {
    const uint32_t mant_odd = (bits >> 20) & 1u;
    bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + mant_odd;
    result = static_cast<uint8_t>(bits >> 20);
  }
  return static_cast<uint8_t>(result | (sign >> 24));
}

// v / scale clamped to +-448 and rounded to float8_e4m3fn, the division in
// acc_t (float32, or float64 for double data), once: the bits of torch's
// (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).
// The scale by value (`scaled` false: none), for callers that hold it in a
// register.
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, bool scaled, float scale) {
  if (scaled) v = v / static_cast<acc_t>(scale);
  v = v > acc_t(448) ? acc_t(448) : (v < acc_t(-448) ? acc_t(-448) : v);  // NaN stays NaN
  return fp8_e4m3fn_bits(static_cast<float>(v));
}
template <typename acc_t>
ROTARY_HOST_DEVICE uint8_t quantize_fp8(acc_t v, const float* scale) {
  return quantize_fp8<acc_t>(v, scale != nullptr, scale != nullptr ? *scale : 1.0f);
}

}  // namespace kernel
}  // namespace rotary
