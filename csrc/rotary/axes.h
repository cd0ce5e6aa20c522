// Pair -> axis maps of N-D RoPE: which position axis each frequency pair of
// a head turns by (the `pair_axes` argument of the ops).
#pragma once

#include <rotary/freqs.h>

#include <c10/util/ArrayRef.h>

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

// Axial RoPE over axes_dim.size() position axes: axis a owns the next
// axes_dim[a] / 2 pairs (contiguous blocks, in order).
//   shared_spectrum false (FLUX, axes_dim {16, 56, 56}): axis a turns at
//     theta_a^(-2i / axes_dim[a]), its own spectrum; thetas holds one theta
//     per axis, or one for all.
//   shared_spectrum true (Pixtral 2-D): one spectrum theta^(-2k / dim) over
//     dim = sum(axes_dim) is dealt out, axis a taking k = a, a + n, ...; the
//     axes_dim must be equal and thetas a single value.
// Throws c10::ValueError "<who>: ..." naming axes_dim / axes_theta.
struct AxialRope {
  std::vector<int64_t> pair_axes;
  RopeFrequencies freqs;
};
AxialRope axial_rope(const std::vector<int64_t>& axes_dim, const std::vector<double>& thetas, bool shared_spectrum,
                     const char* who = "axial_rope");

// Throws c10::ValueError "<who>: pair_axes[j] must be an axis index in
// [0, 16), got ..." at the first entry outside; the module and the ops both.
void check_axis_indices(const char* who, c10::ArrayRef<int64_t> pair_axes);

struct RotaryEmbeddingOptions;
// The pair -> axis map a module with these options passes as pair_axes:
// from mrope_section or axes_dim, or the explicit pair_axes (each entry
// checked); empty for 1-D RoPE.
std::vector<int64_t> pair_axes_of(const RotaryEmbeddingOptions& options);

}  // namespace rotary
