// Element types of the CUDA kernel: the accumulate type of each storage type
// and 16-byte vectors read and written as packed pairs. No torch headers, so
// the host-emulation test compiles it with g++.
#pragma once

#include "params/rope_params.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace rotary {
namespace kernel {

// fp32 math for every storage type except fp64; one rounding on the store.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

ROTARY_HOST_DEVICE float to_acc(float v) { return v; }
ROTARY_HOST_DEVICE double to_acc(double v) { return v; }
ROTARY_HOST_DEVICE float to_acc(__half v) { return __half2float(v); }
ROTARY_HOST_DEVICE float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
ROTARY_HOST_DEVICE T from_acc(typename Acc<T>::type v);
template <>
ROTARY_HOST_DEVICE float from_acc<float>(float v) { return v; }
template <>
ROTARY_HOST_DEVICE double from_acc<double>(double v) { return v; }
template <>
ROTARY_HOST_DEVICE __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
ROTARY_HOST_DEVICE __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Every storage type the kernels are built for, as an X-macro for the
// launches' explicit instantiations.
#define ROTARY_CUDA_STORAGE_TYPES(X) X(float) X(double) X(__half) X(__nv_bfloat16)

constexpr int kVectorBytes = 16;

// 16 bytes of any element type, as 32-bit words: a 16-bit pair is one word,
// so conversions work on packed pairs (one instruction each on the device).
struct alignas(kVectorBytes) Vector {
  uint32_t w[4];
};

ROTARY_HOST_DEVICE float word_to_float(uint32_t w) { return float_of_bits(w); }
ROTARY_HOST_DEVICE uint32_t float_to_word(float f) { return bits_of_float(f); }
template <typename P>
ROTARY_HOST_DEVICE uint32_t pack_word(P pair) {
  uint32_t w;
  std::memcpy(&w, &pair, sizeof w);
  return w;
}

// Global accesses with a cache policy (plain accesses on the host, where the
// emulation runs the same body). q and k are touched once: their 16-byte
// loads and stores stream (ld/st.global.cs, evict first). Every row reads the
// same table rows: their loads ask L2 to keep them (evict last, sm_80+).
ROTARY_HOST_DEVICE Vector load_stream(const Vector* p) {
#if defined(__CUDA_ARCH__)
  const uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
  Vector v;
  v.w[0] = u.x;
  v.w[1] = u.y;
  v.w[2] = u.z;
  v.w[3] = u.w;
  return v;
#else
  return *p;
#endif
}
ROTARY_HOST_DEVICE void store_stream(Vector* p, const Vector& v) {
#if defined(__CUDA_ARCH__)
  __stcs(reinterpret_cast<uint4*>(p), make_uint4(v.w[0], v.w[1], v.w[2], v.w[3]));
#else
  *p = v;
#endif
}
// The same for a vector's fp8 bytes (the prologue's fp8 q: 8 or 4 bytes).
ROTARY_HOST_DEVICE void store_stream(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  __stcs(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  *p = v;
#endif
}
ROTARY_HOST_DEVICE void store_stream(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  __stcs(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
#else
  *p = v;
#endif
}
// A 16-byte store with the default policy (the cache rows, which attention
// reads next) as one st.global.v4: a plain uint4 store may be split into
// words, and __stwb is a strong store.
ROTARY_HOST_DEVICE void store_vector(Vector* p, const Vector& v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]),
               "r"(v.w[3])
               : "memory");
#else
  *p = v;
#endif
}
constexpr int64_t kLineBytes = 128;  // an L2 line, the prefetch's unit

// Asks L2 for the kLineBytes line at p (a hint, no register, nothing waits
// on it): a thread's next row, so two rows of bytes are in flight per thread.
ROTARY_HOST_DEVICE void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}
ROTARY_HOST_DEVICE float4 load_table(const float4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float4 v;
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p), "l"(policy));
  return v;
#else
  return *p;
#endif
}
// One pair's (cos, sin), with the same policy (N-D positions: each pair its
// own row).
ROTARY_HOST_DEVICE float2 load_table_pair(const float2* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float2 v;
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm("ld.global.nc.L2::cache_hint.v2.f32 {%0, %1}, [%2], %3;" : "=f"(v.x), "=f"(v.y) : "l"(p), "l"(policy));
  return v;
#else
  return *p;
#endif
}

// Elements 2k and 2k+1 of a vector, read and written in the accumulate type.
template <typename T>
struct Pairs;
template <>
struct Pairs<float> {
  ROTARY_HOST_DEVICE static void get(const Vector& v, int k, float& a, float& b) {
    a = word_to_float(v.w[2 * k]);
    b = word_to_float(v.w[2 * k + 1]);
  }
  ROTARY_HOST_DEVICE static void put(Vector& v, int k, float a, float b) {
    v.w[2 * k] = float_to_word(a);
    v.w[2 * k + 1] = float_to_word(b);
  }
};
template <>
struct Pairs<double> {
  ROTARY_HOST_DEVICE static void get(const Vector& v, int k, double& a, double& b) {
    std::memcpy(&a, &v.w[4 * k], sizeof a);
    std::memcpy(&b, &v.w[4 * k + 2], sizeof b);
  }
  ROTARY_HOST_DEVICE static void put(Vector& v, int k, double a, double b) {
    std::memcpy(&v.w[4 * k], &a, sizeof a);
    std::memcpy(&v.w[4 * k + 2], &b, sizeof b);
  }
};
template <>
struct Pairs<__nv_bfloat16> {  // bf16 is the top half of a float
  ROTARY_HOST_DEVICE static void get(const Vector& v, int k, float& a, float& b) {
    a = word_to_float(v.w[k] << 16);
    b = word_to_float(v.w[k] & 0xffff0000u);
  }
  ROTARY_HOST_DEVICE static void put(Vector& v, int k, float a, float b) {
    v.w[k] = pack_word(__floats2bfloat162_rn(a, b));
  }
};
template <>
struct Pairs<__half> {
  ROTARY_HOST_DEVICE static void get(const Vector& v, int k, float& a, float& b) {
    __half_raw lo, hi;
    lo.x = static_cast<unsigned short>(v.w[k] & 0xffffu);
    hi.x = static_cast<unsigned short>(v.w[k] >> 16);
    a = __half2float(__half(lo));
    b = __half2float(__half(hi));
  }
  ROTARY_HOST_DEVICE static void put(Vector& v, int k, float a, float b) {
    v.w[k] = pack_word(__floats2half2_rn(a, b));
  }
};

}  // namespace kernel
}  // namespace rotary
