// Part 1 of the demo: the paper's relative-position proof, run through
// rotary::RotaryEmbedding.
#pragma once

#include "demo_common.h"

#include <rotary/rotary.h>

#include <cmath>
#include <cstdio>

namespace demo {

// The 2017 sinusoidal vector for one position: sin in even dims, cos in odd.
inline Tensor sinusoidal(int64_t pos, int64_t dim, double base) {
  auto i = torch::arange(dim / 2, torch::kFloat64);
  auto angle = pos * torch::pow(base, -2.0 * i / dim);
  auto pe = torch::empty({dim}, torch::kFloat64);
  pe.slice(0, 0, dim, 2).copy_(torch::sin(angle));
  pe.slice(0, 1, dim, 2).copy_(torch::cos(angle));
  return pe;
}

// One row of the usual fp32-angle table: angle pos * theta_j in float32.
inline Tensor fp32_angle_row(int64_t pos, int64_t dim, double base) {
  auto inv = 1.0 / torch::pow(base, torch::arange(0, dim, 2, torch::kFloat) / dim);
  auto angle = torch::full({1}, static_cast<float>(pos)) * inv;  // float32, as the usual tables do
  return torch::polar(torch::ones_like(angle), angle).unsqueeze(0);  // [1, dim/2]
}

inline bool relative_position_proof() {
  constexpr int64_t kDim = 64, kOffset = 2;
  constexpr double kBase = 10000.0;
  const std::vector<int64_t> starts = {2, 5, 9, 14, 20, 1000, 4000, 32768, 131072};

  torch::manual_seed(7);
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(kDim).max_seq_len(starts.back() + 1).theta(kBase));
  auto q = torch::randn({kDim}, torch::kFloat64);
  auto k = torch::randn({kDim}, torch::kFloat64);
  auto rotated = [&](const Tensor& v, int64_t pos) {
    return rope->forward(v.view({1, 1, 1, kDim}), pos).view({kDim});
  };
  auto fp32_rotated = [&](const Tensor& v, int64_t pos) {
    return reference_apply_rope(v.view({1, 1, 1, kDim}), fp32_angle_row(pos, kDim, kBase), 0).view({kDim});
  };

  std::printf("[1/3] Relative position: q.k at a fixed offset m - n = %lld, dim %lld\n",
              static_cast<long long>(kOffset), static_cast<long long>(kDim));
  std::printf("  %7s %7s  %12s  %15s  %15s\n", "m", "n", "rotary", "sinusoidal-add", "fp32-angle table");
  std::vector<double> r, a, s;
  for (int64_t m : starts) {
    const int64_t n = m - kOffset;
    r.push_back(torch::dot(rotated(q, m), rotated(k, n)).item<double>());
    a.push_back(torch::dot(q + sinusoidal(m, kDim, kBase), k + sinusoidal(n, kDim, kBase)).item<double>());
    s.push_back(torch::dot(fp32_rotated(q, m), fp32_rotated(k, n)).item<double>());
    std::printf("  %7lld %7lld  %12.8f  %15.8f  %15.8f\n", static_cast<long long>(m), static_cast<long long>(n),
                r.back(), a.back(), s.back());
  }
  std::vector<double> by_offset;
  for (int64_t d : {0, 1, 3, 6}) by_offset.push_back(torch::dot(rotated(q, 10 + d), rotated(k, 10)).item<double>());

  auto spread = [](const std::vector<double>& v) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    return *hi - *lo;
  };
  const double rope_spread = spread(r), add_spread = spread(a), fp32_spread = spread(s);
  const double offset_spread = spread(by_offset);
  std::printf("  spread over m: rotary %.1e (table rounding), sinusoidal-add %.4f (absolute position leaks),\n"
              "                 fp32-angle table %.1e (angle rounded in float32 at large m)\n",
              rope_spread, add_spread, fp32_spread);
  std::printf("  rotary score at offsets 0, 1, 3, 6: %.4f, %.4f, %.4f, %.4f (it does depend on the offset)\n",
              by_offset[0], by_offset[1], by_offset[2], by_offset[3]);
  const bool ok = std::isfinite(rope_spread) && rope_spread < 1e-5 && add_spread > 1e-3 && offset_spread > 1e-3;
  std::printf("  ROPE IS RELATIVE-POSITION INVARIANT: %s\n\n", ok ? "YES" : "NO");
  return ok;
}

}  // namespace demo
