// The one bound on positions and the checked integer tests every validator
// uses. Each test is written so it cannot wrap: `offset <= total - len`, never
// `offset + len <= total`, for any int64 the user passes.
#pragma once

#include <cstdint>

namespace rotary {

// start_pos, offsets, ids and their sums stay below this, so no position
// arithmetic overflows int64 (2^60 + 2^60 + a sequence index < 2^63).
constexpr int64_t kMaxPosition = int64_t{1} << 60;

// The widest rotated span a table is built for: a head's width, with room to
// spare (a larger one named here, not as a failed allocation of its pairs).
constexpr int64_t kMaxRotaryDim = int64_t{1} << 20;

namespace bounds {

// [offset, offset + len) lies inside [0, total).
template <typename T>
constexpr bool span_fits(int64_t offset, const T& len, const T& total) {
  return offset >= 0 && len >= 0 && len <= total && offset <= total - len;
}

// A position (start_pos, an offset, an id) inside (-2^60, 2^60).
constexpr bool position_in_range(int64_t v) {
  return v > -kMaxPosition && v < kMaxPosition;
}

// A start_pos in [0, 2^60).
constexpr bool start_pos_in_range(int64_t v) {
  return v >= 0 && v < kMaxPosition;
}

}  // namespace bounds
}  // namespace rotary
