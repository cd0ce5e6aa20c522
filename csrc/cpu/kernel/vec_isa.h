// The few operations at::vec does not offer, one definition per CPU
// capability (the translation unit's CPU_CAPABILITY_* macro picks it):
//   load         one vector of storage type T, widened to acc_t
//   swap_pairs   (x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...)
//   store<NT>    one vector to storage type T; NT: a streaming (non-temporal)
//                store, whose address the caller aligns to the vector width
//   bf16_words   two fp32 vectors rounded to bf16, interleaved: one 32-bit
//                word per lane (x86 builds), stored with put<NT>
//   bf16_members one vector of such words widened: the low (even) and the
//                high (odd) bf16 of each word (x86 builds)
//   stream_fence orders streaming stores before the task returns
//   store_fp8    one vector of floats divided by a scale, as float8_e4m3fn
// Conversions to 16-bit types round to nearest even with canonical NaNs, the
// bits of c10::BFloat16(float) and of c10::Half(float) on the DEFAULT build
// (0x7FC0; sign | 0x7E00), so every capability writes the same bits.
// at::vec's own conversions differ there (0xFFFF for a bf16 NaN, payloads
// kept for fp16) and so are not used.
#pragma once

#include "params/fp8.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace rotary {
namespace cpu {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

// One vector's worth of storage type T, widened exactly (16-bit to float).
template <typename scalar_t, typename acc_t>
inline Vectorized<acc_t> load(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return Vectorized<acc_t>::loadu(p);
  } else {
    Vectorized<float> v;
    at::vec::load_to_float(p, v);
    return v;
  }
}

// Scalar conversion with the same rules (tails, strided vectors); acc_t is
// float or double.
template <typename T, typename acc_t>
inline T to_storage(acc_t v) {
  return static_cast<T>(v);
}
template <>
inline c10::Half to_storage<c10::Half>(float v) {
  if (std::isnan(v)) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return c10::Half(static_cast<uint16_t>((u >> 16 & 0x8000u) | 0x7E00u), c10::Half::from_bits());
  }
  return c10::Half(v);
}
template <>
inline c10::BFloat16 to_storage<c10::BFloat16>(float v) {
  return c10::BFloat16(c10::detail::round_to_nearest_even(v), c10::BFloat16::from_bits());
}

#if defined(CPU_CAPABILITY_AVX512)

