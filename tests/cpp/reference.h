// Independent float64 reference for RoPE, written from the seed formulas
// (rope.py: x_complex * exp(i * pos * theta_j); rope_from_scratch.py:
// rotate_pairs / rope_half). It never calls the library: no rotary kernels,
// no rotary::rope_freqs, no rotary headers.
//
//   theta_j = base^(-2j/d), j = 0 .. d/2 - 1          (std::pow, double)
//   angle   = pos * theta_j   (negated when inverse): the product in long
//             double (x86: 64-bit mantissa) reduced mod 2*pi there, within
//             about pos * theta_j * 2^-62 rad of exact (1e-7 at 2^40); a
//             double product would err by pos * theta_j * 2^-53
//   interleaved pairs (2j, 2j+1); half pairs (j, j + d/2)
//   y0 = x0 cos - x1 sin,  y1 = x0 sin + x1 cos
//
// Position of token (b, s):
//   no positions            start_pos + s
//   positions 0-d / [B|1]   start_pos + offsets[b] + s      (offsets)
//   positions [B|1, S|1]    start_pos + ids[b][s]           (absolute ids)
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <complex>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

namespace rotary_test {

inline double ref_inv_freq(int64_t j, int64_t dim, double base = 10000.0) {
  return std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(dim));
}

// pos * f reduced mod 2*pi, in long double.
inline double ref_angle(int64_t pos, double f) {
  const long double turn = 2.0L * std::acos(-1.0L);
  return static_cast<double>(std::fmod(static_cast<long double>(pos) * static_cast<long double>(f), turn));
}

// exp(i * pos * theta_j).
inline std::complex<double> ref_freq(int64_t pos, int64_t j, int64_t dim, double base = 10000.0) {
  const double angle = ref_angle(pos, ref_inv_freq(j, dim, base));
  return {std::cos(angle), std::sin(angle)};
}

// Absolute position of token (b, s) following the broadcasting rules above.
class RefPositions {
 public:
  RefPositions(int64_t start_pos, const std::optional<at::Tensor>& positions) : start_pos_(start_pos) {
    if (!positions) return;
    const at::Tensor p = positions->detach().to(at::kCPU).to(at::kLong).contiguous();
    dim_ = p.dim();
    if (dim_ > 2) throw std::invalid_argument("reference: positions must be 0-, 1- or 2-D");
    rows_ = dim_ >= 1 ? p.size(0) : 1;
    cols_ = dim_ == 2 ? p.size(1) : 1;
    values_.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
  }

  int64_t operator()(int64_t b, int64_t s) const {
    if (dim_ < 0) return start_pos_ + s;
    const int64_t r = rows_ == 1 ? 0 : b;
    const int64_t c = cols_ == 1 ? 0 : s;
    const int64_t v = values_.at(static_cast<size_t>(r * cols_ + c));
    return dim_ == 2 ? start_pos_ + v : start_pos_ + v + s;
  }

 private:
  int64_t start_pos_;
  int64_t dim_ = -1;  // -1: no positions tensor
  int64_t rows_ = 1;
  int64_t cols_ = 1;
  std::vector<int64_t> values_;
};

// x: [batch, heads, seq, head_dim], any float dtype and layout, any device.
// Returns a new contiguous float64 CPU tensor; x is not modified.
inline at::Tensor ref_rope(
    const at::Tensor& x,
    int64_t start_pos = 0,
    bool interleaved = true,
    const std::optional<at::Tensor>& positions = std::nullopt,
    bool inverse = false,
    double base = 10000.0) {
  if (x.dim() != 4) throw std::invalid_argument("reference: x must be 4-D");
  const at::Tensor xd = x.detach().to(at::kCPU).to(at::kDouble).contiguous().clone();
  at::Tensor out = at::empty_like(xd);
  const int64_t B = xd.size(0), H = xd.size(1), S = xd.size(2), D = xd.size(3);
  if (D % 2 != 0) throw std::invalid_argument("reference: head_dim must be even");
  const int64_t pairs = D / 2;
  const RefPositions pos_of(start_pos, positions);
  const double sign = inverse ? -1.0 : 1.0;

  auto xa = xd.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  std::vector<double> c(pairs), sn(pairs);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t pos = pos_of(b, s);
      for (int64_t j = 0; j < pairs; ++j) {
        const double angle = sign * ref_angle(pos, ref_inv_freq(j, D, base));
        c[j] = std::cos(angle);
        sn[j] = std::sin(angle);
      }
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t j = 0; j < pairs; ++j) {
          const int64_t i0 = interleaved ? 2 * j : j;
          const int64_t i1 = interleaved ? 2 * j + 1 : j + pairs;
          const double x0 = xa[b][h][s][i0];
          const double x1 = xa[b][h][s][i1];
          oa[b][h][s][i0] = x0 * c[j] - x1 * sn[j];
          oa[b][h][s][i1] = x0 * sn[j] + x1 * c[j];
        }
      }
    }
  }
  return out;
}

