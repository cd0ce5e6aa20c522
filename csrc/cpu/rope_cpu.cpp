// CPU kernel. Work is split into tasks of (batch, a tile of tokens). A task
// first turns the table rows of its tokens into rotation coefficients laid out
// for straight vector loads, then rotates every q and k head vector of the
// tile, walking each tensor in its own memory order (heads-major layouts one
// head plane at a time, token-major layouts one token at a time), so that the
// reads and writes stay long sequential streams.
//
// Math: a * cos - b * sin and a * sin + b * cos in the accumulation type (fp32
// for fp32/fp16/bf16, fp64 for fp64), multiplies and adds rounded separately
// (no FMA contraction), one rounding to the storage type at the end. The
// scalar and the SIMD paths give the same bits.
//
// SIMD: the library is built for baseline x86-64, so the AVX2 path is compiled
// with a function-level target attribute and picked at run time when the CPU
// has AVX2 + F16C and ATen's capability (ATEN_CPU_CAPABILITY) is not DEFAULT.
// Anything else (other ISAs, fp64, a strided last dim) runs the scalar path.
#include "rope_cpu.h"

#include "../backend_ops.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROTARY_X86_SIMD 1
#include <immintrin.h>
#endif

namespace rotary {
namespace cpu {
namespace {

using kernel::HeadTensor;
using kernel::RopeParams;

// ---------------------------------------------------------------------------
// Coefficients of one token, 2 * head_dim values of acc_t:
//   interleaved: c = (c0, c0, c1, c1, ...), s = (-s0, s0, -s1, s1, ...), so
//                out[i] = x[i] * c[i] + x[i ^ 1] * s[i]
//   half:        c = (c0, c1, ..., c_{D/2-1}), s = (s0, ..., s_{D/2-1}), then
//                D unused values; out[j] = x[j] c_j - x[j + D/2] s_j and
//                out[j + D/2] = x[j] s_j + x[j + D/2] c_j
// Negating a product is exact, so x0 * c + x1 * (-s) has the bits of
// x0 * c - x1 * s, and x1 * c + x0 * s those of x0 * s + x1 * c.
template <typename acc_t>
void fill_coefficients(const RopeParams& p, int64_t pos, acc_t* coef) {
  const int64_t dim = p.rotary_dim;
  const int64_t pairs = dim / 2;
  acc_t* c = coef;
  acc_t* s = coef + dim;
  for (int64_t j = 0; j < pairs; ++j) {
    acc_t cj, sj;
    kernel::rotation_of<acc_t>(p, pos, j, cj, sj);
    if (p.interleaved) {
      c[2 * j] = cj;
      c[2 * j + 1] = cj;
      s[2 * j] = -sj;
      s[2 * j + 1] = sj;
    } else {
      c[j] = cj;
      c[pairs + j] = sj;
    }
  }
}

// A run of n head vectors of one tensor: vector t starts at in + t * in_step
// (out + t * out_step), its elements are in_inner (out_inner) apart, and its
// coefficients start at coef + t * coef_step (0 when all share one token).
template <typename scalar_t, typename acc_t>
struct Run {
  const scalar_t* in;
  scalar_t* out;
  int64_t n;
  int64_t in_step, out_step;
  int64_t in_inner, out_inner;
  const acc_t* coef;
  int64_t coef_step;
};

// Scalar rotation of one head vector from element `from` (interleaved) or
// pair `from` (half) on: the whole vector on the scalar path, the tail after
// the SIMD loop otherwise. kContig: element strides are 1.
template <bool kContig, typename scalar_t, typename acc_t>
inline void rotate_scalar(
    const scalar_t* in, int64_t is, scalar_t* out, int64_t os, const acc_t* coef, int64_t dim,
    bool interleaved, int64_t from) {
  if constexpr (kContig) {
    is = 1;
    os = 1;
  }
  const acc_t* c = coef;
  if (interleaved) {
    const acc_t* s = coef + dim;
    for (int64_t i = from; i < dim; i += 2) {
      const acc_t x0 = static_cast<acc_t>(in[i * is]);
      const acc_t x1 = static_cast<acc_t>(in[(i + 1) * is]);
      out[i * os] = static_cast<scalar_t>(x0 * c[i] + x1 * s[i]);
      out[(i + 1) * os] = static_cast<scalar_t>(x1 * c[i + 1] + x0 * s[i + 1]);
    }
  } else {
    const int64_t half = dim / 2;
    const acc_t* s = coef + half;
    for (int64_t j = from; j < half; ++j) {
      const acc_t x0 = static_cast<acc_t>(in[j * is]);
      const acc_t x1 = static_cast<acc_t>(in[(j + half) * is]);
      out[j * os] = static_cast<scalar_t>(x0 * c[j] - x1 * s[j]);
      out[(j + half) * os] = static_cast<scalar_t>(x0 * s[j] + x1 * c[j]);
    }
  }
}

template <typename scalar_t, typename acc_t>
void rotate_run_scalar(const Run<scalar_t, acc_t>& r, int64_t dim, bool interleaved) {
  const bool contiguous = r.in_inner == 1 && r.out_inner == 1;
  for (int64_t t = 0; t < r.n; ++t) {
    const scalar_t* in = r.in + t * r.in_step;
    scalar_t* out = r.out + t * r.out_step;
    const acc_t* coef = r.coef + t * r.coef_step;
    if (contiguous) {
      rotate_scalar<true>(in, 1, out, 1, coef, dim, interleaved, 0);
    } else {
      rotate_scalar<false>(in, r.in_inner, out, r.out_inner, coef, dim, interleaved, 0);
    }
  }
}

// ---------------------------------------------------------------------------
// AVX2 (+ F16C for fp16): 8 lanes of fp32, 16-bit types converted in registers.
#if defined(ROTARY_X86_SIMD)
#define ROTARY_AVX2 __attribute__((target("avx2,f16c")))
#define ROTARY_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) inline

ROTARY_AVX2_INLINE __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
ROTARY_AVX2_INLINE __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
ROTARY_AVX2_INLINE __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

ROTARY_AVX2_INLINE void store8(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
}
// Round to nearest even exactly as c10::BFloat16(float) does (NaN -> 0x7FC0).
ROTARY_AVX2_INLINE void store8(c10::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
ROTARY_AVX2_INLINE void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename scalar_t>
ROTARY_AVX2 void rotate_run_avx2(const Run<scalar_t, float>& r, int64_t dim, bool interleaved) {
  if (r.in_inner != 1 || r.out_inner != 1) {
    rotate_run_scalar(r, dim, interleaved);
    return;
  }
  const int64_t half = dim / 2;
  const int64_t vec_end = interleaved ? dim - dim % 8 : half - half % 8;
  for (int64_t t = 0; t < r.n; ++t) {
    const scalar_t* in = r.in + t * r.in_step;
    scalar_t* out = r.out + t * r.out_step;
    const float* c = r.coef + t * r.coef_step;
    if (interleaved) {
      const float* s = c + dim;
      for (int64_t i = 0; i < vec_end; i += 8) {
        const __m256 x = load8(in + i);
        const __m256 x_swapped = _mm256_permute_ps(x, 0xB1);  // (x1, x0, x3, x2, ...)
        store8(out + i, _mm256_add_ps(_mm256_mul_ps(x, _mm256_loadu_ps(c + i)),
                                      _mm256_mul_ps(x_swapped, _mm256_loadu_ps(s + i))));
      }
    } else {
      const float* s = c + half;
      for (int64_t j = 0; j < vec_end; j += 8) {
        const __m256 x0 = load8(in + j);
        const __m256 x1 = load8(in + half + j);
        const __m256 cj = _mm256_loadu_ps(c + j);
        const __m256 sj = _mm256_loadu_ps(s + j);
        store8(out + j, _mm256_sub_ps(_mm256_mul_ps(x0, cj), _mm256_mul_ps(x1, sj)));
        store8(out + half + j, _mm256_add_ps(_mm256_mul_ps(x0, sj), _mm256_mul_ps(x1, cj)));
      }
    }
    if (vec_end < (interleaved ? dim : half)) {
      rotate_scalar<true>(in, 1, out, 1, c, dim, interleaved, vec_end);
    }
  }
}
#endif  // ROTARY_X86_SIMD

bool use_avx2() {
#if defined(ROTARY_X86_SIMD)
  static const bool yes = at::get_cpu_capability() != "DEFAULT" && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

template <typename scalar_t, typename acc_t>
void rotate_run(const Run<scalar_t, acc_t>& r, int64_t dim, bool interleaved, bool avx2) {
#if defined(ROTARY_X86_SIMD)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (avx2) {
      rotate_run_avx2<scalar_t>(r, dim, interleaved);
      return;
    }
  }
#endif
  rotate_run_scalar(r, dim, interleaved);
}

// ---------------------------------------------------------------------------
// Driver

// Tokens per task: their coefficients (2 * head_dim acc_t each) stay within
// 16 KiB, a part of L1, while each head plane is read in runs of that many
// tokens (16 tokens x 512 B for fp32, head_dim 128).
constexpr int64_t kCoefBytes = 16 * 1024;
// At least this many elements per parallel chunk.
constexpr int64_t kGrainElems = int64_t{1} << 15;

// Out of place, dims [rotary_dim, head_dim) of every vector of the run are
// copied unchanged (partial rotary).
template <typename scalar_t, typename acc_t>
void copy_pass_through(const Run<scalar_t, acc_t>& r, int64_t rotary_dim, int64_t head_dim) {
  for (int64_t v = 0; v < r.n; ++v) {
    const scalar_t* in = r.in + v * r.in_step;
    scalar_t* out = r.out + v * r.out_step;
    for (int64_t i = rotary_dim; i < head_dim; ++i) out[i * r.out_inner] = in[i * r.in_inner];
  }
}

template <typename scalar_t>
void rotate_tensor_tile(
    const RopeParams& p, const HeadTensor& t, int64_t b, int64_t s0, int64_t tile,
    const at::opmath_type<scalar_t>* coef, bool avx2) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t dim = p.rotary_dim;
  const bool copy_tail = !p.in_place && p.head_dim > dim;
  const auto* in = static_cast<const scalar_t*>(t.in) + b * t.in_stride[0] + s0 * t.in_stride[2];
  auto* out = static_cast<scalar_t*>(t.out) + b * t.out_stride[0] + s0 * t.out_stride[2];
  const auto abs64 = [](int64_t v) { return v < 0 ? -v : v; };
  if (tile > 1 && abs64(t.in_stride[2]) <= abs64(t.in_stride[1])) {
    // Heads-major (e.g. contiguous [B, H, S, D]): one head, the tile's tokens.
    for (int64_t h = 0; h < t.heads; ++h) {
      const Run<scalar_t, acc_t> r{
          in + h * t.in_stride[1], out + h * t.out_stride[1], tile, t.in_stride[2], t.out_stride[2],
          t.in_stride[3], t.out_stride[3], coef, 2 * dim};
      rotate_run(r, dim, p.interleaved, avx2);
      if (copy_tail) copy_pass_through(r, dim, p.head_dim);
    }
  } else {
    // Token-major (e.g. [B, S, H, D] viewed as BHSD, or decode): one token, all heads.
    for (int64_t s = 0; s < tile; ++s) {
      const Run<scalar_t, acc_t> r{
          in + s * t.in_stride[2], out + s * t.out_stride[2], t.heads, t.in_stride[1], t.out_stride[1],
          t.in_stride[3], t.out_stride[3], coef + s * 2 * dim, 0};
      rotate_run(r, dim, p.interleaved, avx2);
      if (copy_tail) copy_pass_through(r, dim, p.head_dim);
    }
  }
}

template <typename scalar_t>
void rope_cpu_kernel(const RopeParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t coef_per_token = 2 * p.rotary_dim;
  const int64_t tile =
      std::min<int64_t>(p.seq, std::max<int64_t>(1, kCoefBytes / (coef_per_token * int64_t(sizeof(acc_t)))));
  const int64_t tiles_per_batch = (p.seq + tile - 1) / tile;
  const int64_t tasks = p.batch * tiles_per_batch;
  const int64_t task_elems = tile * (p.q.heads + p.k.heads) * p.head_dim;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(task_elems, 1));
  const bool avx2 = use_avx2();

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> coef(static_cast<size_t>(tile * coef_per_token));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tiles_per_batch;
      const int64_t s0 = (task % tiles_per_batch) * tile;
      const int64_t n = std::min(tile, p.seq - s0);
      for (int64_t s = 0; s < n; ++s) {
        fill_coefficients(p, kernel::position_of(p, b, s0 + s), coef.data() + s * coef_per_token);
      }
      rotate_tensor_tile<scalar_t>(p, p.q, b, s0, n, coef.data(), avx2);
      if (p.k.heads > 0) rotate_tensor_tile<scalar_t>(p, p.k, b, s0, n, coef.data(), avx2);
    }
  });
}

}  // namespace

void rope_cpu(const RopeParams& p, at::ScalarType dtype) {
  if (p.batch * p.seq == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cpu", [&] {
    rope_cpu_kernel<scalar_t>(p);
  });
}

}  // namespace cpu

namespace {

void run_cpu(const detail::PreparedRope& prepared, at::ScalarType dtype) {
  cpu::rope_cpu(prepared.params, dtype);
}

}  // namespace

// Validation, allocation and the in-place rules come from BackendOps.
TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  detail::BackendOps<&run_cpu>::register_all(m);
}

}  // namespace rotary