inline Vectorized<float> swap_pairs(const Vectorized<float>& x) {
  return _mm512_permute_ps(x, 0xB1);
}
inline Vectorized<double> swap_pairs(const Vectorized<double>& x) {
  return _mm512_permute_pd(x, 0x55);
}
// v rounded to bf16 by integer arithmetic, in the high half of each 32-bit
// lane (NaN: 0x7FC0); the low half is left for the caller to shift out or
// clear.
inline __m512i bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
#if defined(__AVX512BF16__)
// The AVX512_BF16 build converts with vcvtne(2)ps2bf16, which rounds to
// nearest even as above except in two cases: it keeps a NaN's sign and
// payload, and flushes fp32 denormals to zero. A vector with either takes
// the integer rounding, so every build writes the same bits.
inline bool bf16_insn_exact(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0;  // quiet NaN, denormal, signalling NaN
}
#endif
inline __m256i bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  if (bf16_insn_exact(v)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(v), 16));
}
// One 32-bit word per lane: bf16(lo) in its low half, bf16(hi) in its high.
inline __m512i bf16_words(__m512 lo, __m512 hi) {
#if defined(__AVX512BF16__)
  if (bf16_insn_exact(lo) && bf16_insn_exact(hi)) {
    // The instruction packs lo's 16 values, then hi's; interleave them.
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
#endif
  return _mm512_or_si512(_mm512_srli_epi32(bf16_high(lo), 16),
                         _mm512_and_si512(bf16_high(hi), _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m256i half_bits(__m512 v) {
  const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  if (nan == 0) return h;  // NaN lanes are rare: canonicalise only vectors with one
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)), 16);
  const __m256i canon = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7E00)));
  return _mm256_mask_mov_epi16(h, nan, canon);
}
template <bool NT>
inline void put(void* p, __m256i v) {
  NT ? _mm256_stream_si256(static_cast<__m256i*>(p), v) : _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
inline void bf16_members(const c10::BFloat16* p, Vectorized<float>& even, Vectorized<float>& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
template <bool NT>
inline void put(void* p, __m512i v) {
  NT ? _mm512_stream_si512(static_cast<__m512i*>(p), v) : _mm512_storeu_si512(p, v);
}
template <bool NT>
inline void store(float* p, const Vectorized<float>& v) {
  NT ? _mm512_stream_ps(p, v) : v.store(p);
}
template <bool NT>
inline void store(double* p, const Vectorized<double>& v) {
  NT ? _mm512_stream_pd(p, v) : v.store(p);
}

#elif defined(CPU_CAPABILITY_AVX2)

inline Vectorized<float> swap_pairs(const Vectorized<float>& x) {
  return _mm256_permute_ps(x, 0xB1);
}
inline Vectorized<double> swap_pairs(const Vectorized<double>& x) {
  return _mm256_permute_pd(x, 0x5);
}
// 16-bit results in the low half of each 32-bit lane, packed to 8 x u16.
inline __m128i pack_low16(__m256i r) {
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
// v rounded to nearest even into the high half of each lane, NaN lanes not
// made canonical. The lowest kept bit comes by two shifts, so the bias is
// the one constant (gcc re-broadcast two inside the loop).
inline __m256i bf16_rounded(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_srli_epi32(_mm256_slli_epi32(u, 15), 31);
  return _mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF));
}
// As on AVX512: bf16 in the high half of each lane (NaN: 0x7FC0, the low
// half left as it is), the blend only for vectors that hold a NaN.
inline __m256i bf16_high(__m256 v) {
  __m256i r = bf16_rounded(v);
  const __m256 unord = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(unord) != 0) {
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(unord));
  }
  return r;
}
inline __m128i bf16_bits(__m256 v) {
  return pack_low16(_mm256_srli_epi32(bf16_high(v), 16));
}
// The rounding is port-bound on AVX2 (no bf16 instruction), so the pair
// takes one NaN test for both vectors and one word blend (lo's bf16 from
// the low half, hi's kept in the high half).
inline __m256i bf16_words(__m256 lo, __m256 hi) {
  __m256i w = _mm256_blend_epi16(_mm256_srli_epi32(bf16_rounded(lo), 16), bf16_rounded(hi), 0xAA);
  if (_mm256_movemask_ps(_mm256_cmp_ps(lo, hi, _CMP_UNORD_Q)) != 0) {
    w = _mm256_blend_epi16(_mm256_srli_epi32(bf16_high(lo), 16), bf16_high(hi), 0xAA);
  }
  return w;
}
inline __m128i half_bits(__m256 v) {
  const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 unord = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(unord) == 0) return h;  // as on AVX512: only vectors with a NaN
  const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(INT32_MIN)), 16);
  const __m128i canon = pack_low16(_mm256_or_si256(sign, _mm256_set1_epi32(0x7E00)));
  const __m128i nan = pack_low16(_mm256_srli_epi32(_mm256_castps_si256(unord), 16));
  return _mm_blendv_epi8(h, canon, nan);
}
inline void bf16_members(const c10::BFloat16* p, Vectorized<float>& even, Vectorized<float>& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
template <bool NT>
inline void put(void* p, __m128i v) {
  NT ? _mm_stream_si128(static_cast<__m128i*>(p), v) : _mm_storeu_si128(static_cast<__m128i*>(p), v);
}
template <bool NT>
inline void put(void* p, __m256i v) {
  NT ? _mm256_stream_si256(static_cast<__m256i*>(p), v) : _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
template <bool NT>
inline void store(float* p, const Vectorized<float>& v) {
  NT ? _mm256_stream_ps(p, v) : v.store(p);
}
template <bool NT>
inline void store(double* p, const Vectorized<double>& v) {
  NT ? _mm256_stream_pd(p, v) : v.store(p);
}

#else  // DEFAULT: at::vec's portable arrays; no streaming stores.

template <typename acc_t>
inline Vectorized<acc_t> swap_pairs(const Vectorized<acc_t>& x) {
  __at_align__ acc_t a[Vectorized<acc_t>::size()];
  x.store(a);
  for (int i = 0; i < Vectorized<acc_t>::size(); i += 2) std::swap(a[i], a[i + 1]);
  return Vectorized<acc_t>::loadu(a);
}
template <bool NT, typename T, typename acc_t>
inline void store(T* p, const Vectorized<acc_t>& v) {
  if constexpr (std::is_same_v<T, acc_t>) {
    v.store(p);
  } else {
    __at_align__ acc_t a[Vectorized<acc_t>::size()];
    v.store(a);
    for (int i = 0; i < Vectorized<acc_t>::size(); ++i) p[i] = to_storage<T>(a[i]);
  }
}
inline void stream_fence() {}

#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Both x86 ISAs: 16-bit outputs are stored as their packed bits.
template <bool NT>
inline void store(c10::BFloat16* p, const Vectorized<float>& v) {
  put<NT>(p, bf16_bits(v));
}
template <bool NT>
inline void store(c10::Half* p, const Vectorized<float>& v) {
  put<NT>(p, half_bits(v));
}
inline void stream_fence() {
  _mm_sfence();
}
#endif

// v / *scale (null: v) clamped to +-448, as float8_e4m3fn bytes into p:
// kernel::quantize_fp8 lane by lane. The x86 builds divide, clamp keeping
// NaN (compares, not min/max), and run fp8_e4m3fn_bits' integer arithmetic
// with its three candidates selected, in vector registers; elsewhere (where
// at::vec's integer vectors may be arrays) each lane is quantized as a
// scalar. Every build writes the scalar encoder's bytes.
inline void store_fp8(uint8_t* p, Vectorized<float> v, const float* scale) {
  using VF = Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  using VI = Vectorized<int32_t>;
  static_assert(VF::size() == VI::size(), "one int32 lane per float lane");
  // fp8_e4m3fn_bits' constants as int32 lanes: its two bounds are below
  // 2^31, so signed compares hold, and the bias adds as its unsigned sum does.
  const VI denorm(static_cast<int32_t>(kernel::kFp8DenormBits));
  const VF top(kernel::kFp8Max), bottom(-kernel::kFp8Max);
  if (scale != nullptr) v = v / VF(*scale);
  v = VF::blendv(v, top, v > top);
  v = VF::blendv(v, bottom, v < bottom);
  const VI bits = at::vec::cast<int32_t>(v);
  const VI sign = bits & VI(std::numeric_limits<int32_t>::min());
  const VI mag = bits & VI(std::numeric_limits<int32_t>::max());
  const VI subnormal = at::vec::cast<int32_t>(at::vec::cast<float>(mag) + at::vec::cast<float>(denorm)) - denorm;
  const VI normal = (mag + VI(static_cast<int32_t>(kernel::kFp8NormalBias)) + ((mag >> VI(20)) & VI(1))) >> VI(20);
  VI r = VI::blendv(normal, subnormal, mag < VI(static_cast<int32_t>(kernel::kFp8NormalFrom)));
  r = VI::blendv(r, VI(0x7f), mag >= VI(static_cast<int32_t>(kernel::kFp8NanFrom)));
  r = r | (sign >> VI(24));  // the sign's byte, 0x80, in the low byte
  // Each lane's low byte, packed.
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
#else
  const __m256i bytes = _mm256_shuffle_epi8(  // per 128-bit half: its lanes' low bytes in its low word
      r, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                          -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i words = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
#endif
#else
  __at_align__ float a[VF::size()];
  v.store(a);
  for (int i = 0; i < VF::size(); ++i) p[i] = kernel::quantize_fp8(a[i], scale);
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace cpu
}  // namespace rotary
