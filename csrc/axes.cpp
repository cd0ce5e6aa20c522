// The pair -> axis maps of N-D RoPE (rotary/axes.h), validated here once for
// the C++ module, the Python module and from_hf_config.
#include <rotary/axes.h>

#include "rope_params.h"

#include <c10/util/Exception.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/irange.h>

#include <numeric>

namespace rotary {

std::vector<int64_t> mrope_pair_axes(const std::vector<int64_t>& sections, int64_t rotary_dim, bool interleaved) {
  const int64_t n = static_cast<int64_t>(sections.size());
  TORCH_CHECK_VALUE(
      n >= 1 && n <= kernel::kMaxAxes, "mrope_section must have 1 to ", kernel::kMaxAxes,
      " entries (pairs per position axis), got ", n);
  for (const auto i : c10::irange(n)) {
    TORCH_CHECK_VALUE(sections[i] >= 0, "mrope_section[", i, "] must be >= 0, got ", sections[i]);
  }
  const int64_t pairs = rotary_dim / 2;
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

}  // namespace rotary