// Dims [rotary_offset, rotary_offset + rotary_dim) of x rotated by ref_rope
// at the positions RefPositions gives, the others as they are: float64.
inline at::Tensor ref_rope_span(const at::Tensor& x, int64_t start_pos, bool interleaved, int64_t rotary_offset,
                                int64_t rotary_dim, const std::optional<at::Tensor>& positions = std::nullopt,
                                bool inverse = false) {
  at::Tensor out = x.detach().to(at::kCPU, at::kDouble).contiguous().clone();
  out.narrow(3, rotary_offset, rotary_dim)
      .copy_(ref_rope(out.narrow(3, rotary_offset, rotary_dim), start_pos, interleaved, positions, inverse));
  return out;
}

// The same with N-D positions: pair j of token (b, s) turns by start_pos +
// ids[axes[j], b, s] (ids [n_axes, B, S]). Each pair's dims are taken from
// the 1-D result at its axis's ids.
inline at::Tensor ref_rope_span_nd(const at::Tensor& x, int64_t start_pos, bool interleaved, int64_t rotary_offset,
                                   int64_t rotary_dim, const at::Tensor& ids, const std::vector<int64_t>& axes,
                                   bool inverse = false) {
  std::vector<at::Tensor> by_axis;
  for (int64_t a = 0; a < ids.size(0); ++a) {
    by_axis.push_back(ref_rope_span(x, start_pos, interleaved, rotary_offset, rotary_dim, ids[a], inverse));
  }
  at::Tensor want = by_axis[0].clone();
  const int64_t pairs = rotary_dim / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    for (const int64_t d : {interleaved ? 2 * j : j, interleaved ? 2 * j + 1 : j + pairs}) {
      want.select(3, rotary_offset + d).copy_(by_axis.at(static_cast<size_t>(axes.at(j))).select(3, rotary_offset + d));
    }
  }
  return want;
}

// The prologue's norm (apply_qk_norm_rope) in float64: x [B, H, S, D] over
// sqrt(mean(x^2) + eps), the mean over head_dim (norm "heads": over every
// head and head_dim), times w + offset (w [D], or [H * D] for "heads").
inline at::Tensor ref_norm(const at::Tensor& x, const at::Tensor& w, bool heads, double eps, double offset) {
  const at::Tensor xd = x.detach().to(at::kCPU, at::kDouble);
  const at::Tensor ms = heads ? (xd * xd).mean({1, 3}, true) : (xd * xd).mean({3}, true);
  const at::Tensor wd = w.detach().to(at::kCPU, at::kDouble) + offset;
  return xd / at::sqrt(ms + eps) * (heads ? wd.view({1, x.size(1), 1, x.size(3)}) : wd);
}

// ref_rope_span at 1-D positions (axes empty), or ref_rope_span_nd at N-D
// ids (positions [n_axes, B, S]) with pair j on axes[j]: the one choice.
inline at::Tensor ref_rope_at(const at::Tensor& x, int64_t start_pos, bool interleaved, int64_t rotary_offset,
                              int64_t rotary_dim, const std::optional<at::Tensor>& positions,
                              const std::vector<int64_t>& axes = {}, bool inverse = false) {
  return axes.empty() ? ref_rope_span(x, start_pos, interleaved, rotary_offset, rotary_dim, positions, inverse)
                      : ref_rope_span_nd(x, start_pos, interleaved, rotary_offset, rotary_dim, positions.value(), axes,
                                         inverse);
}

// The prologue: ref_norm, then ref_rope_at.
inline at::Tensor ref_norm_rope(const at::Tensor& x, const at::Tensor& w, bool heads, double eps, double offset,
                                int64_t start_pos, bool interleaved, int64_t rotary_offset, int64_t rotary_dim,
                                const std::optional<at::Tensor>& positions = std::nullopt,
                                const std::vector<int64_t>& axes = {}) {
  return ref_rope_at(ref_norm(x, w, heads, eps, offset), start_pos, interleaved, rotary_offset, rotary_dim, positions,
                     axes);
}

}  // namespace rotary_test
