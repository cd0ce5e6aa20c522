// The prologue's CPU kernel (norm_kernel.h), compiled once per capability
// like rope_kernel.cpp. Two passes per head vector, both in L1: one reads it
// into an acc_t scratch row while summing its squares; the other scales each
// element by the RMS and its weight and writes it rotated (the span) or as
// is (the other dims), one rounding to the storage type. The rotation is
// rope_kernel's arithmetic on the normalized values.
#include "norm_kernel.h"
#include "vec_isa.h"

#include "params/fp8.h"
#include "params/norm_params.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <c10/macros/Macros.h>

#include <algorithm>
#include <type_traits>

namespace rotary {
namespace cpu {
namespace CPU_CAPABILITY {
namespace {

// Partial sums of the sum of squares: element i goes to part i % kParts on
// every capability (a vector width divides it), so all give the same bits.
constexpr int kParts = 16;

// Copies n elements into buf as acc_t and adds their squares to part
// (element i to part[i % kParts]), in one pass.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void load_squares(const scalar_t* in, int64_t inner, int64_t n, acc_t* buf, acc_t (&part)[kParts]) {
  using Vec = Vectorized<acc_t>;
  constexpr int L = Vec::size();
  static_assert(kParts % L == 0, "a vector must divide the partial sums");
  int64_t i = 0;
  if (inner == 1 && n >= kParts) {
    Vec acc[kParts / L];
    for (int v = 0; v < kParts / L; ++v) acc[v] = Vec::loadu(part + v * L);
    for (; i + kParts <= n; i += kParts) {
      for (int v = 0; v < kParts / L; ++v) {
        const Vec x = load<scalar_t, acc_t>(in + i + v * L);
        x.store(buf + i + v * L);
        acc[v] = acc[v] + x * x;
      }
    }
    for (int v = 0; v < kParts / L; ++v) acc[v].store(part + v * L);
  }
  for (; i < n; ++i) {
    buf[i] = static_cast<acc_t>(in[i * inner]);
    part[i % kParts] += buf[i] * buf[i];
  }
}

// The tree part[l] += part[l + w] for w = 8, 4, 2, 1, in registers.
template <typename acc_t>
C10_ALWAYS_INLINE acc_t reduce_parts(const acc_t (&p)[kParts]) {
  static_assert(kParts == 16, "the tree below is written for 16 parts");
  const acc_t a0 = p[0] + p[8], a1 = p[1] + p[9], a2 = p[2] + p[10], a3 = p[3] + p[11];
  const acc_t a4 = p[4] + p[12], a5 = p[5] + p[13], a6 = p[6] + p[14], a7 = p[7] + p[15];
  const acc_t b0 = a0 + a4, b1 = a1 + a5, b2 = a2 + a6, b3 = a3 + a7;
  return (b0 + b2) + (b1 + b3);
}

// Where a row's values go: storage type T (one rounding), or float8_e4m3fn
// bytes (uint8_t) divided by the head's fp8 scale.
template <typename T, typename acc_t>
struct Sink {
  const float* fp8_scale;
  C10_ALWAYS_INLINE void put(T* p, acc_t v) const {
    if constexpr (std::is_same_v<T, uint8_t>) {
      *p = kernel::quantize_fp8(v, fp8_scale);
    } else {
      *p = to_storage<T>(v);
    }
  }
  C10_ALWAYS_INLINE void put(T* p, const Vectorized<acc_t>& v) const {
    if constexpr (std::is_same_v<T, uint8_t> && std::is_same_v<acc_t, float>) {
      store_fp8(p, v, fp8_scale);
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      __at_align__ acc_t a[Vectorized<acc_t>::size()];
      v.store(a);
      for (int i = 0; i < Vectorized<acc_t>::size(); ++i) p[i] = kernel::quantize_fp8(a[i], fp8_scale);
    } else {
      store<false>(p, v);
    }
  }
};

// One row being written: its acc_t copy x, its weight w, its scale.
template <typename acc_t>
struct Row {
  const acc_t* x;
  const acc_t* w;
  acc_t scale;
  C10_ALWAYS_INLINE Vectorized<acc_t> at(int64_t i) const {
    return Vectorized<acc_t>::loadu(x + i) * Vectorized<acc_t>(scale) * Vectorized<acc_t>::loadu(w + i);
  }
  C10_ALWAYS_INLINE acc_t operator[](int64_t i) const { return kernel::normalized(x[i], scale, w[i]); }
};

// Dims [from, to) normalized, unrotated.
template <typename T, typename acc_t>
C10_ALWAYS_INLINE void put_plain(
    const Row<acc_t>& y, const Sink<T, acc_t>& sink, T* out, int64_t inner, int64_t from, int64_t to) {
  using Vec = Vectorized<acc_t>;
  int64_t i = from;
  if (inner == 1) {
    for (; i + Vec::size() <= to; i += Vec::size()) sink.put(out + i, y.at(i));
  }
  for (; i < to; ++i) sink.put(out + i * inner, y[i]);
}

// The span [0, dim) of y normalized and rotated into o with coefficients c
// (norm_kernel.h): rope_kernel's products and sums.
template <typename T, typename acc_t>
C10_ALWAYS_INLINE void put_rotated(
    const Row<acc_t>& y, const Sink<T, acc_t>& sink, T* o, int64_t inner, const acc_t* c, int64_t dim,
    bool interleaved) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t L = Vec::size();
  int64_t i = 0;
  if (interleaved) {
    const acc_t* s = c + dim;
    if (inner == 1) {
      for (; i + L <= dim; i += L) {
        const Vec v = y.at(i);
        sink.put(o + i, v * Vec::loadu(c + i) + swap_pairs(v) * Vec::loadu(s + i));
      }
    }
    for (; i < dim; i += 2) {
      const acc_t x0 = y[i], x1 = y[i + 1];
      sink.put(o + i * inner, x0 * c[i] + x1 * s[i]);
      sink.put(o + (i + 1) * inner, x1 * c[i + 1] + x0 * s[i + 1]);
    }
  } else {
    const int64_t half = dim / 2;
    const acc_t* s = c + half;
    if (inner == 1) {
      for (; i + L <= half; i += L) {
        const Vec x0 = y.at(i), x1 = y.at(half + i);
        const Vec ci = Vec::loadu(c + i), si = Vec::loadu(s + i);
        sink.put(o + i, x0 * ci - x1 * si);
        sink.put(o + half + i, x0 * si + x1 * ci);
      }
    }
    for (; i < half; ++i) {
      const acc_t x0 = y[i], x1 = y[i + half];
      sink.put(o + i * inner, x0 * c[i] - x1 * s[i]);
      sink.put(o + (i + half) * inner, x0 * s[i] + x1 * c[i]);
    }
  }
}

template <typename scalar_t, typename T, typename acc_t>
C10_ALWAYS_INLINE void put_row(
    const NormRun<scalar_t>& r, const Row<acc_t>& y, const Sink<T, acc_t>& sink, T* out, const acc_t* c) {
  const int64_t off = r.rotary_offset, end = off + r.rotary_dim;
  put_plain(y, sink, out, r.out_inner, 0, off);
  const Row<acc_t> span{y.x + off, y.w + off, y.scale};
  put_rotated(span, sink, out + off * r.out_inner, r.out_inner, c, r.rotary_dim, r.interleaved);
  put_plain(y, sink, out, r.out_inner, end, r.head_dim);
}

// The 16-bit per-head norm over the tile's vectors in (token, head) order,
// in groups of kNormHeads, software-pipelined: group g + 1 is read and its
// scales found before group g is written. A scale is a chain of dependent
// steps (the sum, a division, a square root, a division) that cannot start
// until the group's loads are in, and the two chains of a group overlap;
// issued a group ahead, they run while the previous group is written
// instead of stalling its writes (bf16 prefill, q 16 and k 8 heads of 128
// at S = 2048: 1147 to 1076 us at 1 thread, 577 to 554 at 2; decode, 64
// tokens: 39.9 to 38.5 us, 24.4 to 22.7). The two groups alternate between
// halves of the scratch. In place is safe: a vector is in scratch before
// its output is written, and vectors are disjoint. Each vector's arithmetic
// is as it is alone.
template <typename T, typename scalar_t, typename SinkOf>
void norm_heads_ahead(const NormRun<scalar_t>& r, const SinkOf& sink_of) {
  using acc_t = typename NormRun<scalar_t>::acc_t;
  constexpr int G = kNormHeads;
  const int64_t D = r.head_dim, n = r.tokens * r.heads;
  struct Group {
    int64_t t[G], h[G];
    acc_t scale[G];
    int count = 0;
  };
  Group group[2];
  int64_t next_t = 0, next_h = 0;  // the next vector to read
  const auto read = [&](int i) {
    Group& g = group[i];
    acc_t part[G][kParts] = {};
    g.count = 0;
    for (; g.count < G && next_t < r.tokens; ++g.count) {
      g.t[g.count] = next_t;
      g.h[g.count] = next_h;
      load_squares(r.in + next_t * r.in_tok + next_h * r.in_head, r.in_inner, D, r.scratch + (i * G + g.count) * D,
                   part[g.count]);
      if (++next_h == r.heads) next_h = 0, ++next_t;
    }
    for (int j = 0; j < g.count; ++j) g.scale[j] = kernel::rms_scale(reduce_parts(part[j]), D, r.eps);
  };
  read(0);
  for (int64_t done = 0, i = 0; done < n; done += group[i].count, i ^= 1) {
    read(i ^ 1);
    const Group& g = group[i];
    for (int j = 0; j < g.count; ++j) {
      const Row<acc_t> y{r.scratch + (i * G + j) * D, r.weight + g.h[j] * r.weight_head, g.scale[j]};
      put_row(r, y, sink_of(g.h[j]), static_cast<T*>(r.out) + g.t[j] * r.out_tok + g.h[j] * r.out_head,
              r.coef + g.t[j] * r.coef_tok);
    }
  }
}

template <typename T, typename scalar_t>
void norm_rows(const NormRun<scalar_t>& r) {
  using acc_t = typename NormRun<scalar_t>::acc_t;
  const int64_t D = r.head_dim;
  const auto sink_of = [&](int64_t h) {
    return Sink<T, acc_t>{r.fp8_scale ? r.fp8_scale + h * r.fp8_scale_head : nullptr};
  };
  if constexpr (sizeof(scalar_t) == 2) {
    if (!r.across_heads) return norm_heads_ahead<T>(r, sink_of);
  }
  for (int64_t t = 0; t < r.tokens; ++t) {
    const scalar_t* in = r.in + t * r.in_tok;
    T* out = static_cast<T*>(r.out) + t * r.out_tok;
    const acc_t* c = r.coef + t * r.coef_tok;
    if (r.across_heads) {
      // Every head of the token is read before any is written (in place).
      acc_t part[kParts] = {};
      for (int64_t h = 0; h < r.heads; ++h) load_squares(in + h * r.in_head, r.in_inner, D, r.scratch + h * D, part);
      const acc_t scale = kernel::rms_scale(reduce_parts(part), r.heads * D, r.eps);
      for (int64_t h = 0; h < r.heads; ++h) {
        const Row<acc_t> y{r.scratch + h * D, r.weight + h * r.weight_head, scale};
        put_row(r, y, sink_of(h), out + h * r.out_head, c);
      }
      continue;
    }
    // float32 and float64 one head at a time: their loads bound the loop.
    // Two heads of loads then two of work made float32 prefill slower (1.5
    // to 2.0 ms); reading a head ahead, as 16-bit data does, gained nothing.
    for (int64_t h = 0; h < r.heads; ++h) {
      acc_t part[kParts] = {};
      load_squares(in + h * r.in_head, r.in_inner, D, r.scratch, part);
      const acc_t scale = kernel::rms_scale(reduce_parts(part), D, r.eps);
      const Row<acc_t> y{r.scratch, r.weight + h * r.weight_head, scale};
      put_row(r, y, sink_of(h), out + h * r.out_head, c);
    }
  }
}

}  // namespace

template <typename scalar_t>
void norm_rotate_run(const NormRun<scalar_t>& r) {
  if (r.fp8_scale != nullptr) {
    norm_rows<uint8_t>(r);
  } else {
    norm_rows<scalar_t>(r);
  }
}

template void norm_rotate_run<float>(const NormRun<float>&);
template void norm_rotate_run<double>(const NormRun<double>&);
template void norm_rotate_run<c10::Half>(const NormRun<c10::Half>&);
template void norm_rotate_run<c10::BFloat16>(const NormRun<c10::BFloat16>&);

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace rotary
