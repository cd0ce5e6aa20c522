// CPU kernel. Work is split into tasks of (batch, a tile of tokens). A task
// first turns the table rows of its tokens into rotation coefficients laid out
// for straight vector loads, then rotates every q and k head vector of the
// tile, walking each tensor in its own memory order: heads-major layouts
// (contiguous BHSD) a block of heads at a time over the tile's tokens, so that
// reads and writes are long sequential streams; token-major layouts (BSHD,
// SBHD, decode) one token at a time over its heads. The coefficients of one
// token are loaded once per block of heads.
//
// Math: a * cos - b * sin and a * sin + b * cos in the accumulation type (fp32
// for fp32/fp16/bf16, fp64 for fp64), multiplies and adds rounded separately
// (no FMA contraction), one rounding to the storage type at the end. The
// scalar and every SIMD path give the same bits (NaN payloads included).
//
// SIMD: the library is built for baseline x86-64, so the AVX2 and AVX-512
// paths are compiled with function-level target attributes and picked at run
// time from ATen's CPU capability (ATEN_CPU_CAPABILITY=default|avx2|avx512
// selects them too) confirmed by the CPU's own feature bits. Anything else
// (other ISAs, clang builds, fp64, a strided last dim) runs the scalar path.
// Outputs too big for the caches are written with streaming (non-temporal)
// stores.
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
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

