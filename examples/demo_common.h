// The demo's shared pieces: timing, shapes, and the reference formula.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace demo {

using torch::Tensor;
using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline std::string shape(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? "," : "") + std::to_string(t.size(i));
  return s + "]";
}

// The reference formula (the paper's complex multiply), in plain torch ops: pairs (2j, 2j+1) as
// complex numbers, multiplied by rows start_pos .. start_pos+seq of the table.
inline Tensor reference_apply_rope(const Tensor& x, const Tensor& freqs, int64_t start_pos) {
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  auto f = freqs.slice(0, start_pos, start_pos + s).unsqueeze(0).unsqueeze(0);
  auto xc = torch::view_as_complex(x.to(torch::kFloat).reshape({b, h, s, d / 2, 2}));
  return torch::view_as_real(xc * f).reshape({b, h, s, d}).type_as(x);
}

}  // namespace demo
