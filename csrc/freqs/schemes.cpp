// Sinusoidal table and ALiBi, as first described: float64 math, one rounding.
#include <rotary/schemes.h>

#include "freqs/host_tensor.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace rotary {

namespace {

// n_heads for the float64 slopes both schemes start from, plus `out_bytes`
// per head the caller keeps beside them: one sizing, named for `who`.
void check_slopes(const char* who, int64_t n_heads, uint64_t out_bytes) {
  TORCH_CHECK_VALUE(n_heads > 0, who, ": n_heads must be > 0, got ", n_heads);
  detail::check_host_bytes(who, {n_heads}, sizeof(double) + out_bytes, out_bytes ? "float32, from float64" : "float64",
                           "n_heads=" + std::to_string(n_heads) + " slopes", "pass a smaller n_heads");
}

std::vector<double> slopes_f64(int64_t n_heads) {
  std::vector<double> m(static_cast<size_t>(n_heads));
  for (int64_t h = 0; h < n_heads; ++h) {
    m[h] = std::pow(2.0, -8.0 * static_cast<double>(h + 1) / static_cast<double>(n_heads));
  }
  return m;
}

}  // namespace

at::Tensor sinusoidal_table(int64_t n, int64_t d, double base) {
  TORCH_CHECK_VALUE(n >= 0, "sinusoidal_table: n (the number of positions) must be >= 0, got ", n);
  TORCH_CHECK_VALUE(d > 0 && d % 2 == 0, "sinusoidal_table: d (the model dim) must be even and > 0, got ", d);
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0.0, "sinusoidal_table: base must be finite and > 0, got ", base);
  detail::check_host_bytes("sinusoidal_table", {n, d}, sizeof(float), "float32",
                           "a table of n=" + std::to_string(n) + " rows x d=" + std::to_string(d), "pass a smaller n");
  at::Tensor pe = detail::host_tensor({n, d}, at::kFloat);
  if (n == 0) return pe;
  // base^(2i/d), the reference divisor, once per pair.
  std::vector<double> div(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    div[i] = std::pow(base, static_cast<double>(2 * i) / static_cast<double>(d));
    // A divisor that underflows to 0 (or a quotient that overflows) would
    // give NaN entries: every table entry must be finite.
    TORCH_CHECK_VALUE(
        div[i] > 0.0 && std::isfinite(static_cast<double>(n - 1) / div[i]), "sinusoidal_table: base = ", base,
        " gives the divisor base^(2i/d) = ", div[i], " at i = ", i, ", so pos / divisor is not finite for pos < n = ",
        n, "; use a base further from 0");
  }
  float* out = pe.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / d), [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos) {
      float* row = out + pos * d;
      for (int64_t i = 0; i < d / 2; ++i) {
        const double theta = static_cast<double>(pos) / div[i];
        row[2 * i] = static_cast<float>(std::sin(theta));
        row[2 * i + 1] = static_cast<float>(std::cos(theta));
      }
    }
  });
  return pe;
}

at::Tensor alibi_slopes(int64_t n_heads) {
  check_slopes("alibi_slopes", n_heads, sizeof(float));
  const auto m = slopes_f64(n_heads);
  at::Tensor out = detail::host_tensor({n_heads}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < n_heads; ++h) o[h] = static_cast<float>(m[h]);
  return out;
}

at::Tensor alibi_bias(int64_t n_heads, int64_t seq_len, bool causal) {
  check_slopes("alibi_bias", n_heads, 0);
  TORCH_CHECK_VALUE(seq_len >= 0, "alibi_bias: seq_len must be >= 0, got ", seq_len);
  detail::check_host_bytes("alibi_bias", {n_heads, seq_len, seq_len}, sizeof(float), "float32",
                           "a bias of n_heads=" + std::to_string(n_heads) + " x seq_len=" + std::to_string(seq_len) +
                               " x seq_len",
                           "pass a smaller seq_len or n_heads");
  const auto m = slopes_f64(n_heads);
  at::Tensor bias = detail::host_tensor({n_heads, seq_len, seq_len}, at::kFloat);
  if (seq_len == 0) return bias;
  float* out = bias.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // One task per (head, query row).
  at::parallel_for(0, n_heads * seq_len, std::max<int64_t>(1, 16384 / seq_len), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / seq_len;
      const int64_t i = task % seq_len;
      float* row = out + task * seq_len;
      for (int64_t j = 0; j < seq_len; ++j) {
        row[j] = causal && j > i ? neg_inf : static_cast<float>(-m[h] * static_cast<double>(std::llabs(i - j)));
      }
    }
  });
  return bias;
}

}  // namespace rotary
