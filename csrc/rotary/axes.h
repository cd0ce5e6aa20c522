// Pair -> axis maps of N-D RoPE: which position axis each frequency pair of
// a head turns by (the `pair_axes` argument of the ops).
#pragma once

#include <cstdint>
#include <vector>

namespace rotary {

// Multimodal RoPE (Qwen2-VL / Qwen2.5-VL, Qwen3-VL) over rotary_dim / 2 pairs
// and sections.size() axes (t, h, w). The sections must sum to rotary_dim / 2.
//   interleaved false (Qwen2-VL): contiguous chunks, pairs [0, s0) take axis
//     0, the next s1 axis 1, and so on.
//   interleaved true (Qwen3-VL): pair j with j mod n = a > 0 and
//     j < n * sections[a] takes axis a; every other pair axis 0 (n axes).
// Throws c10::ValueError naming mrope_section.
std::vector<int64_t> mrope_pair_axes(const std::vector<int64_t>& sections, int64_t rotary_dim, bool interleaved);

}  // namespace rotary
