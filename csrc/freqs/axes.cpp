// The pair -> axis maps of N-D RoPE (rotary/axes.h), validated here once for
// the C++ module, the Python module and from_hf_config.
#include <rotary/axes.h>
#include <rotary/options.h>

#include "params/rope_params.h"

#include <c10/util/Exception.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/irange.h>

#include <cmath>
#include <algorithm>
#include <numeric>

namespace rotary {

std::vector<int64_t> mrope_pair_axes(const std::vector<int64_t>& sections, int64_t rotary_dim, bool interleaved) {
  const int64_t n = static_cast<int64_t>(sections.size());
  TORCH_CHECK_VALUE(
      n >= 1 && n <= kernel::kMaxAxes, "mrope_section must have 1 to ", kernel::kMaxAxes,
      " entries (pairs per position axis), got ", n);
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % 2 == 0,
                    "mrope_pair_axes: rotary_dim must be even and > 0 (RoPE rotates pairs of dims), got ", rotary_dim);
  const int64_t pairs = rotary_dim / 2;
  // Each entry in (0, pairs] first, so the sum below cannot wrap; an empty
  // section would leave an axis that no pair reads.
  for (const auto i : c10::irange(n)) {
    TORCH_CHECK_VALUE(
        sections[i] > 0 && sections[i] <= pairs, "mrope_section[", i, "] must be in [1, rotary_dim / 2 = ", pairs,
        "] (pairs of that position axis), got ", sections[i]);
  }
  const int64_t sum = std::accumulate(sections.begin(), sections.end(), int64_t{0});
  TORCH_CHECK_VALUE(
      sum == pairs, "mrope_section ", c10::ArrayRef<int64_t>(sections), " must sum to rotary_dim / 2 = ", pairs,
      " (one entry per frequency pair), got ", sum);
  std::vector<int64_t> axes(pairs, 0);
  if (interleaved) {
    for (const auto j : c10::irange(pairs)) {
      const int64_t a = j % n;
      if (a > 0 && j < n * sections[a]) axes[j] = a;
    }
  } else {
    int64_t j = 0;
    for (const auto a : c10::irange(n)) {
      for (int64_t i = 0; i < sections[a]; ++i) axes[j++] = a;
    }
  }
  return axes;
}

AxialRope axial_rope(const std::vector<int64_t>& axes_dim, const std::vector<double>& thetas, bool shared_spectrum,
                     const char* who) {
  const int64_t n = static_cast<int64_t>(axes_dim.size());
  TORCH_CHECK_VALUE(
      n >= 1 && n <= kernel::kMaxAxes, who, ": axes_dim must have 1 to ", kernel::kMaxAxes,
      " entries (dims per axis), got ", n);
  for (const auto a : c10::irange(n)) {
    TORCH_CHECK_VALUE(
        axes_dim[a] > 0 && axes_dim[a] % 2 == 0 && axes_dim[a] <= 2 * kernel::kMaxPairs, who, ": axes_dim[", a,
        "] must be even and in [2, ", 2 * kernel::kMaxPairs, "], got ", axes_dim[a]);
  }
  const int64_t nt = static_cast<int64_t>(thetas.size());
  TORCH_CHECK_VALUE(
      nt == 1 || nt == n, who, ": axes_theta must hold one theta, or one per axis (", n, "), got ", nt, " values");
  for (const auto i : c10::irange(nt)) {
    TORCH_CHECK_VALUE(
        std::isfinite(thetas[i]) && thetas[i] > 0.0, who, ": axes_theta[", i, "] must be finite and > 0, got ",
        thetas[i]);
  }
  const int64_t dim = std::accumulate(axes_dim.begin(), axes_dim.end(), int64_t{0});
  if (shared_spectrum) {
    TORCH_CHECK_VALUE(
        nt == 1 && std::all_of(axes_dim.begin(), axes_dim.end(), [&](int64_t d) { return d == axes_dim[0]; }),
        who, ": a shared spectrum (Pixtral) needs equal axes_dim and one theta, got axes_dim ",
        c10::ArrayRef<int64_t>(axes_dim), " and ", nt, " thetas");
  }
  AxialRope out;
  for (const auto a : c10::irange(n)) {
    const double theta = thetas[nt == 1 ? 0 : a];
    for (int64_t i = 0; i < axes_dim[a] / 2; ++i) {
      out.pair_axes.push_back(a);
      // Own spectrum: pair i of a head of axes_dim[a]; shared: entry a + n i of one head of dim.
      const double k = shared_spectrum ? static_cast<double>(a + n * i) : static_cast<double>(i);
      const double d = shared_spectrum ? static_cast<double>(dim) : static_cast<double>(axes_dim[a]);
      out.freqs.inv_freq.push_back(std::pow(theta, -2.0 * k / d));
    }
  }
  return out;
}

void check_axis_indices(const char* who, c10::ArrayRef<int64_t> pair_axes) {
  for (const auto j : c10::irange(pair_axes.size())) {
    TORCH_CHECK_VALUE(pair_axes[j] >= 0 && pair_axes[j] < kernel::kMaxAxes, who, ": pair_axes[", j,
                      "] must be an axis index in [0, ", kernel::kMaxAxes, "), got ", pair_axes[j]);
  }
}

std::vector<int64_t> pair_axes_of(const RotaryEmbeddingOptions& o) {
  if (o.mrope_section().empty() && o.axes_dim().empty() && o.pair_axes().empty()) return {};
  // At construction, not at the first call: the ops' pair_axes limit.
  TORCH_CHECK_VALUE(
      o.dim() / 2 <= kernel::kMaxPairs, "RotaryEmbedding: N-D positions (mrope_section, axes_dim, pair_axes) turn ",
      "at most ", kernel::kMaxPairs, " pairs, got dim / 2 = ", o.dim() / 2);
  if (!o.mrope_section().empty()) return mrope_pair_axes(o.mrope_section(), o.dim(), o.mrope_interleaved());
  if (!o.pair_axes().empty()) {
    const auto& axes = o.pair_axes();
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(axes.size()) == o.dim() / 2, "RotaryEmbedding: pair_axes must have one entry per pair, ",
        "dim / 2 = ", o.dim() / 2, ", got ", axes.size());
    check_axis_indices("RotaryEmbedding", axes);
    return axes;
  }
  const auto thetas = o.axes_theta().empty() ? std::vector<double>{o.theta()} : o.axes_theta();
  return axial_rope(o.axes_dim(), thetas, o.axes_shared_spectrum(), "RotaryEmbedding").pair_axes;
}

}  // namespace rotary
