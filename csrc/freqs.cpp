#include <rotary/freqs.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/complex.h>

#include <cmath>
#include <vector>

namespace rotary {

at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta) {
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, "rope_freqs: dim must be even and > 0, got ", dim);
  TORCH_CHECK_VALUE(max_seq_len >= 0, "rope_freqs: max_seq_len must be >= 0, got ", max_seq_len);
  TORCH_CHECK_VALUE(
      std::isfinite(theta) && theta > 0.0, "rope_freqs: theta must be finite and > 0, got ", theta);
  const int64_t pairs = dim / 2;
  std::vector<double> inv_freq(pairs);
  for (int64_t j = 0; j < pairs; ++j) {
    inv_freq[j] = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(dim));
  }

  auto table = at::empty({max_seq_len, pairs}, at::TensorOptions().dtype(at::kComplexFloat));
  auto* out = table.data_ptr<c10::complex<float>>();
  // Angle, cos and sin all in float64; one rounding to float at the end keeps
  // the table within ~6e-8 of exact even at millions of positions.
  at::parallel_for(0, max_seq_len, 256, [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos) {
      for (int64_t j = 0; j < pairs; ++j) {
        const double angle = static_cast<double>(pos) * inv_freq[j];
        out[pos * pairs + j] =
            c10::complex<float>(static_cast<float>(std::cos(angle)), static_cast<float>(std::sin(angle)));
      }
    }
  });
  return table;
}

}  // namespace rotary
