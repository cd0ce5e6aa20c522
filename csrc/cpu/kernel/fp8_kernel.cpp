// The fp8 row (fp8_kernel.h) for one CPU capability: whole vectors through
// store_fp8 (vec_isa.h), the tail and float64 data through the scalar
// kernel::quantize_fp8.
#include "fp8_kernel.h"
#include "vec_isa.h"

#include "params/fp8.h"

#include <ATen/OpMathType.h>

#include <type_traits>

namespace rotary {
namespace cpu {
namespace CPU_CAPABILITY {

template <typename scalar_t>
void quantize_fp8_row(const scalar_t* x, int64_t n, const float* scale, uint8_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t i = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
    constexpr int64_t L = Vectorized<float>::size();
    for (; i + L <= n; i += L) store_fp8(out + i, load<scalar_t, float>(x + i), scale);
  }
  for (; i < n; ++i) out[i] = kernel::quantize_fp8(static_cast<acc_t>(x[i]), scale);
}

template void quantize_fp8_row<float>(const float*, int64_t, const float*, uint8_t*);
template void quantize_fp8_row<double>(const double*, int64_t, const float*, uint8_t*);
template void quantize_fp8_row<c10::Half>(const c10::Half*, int64_t, const float*, uint8_t*);
template void quantize_fp8_row<c10::BFloat16>(const c10::BFloat16*, int64_t, const float*, uint8_t*);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace rotary
