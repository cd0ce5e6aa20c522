// The prologue's CPU kernel (norm_kernel.h), compiled once per capability
// like rope_kernel.cpp: each head vector is read once into an acc_t scratch
// row, its sum of squares taken there, scaled by the RMS and its weight, and
// written rotated (the span) or as is (the other dims), one rounding to the
// storage type. The rotation is rope_kernel's arithmetic on the normalized
// row: the same products and sums.
#include "norm_kernel.h"
#include "vec_isa.h"

#include "params/norm_params.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace rotary {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// Partial sums of the sum of squares: element i goes to part i % kParts on
// every capability (a vector width divides it), so all give the same bits.
constexpr int kParts = 16;

template <typename scalar_t, typename acc_t>
void load_vector(const scalar_t* in, int64_t inner, int64_t n, acc_t* buf) {
  using Vec = Vectorized<acc_t>;
  int64_t i = 0;
  if (inner == 1) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        Vec::loadu(in + i).store(buf + i);
      } else {
        Vectorized<float> v;
        at::vec::load_to_float(in + i, v);
        v.store(buf + i);
      }
    }
    for (; i < n; ++i) buf[i] = static_cast<acc_t>(in[i]);
  } else {
    for (; i < n; ++i) buf[i] = static_cast<acc_t>(in[i * inner]);
  }
}

template <typename acc_t>
acc_t sum_squares(const acc_t* buf, int64_t n) {
  using Vec = Vectorized<acc_t>;
  constexpr int L = Vec::size();
  static_assert(kParts % L == 0, "a vector must divide the partial sums");
  constexpr int V = kParts / L;
  Vec acc[V];
  for (int v = 0; v < V; ++v) acc[v] = Vec(acc_t(0));
  int64_t i = 0;
  for (; i + kParts <= n; i += kParts) {
    for (int v = 0; v < V; ++v) {
      const Vec x = Vec::loadu(buf + i + v * L);
      acc[v] = acc[v] + x * x;
    }
  }
  __at_align__ acc_t part[kParts];
  for (int v = 0; v < V; ++v) acc[v].store(part + v * L);
  for (; i < n; ++i) part[i % kParts] += buf[i] * buf[i];
  for (int w = kParts / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  }
  return part[0];
}

template <typename acc_t>
void scale_vector(acc_t* buf, int64_t n, acc_t scale, const acc_t* w) {
  using Vec = Vectorized<acc_t>;
  const Vec sv(scale);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(buf + i) * sv * Vec::loadu(w + i)).store(buf + i);
  for (; i < n; ++i) buf[i] = kernel::normalized(buf[i], scale, w[i]);
}

// Dims [from, to) of a normalized row, unrotated.
template <typename scalar_t, typename acc_t>
void put_plain(const acc_t* y, scalar_t* out, int64_t inner, int64_t from, int64_t to) {
  using Vec = Vectorized<acc_t>;
  int64_t i = from;
  if (inner == 1) {
    for (; i + Vec::size() <= to; i += Vec::size()) store<false>(out + i, Vec::loadu(y + i));
  }
  for (; i < to; ++i) out[i * inner] = to_storage<scalar_t>(y[i]);
}

// The span [0, dim) of x rotated into o with coefficients c (rope_kernel.h).
template <typename scalar_t, typename acc_t>
void put_rotated(const acc_t* x, scalar_t* o, int64_t inner, const acc_t* c, int64_t dim, bool interleaved) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  int64_t i = 0;
  if (interleaved) {
    const acc_t* s = c + dim;
    if (inner == 1) {
      for (; i + L <= dim; i += L) {
        const Vec v = Vec::loadu(x + i);
        store<false>(o + i, v * Vec::loadu(c + i) + swap_pairs(v) * Vec::loadu(s + i));
      }
    }
    for (; i < dim; i += 2) {
      const acc_t x0 = x[i], x1 = x[i + 1];
      o[i * inner] = to_storage<scalar_t>(x0 * c[i] + x1 * s[i]);
      o[(i + 1) * inner] = to_storage<scalar_t>(x1 * c[i + 1] + x0 * s[i + 1]);
    }
  } else {
    const int64_t half = dim / 2;
    const acc_t* s = c + half;
    if (inner == 1) {
      for (; i + L <= half; i += L) {
        const Vec x0 = Vec::loadu(x + i), x1 = Vec::loadu(x + half + i);
        const Vec ci = Vec::loadu(c + i), si = Vec::loadu(s + i);
        store<false>(o + i, x0 * ci - x1 * si);
        store<false>(o + half + i, x0 * si + x1 * ci);
      }
    }
    for (; i < half; ++i) {
      const acc_t x0 = x[i], x1 = x[i + half];
      o[i * inner] = to_storage<scalar_t>(x0 * c[i] - x1 * s[i]);
      o[(i + half) * inner] = to_storage<scalar_t>(x0 * s[i] + x1 * c[i]);
    }
  }
}

template <typename scalar_t, typename acc_t>
void put_row(const NormRun<scalar_t>& r, const acc_t* y, scalar_t* out, const acc_t* c) {
  const int64_t off = r.rotary_offset, end = off + r.rotary_dim;
  put_plain(y, out, r.out_inner, 0, off);
  put_rotated(y + off, out + off * r.out_inner, r.out_inner, c, r.rotary_dim, r.interleaved);
  put_plain(y, out, r.out_inner, end, r.head_dim);
}

}  // namespace

template <typename scalar_t>
void norm_rotate_run(const NormRun<scalar_t>& r) {
  using acc_t = typename NormRun<scalar_t>::acc_t;
  const int64_t D = r.head_dim;
  for (int64_t t = 0; t < r.tokens; ++t) {
    const scalar_t* in = r.in + t * r.in_tok;
    scalar_t* out = r.out + t * r.out_tok;
    const acc_t* c = r.coef + t * r.coef_tok;
    if (r.across_heads) {
      // Every head of the token is read before any is written (in place).
      for (int64_t h = 0; h < r.heads; ++h) load_vector(in + h * r.in_head, r.in_inner, D, r.scratch + h * D);
      const acc_t scale = kernel::rms_scale(sum_squares(r.scratch, r.heads * D), r.heads * D, r.eps);
      for (int64_t h = 0; h < r.heads; ++h) {
        acc_t* y = r.scratch + h * D;
        scale_vector(y, D, scale, r.weight + h * r.weight_head);
        put_row(r, static_cast<const acc_t*>(y), out + h * r.out_head, c);
      }
      continue;
    }
    for (int64_t h = 0; h < r.heads; ++h) {
      load_vector(in + h * r.in_head, r.in_inner, D, r.scratch);
      const acc_t scale = kernel::rms_scale(sum_squares(r.scratch, D), D, r.eps);
      scale_vector(r.scratch, D, scale, r.weight + h * r.weight_head);
      put_row(r, static_cast<const acc_t*>(r.scratch), out + h * r.out_head, c);
    }
  }
}

template void norm_rotate_run<float>(const NormRun<float>&);
template void norm_rotate_run<double>(const NormRun<double>&);
template void norm_rotate_run<c10::Half>(const NormRun<c10::Half>&);
template void norm_rotate_run<c10::BFloat16>(const NormRun<c10::BFloat16>&);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace rotary