// The SIMD paths rely on GCC inlining plain templates into target-attributed
// functions (flatten); clang rejects vector arguments across that boundary, so
// clang builds (and non-x86 ones) run the scalar path.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROTARY_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace rotary {
namespace cpu {
namespace {

using kernel::HeadTensor;
using kernel::RopeParams;

// ---------------------------------------------------------------------------
// Coefficients of one token, 2 * rotary_dim values of acc_t:
//   interleaved: c = (c0, c0, c1, c1, ...), s = (-s0, s0, -s1, s1, ...), so
//                out[i] = x[i] * c[i] + x[i ^ 1] * s[i]
//   half:        c = (c0, c1, ..., c_{R/2-1}), s = (s0, ..., s_{R/2-1}), then
//                R unused values; out[j] = x[j] c_j - x[j + R/2] s_j and
//                out[j + R/2] = x[j] s_j + x[j + R/2] c_j
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

// The head vectors of one tensor for `tokens` tokens and `heads` heads:
// vector (t, h) starts at in + t * in_tok + h * in_head (likewise out), its
// elements are in_inner (out_inner) apart, and token t's coefficients start at
// coef + t * coef_tok. tokens_outer: walk token by token (token-major
// memory); otherwise a block of heads at a time over all tokens.
template <typename scalar_t, typename acc_t>
struct Run {
  const scalar_t* in;
  scalar_t* out;
  int64_t tokens, in_tok, out_tok, coef_tok;
  int64_t heads, in_head, out_head;
  int64_t in_inner, out_inner;
  const acc_t* coef;
  bool tokens_outer;
};

// Scalar rotation of one head vector from element `from` (interleaved) or
// pair `from` (half) on: the whole vector on the scalar path, the tail after
// the SIMD loop otherwise. kContig: element strides are 1. Never inlined into
// the SIMD functions, whose targets would let the compiler contract these
// multiplies and adds into FMAs (and change the bits).
template <bool kContig, typename scalar_t, typename acc_t>
C10_NOINLINE void rotate_scalar(
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
C10_NOINLINE void rotate_run_scalar(const Run<scalar_t, acc_t>& r, int64_t dim, bool interleaved) {
  const bool contiguous = r.in_inner == 1 && r.out_inner == 1;
  for (int64_t t = 0; t < r.tokens; ++t) {
    for (int64_t h = 0; h < r.heads; ++h) {
      const scalar_t* in = r.in + t * r.in_tok + h * r.in_head;
      scalar_t* out = r.out + t * r.out_tok + h * r.out_head;
      const acc_t* coef = r.coef + t * r.coef_tok;
      if (contiguous) {
        rotate_scalar<true>(in, 1, out, 1, coef, dim, interleaved, 0);
      } else {
        rotate_scalar<false>(in, r.in_inner, out, r.out_inner, coef, dim, interleaved, 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// SIMD (x86-64). The library is built for baseline x86-64, so each ISA's
// functions carry a target attribute; the shared loops below are plain
// templates that those functions inline (flatten), so they compile once per
// ISA. Multiplies and adds are separate instructions (no FMA): the AVX2 target
// has no FMA to contract into, and the AVX-512 one uses the *_round_*
// intrinsics, which the compiler never contracts.
#if defined(ROTARY_X86_SIMD)
#pragma GCC diagnostic push
// GCC 12 flags the undefined pass-through operand inside the *_round_*
// intrinsics; vector types in these target-specific inline functions are fine.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#define ROTARY_AVX2 __attribute__((target("avx2,f16c")))
#define ROTARY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")))
#define ROTARY_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c")))

struct Avx2 {
  using Reg = __m256;
  static constexpr int64_t kLanes = 8;

  ROTARY_AVX2 static Reg load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  ROTARY_AVX2 static Reg load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  ROTARY_AVX2 static Reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // bf16 bits of v, rounded to nearest even exactly as c10::BFloat16(float)
  // does (NaN -> 0x7FC0), in the low half of each 32-bit lane.
  ROTARY_AVX2 static __m256i bf16_bits(Reg v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  }
  // Stores; NT: non-temporal (streaming) stores, p aligned to the width.
  template <bool NT>
  ROTARY_AVX2 static void put(void* p, __m128i v) {
    NT ? _mm_stream_si128(static_cast<__m128i*>(p), v) : _mm_storeu_si128(static_cast<__m128i*>(p), v);
  }
  template <bool NT>
  ROTARY_AVX2 static void put(void* p, __m256i v) {
    NT ? _mm256_stream_si256(static_cast<__m256i*>(p), v) : _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
  template <bool NT>
  ROTARY_AVX2 static void store(float* p, Reg v) {
    put<NT>(p, _mm256_castps_si256(v));
  }
  template <bool NT>
  ROTARY_AVX2 static void store(c10::BFloat16* p, Reg v) {
    const __m256i r = bf16_bits(v);
    put<NT>(p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  template <bool NT>
  ROTARY_AVX2 static void store(c10::Half* p, Reg v) {
    put<NT>(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Two registers to 2 * kLanes consecutive elements.
  template <bool NT, typename T>
  ROTARY_AVX2 static void store2(T* p, Reg a, Reg b) {
    store<NT>(p, a);
    store<NT>(p + kLanes, b);
  }
  template <bool NT>
  ROTARY_AVX2 static void store2(c10::BFloat16* p, Reg a, Reg b) {
    // packus interleaves 128-bit lanes: (a0-3, b0-3 | a4-7, b4-7); reorder.
    const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
    put<NT>(p, _mm256_permute4x64_epi64(packed, 0xD8));
  }

  ROTARY_AVX2 static Reg mul(Reg a, Reg b) {
    return _mm256_mul_ps(a, b);
  }
  ROTARY_AVX2 static Reg add(Reg a, Reg b) {
    return _mm256_add_ps(a, b);
  }
  ROTARY_AVX2 static Reg sub(Reg a, Reg b) {
    return _mm256_sub_ps(a, b);
  }
  ROTARY_AVX2 static Reg swap_pairs(Reg x) {
    return _mm256_permute_ps(x, 0xB1);  // (x1, x0, x3, x2, ...)
  }

  // Coefficients of kLanes / 2 interleaved pairs from raw table floats
  // (c0, s0, c1, s1, ...): c = (c0, c0, c1, c1, ...), s = (-s0, s0, ...).
  ROTARY_AVX2 static void fill_interleaved(const float* row, float* c, float* s, bool inverse) {
    const Reg t = _mm256_loadu_ps(row);
    const Reg sign = inverse ? _mm256_setr_ps(0.f, -0.f, 0.f, -0.f, 0.f, -0.f, 0.f, -0.f)
                             : _mm256_setr_ps(-0.f, 0.f, -0.f, 0.f, -0.f, 0.f, -0.f, 0.f);
    _mm256_storeu_ps(c, _mm256_moveldup_ps(t));
    _mm256_storeu_ps(s, _mm256_xor_ps(_mm256_movehdup_ps(t), sign));
  }
  // Coefficients of kLanes half-layout pairs from 2 * kLanes raw floats.
  ROTARY_AVX2 static void fill_half(const float* row, float* c, float* s, bool inverse) {
    const Reg t0 = _mm256_loadu_ps(row), t1 = _mm256_loadu_ps(row + kLanes);
    // shuffle works per 128-bit lane: (c0 c1 c4 c5 | c2 c3 c6 c7); reorder.
    const Reg cs = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(t0, t1, 0x88)), 0xD8));
    const Reg ss = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(t0, t1, 0xDD)), 0xD8));
    _mm256_storeu_ps(c, cs);
    _mm256_storeu_ps(s, inverse ? _mm256_xor_ps(ss, _mm256_set1_ps(-0.f)) : ss);
  }
};

struct Avx512 {
  using Reg = __m512;
  static constexpr int64_t kLanes = 16;

  ROTARY_AVX512 static Reg load(const float* p) {
    return _mm512_loadu_ps(p);
  }
  ROTARY_AVX512 static Reg load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  ROTARY_AVX512 static Reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ROTARY_AVX512 static __m512i bf16_bits(Reg v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
  template <bool NT>
  ROTARY_AVX512 static void put(void* p, __m256i v) {
    NT ? _mm256_stream_si256(static_cast<__m256i*>(p), v) : _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
  template <bool NT>
  ROTARY_AVX512 static void put(void* p, __m512i v) {
    NT ? _mm512_stream_si512(static_cast<__m512i*>(p), v) : _mm512_storeu_si512(p, v);
  }
  template <bool NT>
  ROTARY_AVX512 static void store(float* p, Reg v) {
    put<NT>(p, _mm512_castps_si512(v));
  }
  template <bool NT>
  ROTARY_AVX512 static void store(c10::BFloat16* p, Reg v) {
    put<NT>(p, _mm512_cvtepi32_epi16(bf16_bits(v)));
  }
  template <bool NT>
  ROTARY_AVX512 static void store(c10::Half* p, Reg v) {
    put<NT>(p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  template <bool NT, typename T>
  ROTARY_AVX512 static void store2(T* p, Reg a, Reg b) {
    store<NT>(p, a);
    store<NT>(p + kLanes, b);
  }
  template <bool NT>
  ROTARY_AVX512 static void store2(c10::BFloat16* p, Reg a, Reg b) {
    // packus works per 128-bit lane: (a0-3 b0-3 | a4-7 b4-7 | ...); reorder.
    const __m512i packed = _mm512_packus_epi32(bf16_bits(a), bf16_bits(b));
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    put<NT>(p, _mm512_permutexvar_epi64(order, packed));
  }

  ROTARY_AVX512 static Reg mul(Reg a, Reg b) {
    return _mm512_mul_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
  }
  ROTARY_AVX512 static Reg add(Reg a, Reg b) {
    return _mm512_add_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
  }
  ROTARY_AVX512 static Reg sub(Reg a, Reg b) {
    return _mm512_sub_round_ps(a, b, _MM_FROUND_CUR_DIRECTION);
  }
  ROTARY_AVX512 static Reg swap_pairs(Reg x) {
    return _mm512_permute_ps(x, 0xB1);
  }

  ROTARY_AVX512 static void fill_interleaved(const float* row, float* c, float* s, bool inverse) {
    const Reg t = _mm512_loadu_ps(row);
    // Negate the even lanes (forward) or the odd ones (inverse).
    const __mmask16 neg = inverse ? 0xAAAA : 0x5555;
    const Reg sd = _mm512_movehdup_ps(t);
    _mm512_storeu_ps(c, _mm512_moveldup_ps(t));
    _mm512_storeu_ps(s, _mm512_mask_xor_ps(sd, neg, sd, _mm512_set1_ps(-0.f)));
  }
  ROTARY_AVX512 static void fill_half(const float* row, float* c, float* s, bool inverse) {
    const Reg t0 = _mm512_loadu_ps(row), t1 = _mm512_loadu_ps(row + kLanes);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const Reg ss = _mm512_permutex2var_ps(t0, odd, t1);
    _mm512_storeu_ps(c, _mm512_permutex2var_ps(t0, even, t1));
    _mm512_storeu_ps(s, inverse ? _mm512_xor_ps(ss, _mm512_set1_ps(-0.f)) : ss);
  }
};

// AVX-512 with the BF16 extension: VCVTNE2PS2BF16 rounds to nearest even
// like c10::BFloat16, except that it flushes fp32 denormals to zero and keeps
// NaN payloads; chunks holding either (fpclass) take the integer path.
struct Avx512Bf16 : Avx512 {
  using Avx512::store;
  using Avx512::store2;
  static constexpr int kDenormalOrNan = 0x01 | 0x80 | 0x20;  // QNaN, SNaN, denormal

  template <bool NT>
  ROTARY_AVX512BF16 static void store(c10::BFloat16* p, Reg v) {
    if (_mm512_fpclass_ps_mask(v, kDenormalOrNan)) return Avx512::store<NT>(p, v);
    put<NT>(p, (__m256i)_mm512_cvtneps_pbh(v));
  }
  template <bool NT>
  ROTARY_AVX512BF16 static void store2(c10::BFloat16* p, Reg a, Reg b) {
    if (_mm512_fpclass_ps_mask(a, kDenormalOrNan) | _mm512_fpclass_ps_mask(b, kDenormalOrNan)) {
      return Avx512::store2<NT>(p, a, b);
    }
    put<NT>(p, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a -> low half
  }
};

// Heads that share one load of the coefficients.
constexpr int kHeadBlock = 4;
// Software prefetch distance, in tokens, along a heads-major stream.
constexpr int64_t kPrefetchTokens = 8;

// Token t of heads [h0, h0 + M): the coefficients are loaded once per chunk
// and applied to the M heads.
template <class V, bool NT, int M, typename scalar_t>
inline void rotate_block(const Run<scalar_t, float>& r, int64_t t, int64_t h0, int64_t dim, bool interleaved) {
  constexpr int64_t L = V::kLanes;
  const scalar_t* in[M];
  scalar_t* out[M];
  for (int h = 0; h < M; ++h) {
    in[h] = r.in + t * r.in_tok + (h0 + h) * r.in_head;
    out[h] = r.out + t * r.out_tok + (h0 + h) * r.out_head;
  }
  const float* c = r.coef + t * r.coef_tok;
  const int64_t half = dim / 2;
  const int64_t len = interleaved ? dim : half;  // elements (interleaved) or pairs (half)
  const int64_t end2 = len - len % (2 * L);
  const int64_t end1 = len - len % L;
  int64_t i = 0;
  if (interleaved) {
    // out = x * c + swap_pairs(x) * s, two chunks of L elements at a time.
    const float* s = c + dim;
    for (; i < end2; i += 2 * L) {
      const auto ca = V::load(c + i), sa = V::load(s + i);
      const auto cb = V::load(c + i + L), sb = V::load(s + i + L);
      for (int h = 0; h < M; ++h) {
        const auto xa = V::load(in[h] + i);
        const auto xb = V::load(in[h] + i + L);
        V::template store2<NT>(
            out[h] + i, V::add(V::mul(xa, ca), V::mul(V::swap_pairs(xa), sa)),
            V::add(V::mul(xb, cb), V::mul(V::swap_pairs(xb), sb)));
      }
    }
    for (; i < end1; i += L) {
      const auto ci = V::load(c + i), si = V::load(s + i);
      for (int h = 0; h < M; ++h) {
        const auto x = V::load(in[h] + i);
        V::template store<NT>(out[h] + i, V::add(V::mul(x, ci), V::mul(V::swap_pairs(x), si)));
      }
    }
  } else {
    const float* s = c + half;
    for (; i < end2; i += 2 * L) {
      const auto ca = V::load(c + i), sa = V::load(s + i);
      const auto cb = V::load(c + i + L), sb = V::load(s + i + L);
      for (int h = 0; h < M; ++h) {
        const auto x0a = V::load(in[h] + i), x0b = V::load(in[h] + i + L);
        const auto x1a = V::load(in[h] + half + i), x1b = V::load(in[h] + half + i + L);
        V::template store2<NT>(
            out[h] + i, V::sub(V::mul(x0a, ca), V::mul(x1a, sa)), V::sub(V::mul(x0b, cb), V::mul(x1b, sb)));
        V::template store2<NT>(
            out[h] + half + i, V::add(V::mul(x0a, sa), V::mul(x1a, ca)), V::add(V::mul(x0b, sb), V::mul(x1b, cb)));
      }
    }
    for (; i < end1; i += L) {
      const auto ci = V::load(c + i), si = V::load(s + i);
      for (int h = 0; h < M; ++h) {
        const auto x0 = V::load(in[h] + i);
        const auto x1 = V::load(in[h] + half + i);
        V::template store<NT>(out[h] + i, V::sub(V::mul(x0, ci), V::mul(x1, si)));
        V::template store<NT>(out[h] + half + i, V::add(V::mul(x0, si), V::mul(x1, ci)));
      }
    }
  }
  if (i < len) {
    for (int h = 0; h < M; ++h) rotate_scalar<true>(in[h], 1, out[h], 1, c, dim, interleaved, i);
  }
}

template <typename scalar_t>
inline void prefetch_vector(const scalar_t* p, int64_t bytes) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
}

// Heads-major: each head of the block is one sequential stream over the
// tokens, prefetched a few tokens ahead.
template <class V, bool NT, int M, typename scalar_t>
inline void rotate_heads_major(const Run<scalar_t, float>& r, int64_t h0, int64_t dim, bool interleaved) {
  const int64_t vec_bytes = dim * int64_t(sizeof(scalar_t));
  for (int64_t t = 0; t < r.tokens; ++t) {
    if (t + kPrefetchTokens < r.tokens) {
      for (int h = 0; h < M; ++h) {
        prefetch_vector(r.in + (t + kPrefetchTokens) * r.in_tok + (h0 + h) * r.in_head, vec_bytes);
      }
    }
    rotate_block<V, NT, M>(r, t, h0, dim, interleaved);
  }
}

template <class V, bool NT, typename scalar_t>
inline void rotate_run_simd(const Run<scalar_t, float>& r, int64_t dim, bool interleaved) {
  const int64_t blocked = r.heads - r.heads % kHeadBlock;
  if (r.tokens_outer) {
    for (int64_t t = 0; t < r.tokens; ++t) {
      for (int64_t h = 0; h < blocked; h += kHeadBlock) rotate_block<V, NT, kHeadBlock>(r, t, h, dim, interleaved);
      for (int64_t h = blocked; h < r.heads; ++h) rotate_block<V, NT, 1>(r, t, h, dim, interleaved);
    }
  } else {
    for (int64_t h = 0; h < blocked; h += kHeadBlock) rotate_heads_major<V, NT, kHeadBlock>(r, h, dim, interleaved);
    for (int64_t h = blocked; h < r.heads; ++h) rotate_heads_major<V, NT, 1>(r, h, dim, interleaved);
  }
}

// Coefficients of one in-table token straight from its table row, whose
// pairs are contiguous: the same values as fill_coefficients.
template <class V>
inline void fill_coefficients_simd(const RopeParams& p, int64_t pos, float* coef) {
  constexpr int64_t L = V::kLanes;
  const int64_t dim = p.rotary_dim;
  const int64_t pairs = dim / 2;
  const float* row = p.freqs + 2 * pos * p.freqs_stride_pos;
  float* c = coef;
  int64_t j = 0;
  if (p.interleaved) {
    float* s = coef + dim;
    for (; j + L / 2 <= pairs; j += L / 2) V::fill_interleaved(row + 2 * j, c + 2 * j, s + 2 * j, p.inverse);
    for (; j < pairs; ++j) {
      const float sj = p.inverse ? -row[2 * j + 1] : row[2 * j + 1];
      c[2 * j] = c[2 * j + 1] = row[2 * j];
      s[2 * j] = -sj;
      s[2 * j + 1] = sj;
    }
  } else {
    float* s = coef + pairs;
    for (; j + L <= pairs; j += L) V::fill_half(row + 2 * j, c + j, s + j, p.inverse);
    for (; j < pairs; ++j) {
      c[j] = row[2 * j];
      s[j] = p.inverse ? -row[2 * j + 1] : row[2 * j + 1];
    }
  }
}

// One entry per ISA: the shared templates above, flattened into a function
// compiled for that ISA.
#define ROTARY_SIMD_ROTATE(ISA, V)                                                            \
  template <typename scalar_t>                                                              \
  ISA __attribute__((flatten)) void rotate_run_##V(                                         \
      const Run<scalar_t, float>& r, int64_t dim, bool interleaved, bool nt) {              \
    if (r.in_inner != 1 || r.out_inner != 1) return rotate_run_scalar(r, dim, interleaved); \
    if (nt) return rotate_run_simd<V, true>(r, dim, interleaved);                           \
    rotate_run_simd<V, false>(r, dim, interleaved);                                         \
  }
#define ROTARY_SIMD_FILL(ISA, V)                                                              \
  ISA __attribute__((flatten)) void fill_coefficients_##V(const RopeParams& p, int64_t pos, float* coef) { \
    fill_coefficients_simd<V>(p, pos, coef);                                                \
  }
ROTARY_SIMD_ROTATE(ROTARY_AVX2, Avx2)
ROTARY_SIMD_ROTATE(ROTARY_AVX512, Avx512)
ROTARY_SIMD_ROTATE(ROTARY_AVX512BF16, Avx512Bf16)
ROTARY_SIMD_FILL(ROTARY_AVX2, Avx2)
ROTARY_SIMD_FILL(ROTARY_AVX512, Avx512)
#undef ROTARY_SIMD_ROTATE
#undef ROTARY_SIMD_FILL
#pragma GCC diagnostic pop
#endif  // ROTARY_X86_SIMD

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

#if defined(ROTARY_X86_SIMD)
// One CPUID feature bit (reg: 0 eax, 1 ebx, 2 ecx, 3 edx); for the features
// that not every compiler's __builtin_cpu_supports knows.
bool cpuid_bit(unsigned leaf, unsigned subleaf, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}
#endif

// ATen's capability (it honours ATEN_CPU_CAPABILITY=default|avx2|avx512),
// confirmed against the CPU's own feature bits.
Isa detect_isa() {
#if defined(ROTARY_X86_SIMD)
  static const Isa isa = [] {
    const std::string cap = at::get_cpu_capability();
    const bool f16c = cpuid_bit(1, 0, 2, 29);
    const bool avx512_bf16 = cpuid_bit(7, 1, 0, 5);
    const bool avx2 = __builtin_cpu_supports("avx2") && f16c;
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (cap == "AVX512" && avx512) return avx512_bf16 ? Isa::kAvx512Bf16 : Isa::kAvx512;
    if ((cap == "AVX512" || cap == "AVX2") && avx2) return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return isa;
#else
  return Isa::kScalar;
#endif
}

template <typename scalar_t, typename acc_t>
void rotate_run(const Run<scalar_t, acc_t>& r, int64_t dim, bool interleaved, Isa isa, bool nt) {
#if defined(ROTARY_X86_SIMD)
  if constexpr (std::is_same_v<acc_t, float>) {
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (isa == Isa::kAvx512Bf16) return rotate_run_Avx512Bf16<scalar_t>(r, dim, interleaved, nt);
    }
    if (isa >= Isa::kAvx512) return rotate_run_Avx512<scalar_t>(r, dim, interleaved, nt);
    if (isa == Isa::kAvx2) return rotate_run_Avx2<scalar_t>(r, dim, interleaved, nt);
  }
#endif
  rotate_run_scalar(r, dim, interleaved);
}

template <typename acc_t>
void fill_token(const RopeParams& p, int64_t pos, acc_t* coef, Isa isa) {
#if defined(ROTARY_X86_SIMD)
  if constexpr (std::is_same_v<acc_t, float>) {
    if (isa != Isa::kScalar && pos >= 0 && pos < p.freqs_len && p.freqs_stride_pair == 1) {
      return isa >= Isa::kAvx512 ? fill_coefficients_Avx512(p, pos, coef) : fill_coefficients_Avx2(p, pos, coef);
    }
  }
#endif
  fill_coefficients(p, pos, coef);
}

// ---------------------------------------------------------------------------
// Driver

// Tokens per task: a head is streamed in runs of that many tokens (the L2
// prefetcher restarts at every 4 KiB page, so longer is better), and their
// coefficients (2 * rotary_dim acc_t each) stay within L2.
constexpr int64_t kCoefBytes = 64 * 1024;
// Outputs of at least this many bytes are written with streaming stores: they
// cannot stay in cache anyway, and skipping the read-for-ownership of every
// output line saves a third of the memory traffic.
constexpr int64_t kStreamBytes = int64_t{16} << 20;
// At least this many elements per parallel chunk.
constexpr int64_t kGrainElems = int64_t{1} << 15;

// Streaming stores need every store aligned to its width (up to 64 bytes):
// out of place, contiguous head vectors at 64-byte aligned addresses, and
// halves of rotary_dim that keep that alignment.
template <typename scalar_t>
bool can_stream(const RopeParams& p, const HeadTensor& t) {
  const int64_t elem = sizeof(scalar_t);
  if (p.in_place || p.rotary_dim != p.head_dim || t.out_stride[3] != 1) return false;
  if (reinterpret_cast<uintptr_t>(t.out) % 64 != 0 || (p.rotary_dim / 2 * elem) % 64 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if ((t.out_stride[d] * elem) % 64 != 0) return false;
  }
  return true;
}

// Out of place, dims [rotary_dim, head_dim) of every vector of the run are
// copied unchanged (partial rotary).
template <typename scalar_t, typename acc_t>
void copy_pass_through(const Run<scalar_t, acc_t>& r, int64_t rotary_dim, int64_t head_dim) {
  for (int64_t t = 0; t < r.tokens; ++t) {
    for (int64_t h = 0; h < r.heads; ++h) {
      const scalar_t* in = r.in + t * r.in_tok + h * r.in_head;
      scalar_t* out = r.out + t * r.out_tok + h * r.out_head;
      if (r.in_inner == 1 && r.out_inner == 1) {
        std::memcpy(out + rotary_dim, in + rotary_dim, (head_dim - rotary_dim) * sizeof(scalar_t));
      } else {
        for (int64_t i = rotary_dim; i < head_dim; ++i) out[i * r.out_inner] = in[i * r.in_inner];
      }
    }
  }
}

template <typename scalar_t>
void rotate_tensor_tile(
    const RopeParams& p, const HeadTensor& t, int64_t b, int64_t s0, int64_t tile,
    const at::opmath_type<scalar_t>* coef, Isa isa, bool nt) {
  const int64_t dim = p.rotary_dim;
  const auto abs64 = [](int64_t v) { return v < 0 ? -v : v; };
  const Run<scalar_t, at::opmath_type<scalar_t>> r{
      static_cast<const scalar_t*>(t.in) + b * t.in_stride[0] + s0 * t.in_stride[2],
      static_cast<scalar_t*>(t.out) + b * t.out_stride[0] + s0 * t.out_stride[2],
      tile, t.in_stride[2], t.out_stride[2], 2 * dim,
      t.heads, t.in_stride[1], t.out_stride[1],
      t.in_stride[3], t.out_stride[3],
      coef,
      /*tokens_outer=*/tile == 1 || abs64(t.in_stride[2]) > abs64(t.in_stride[1])};
  rotate_run(r, dim, p.interleaved, isa, nt);
  if (!p.in_place && p.head_dim > dim) copy_pass_through(r, dim, p.head_dim);
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
  const Isa isa = detect_isa();
  const int64_t out_bytes = (p.q.heads + p.k.heads) * p.batch * p.seq * p.head_dim * int64_t(sizeof(scalar_t));
  const bool big = isa != Isa::kScalar && out_bytes >= kStreamBytes;
  const bool nt_q = big && can_stream<scalar_t>(p, p.q);
  const bool nt_k = big && p.k.heads > 0 && can_stream<scalar_t>(p, p.k);

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    // Uninitialised: every value is written by fill_token before it is read.
    const std::unique_ptr<acc_t[]> coef(new acc_t[static_cast<size_t>(tile * coef_per_token)]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tiles_per_batch;
      const int64_t s0 = (task % tiles_per_batch) * tile;
      const int64_t n = std::min(tile, p.seq - s0);
      for (int64_t s = 0; s < n; ++s) {
        fill_token(p, kernel::position_of(p, b, s0 + s), coef.get() + s * coef_per_token, isa);
      }
      rotate_tensor_tile<scalar_t>(p, p.q, b, s0, n, coef.get(), isa, nt_q);
      if (p.k.heads > 0) rotate_tensor_tile<scalar_t>(p, p.k, b, s0, n, coef.get(), isa, nt_k);
    }
#if defined(ROTARY_X86_SIMD)
    if (nt_q || nt_k) _mm_sfence();  // order the streaming stores before returning
#endif
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
