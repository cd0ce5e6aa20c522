// Framework-free CUDA kernel for RoPE: raw pointers, int64 strides, a stream.
// No torch headers, so this compiles in seconds with nvcc and, for the
// host-emulation test, with g++ (rope_thread is __host__ __device__).
#pragma once

#include "../rope_params.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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

constexpr int kVectorBytes = 16;

// Pairs one thread rotates per head: one 16-byte vector (interleaved) or one
// vector from each half (half split); a single pair on the strided path.
template <typename T, bool kInterleaved, bool kVectorized>
struct Tile {
  static constexpr int kElems = kVectorBytes / static_cast<int>(sizeof(T));
  static constexpr int kPairs = !kVectorized ? 1 : (kInterleaved ? kElems / 2 : kElems);
};

template <typename T>
struct alignas(kVectorBytes) Vector {
  T v[kVectorBytes / sizeof(T)];
};

// Grid shape: thread = (row, head block, group), group fastest so that
// neighbouring threads touch neighbouring bytes. Groups [0, rotary_groups)
// rotate pairs; the rest copy the pass-through dims [rotary_dim, head_dim)
// (none in place, where those dims are already where they belong).
struct Grid {
  int64_t rotary_groups;     // pair groups per head
  int64_t groups;            // rotary groups + pass-through groups
  int64_t heads_per_thread;  // heads of q and k one thread walks through
  int64_t head_blocks;
  int64_t threads;
};

template <typename T, bool kInterleaved, bool kVectorized>
inline Grid make_grid(const RopeParams& p, int64_t heads_per_thread) {
  constexpr int kPairs = Tile<T, kInterleaved, kVectorized>::kPairs;
  constexpr int kCopyElems = kVectorized ? Tile<T, kInterleaved, kVectorized>::kElems : 1;
  Grid g;
  g.rotary_groups = (p.rotary_dim / 2) / kPairs;
  g.groups = g.rotary_groups + (p.in_place ? 0 : (p.head_dim - p.rotary_dim) / kCopyElems);
  g.heads_per_thread = heads_per_thread;
  const int64_t heads = p.q.heads + p.k.heads;
  g.head_blocks = (heads + heads_per_thread - 1) / heads_per_thread;
  g.threads = p.batch * p.seq * g.head_blocks * g.groups;
  return g;
}

template <typename T, bool kInterleaved, bool kVectorized>
ROTARY_HOST_DEVICE void rotate_tile(
    const HeadTensor& t, int64_t h, int64_t b, int64_t s, int64_t j0, int64_t rotary_dim,
    const typename Acc<T>::type* cos, const typename Acc<T>::type* sin) {
  using acc_t = typename Acc<T>::type;
  using TileT = Tile<T, kInterleaved, kVectorized>;
  const T* in = static_cast<const T*>(t.in) + b * t.in_stride[0] + h * t.in_stride[1] + s * t.in_stride[2];
  T* out = static_cast<T*>(t.out) + b * t.out_stride[0] + h * t.out_stride[1] + s * t.out_stride[2];
  if constexpr (!kVectorized) {
    const int64_t i0 = pair_first(j0, rotary_dim, kInterleaved);
    const int64_t i1 = pair_second(j0, rotary_dim, kInterleaved);
    acc_t y0, y1;
    rotate_pair<acc_t>(to_acc(in[i0 * t.in_stride[3]]), to_acc(in[i1 * t.in_stride[3]]), cos[0], sin[0], y0, y1);
    out[i0 * t.out_stride[3]] = from_acc<T>(y0);
    out[i1 * t.out_stride[3]] = from_acc<T>(y1);
  } else if constexpr (kInterleaved) {
    const Vector<T> x = *reinterpret_cast<const Vector<T>*>(in + 2 * j0);
    Vector<T> y;
#pragma unroll
    for (int j = 0; j < TileT::kPairs; ++j) {
      acc_t y0, y1;
      rotate_pair<acc_t>(to_acc(x.v[2 * j]), to_acc(x.v[2 * j + 1]), cos[j], sin[j], y0, y1);
      y.v[2 * j] = from_acc<T>(y0);
      y.v[2 * j + 1] = from_acc<T>(y1);
    }
    *reinterpret_cast<Vector<T>*>(out + 2 * j0) = y;
  } else {
    const int64_t half = rotary_dim / 2;
    const Vector<T> lo = *reinterpret_cast<const Vector<T>*>(in + j0);
    const Vector<T> hi = *reinterpret_cast<const Vector<T>*>(in + half + j0);
    Vector<T> ylo, yhi;
#pragma unroll
    for (int j = 0; j < TileT::kPairs; ++j) {
      acc_t y0, y1;
      rotate_pair<acc_t>(to_acc(lo.v[j]), to_acc(hi.v[j]), cos[j], sin[j], y0, y1);
      ylo.v[j] = from_acc<T>(y0);
      yhi.v[j] = from_acc<T>(y1);
    }
    *reinterpret_cast<Vector<T>*>(out + j0) = ylo;
    *reinterpret_cast<Vector<T>*>(out + half + j0) = yhi;
  }
}

// Copies one pass-through chunk (a vector, or one element) at offset `at`.
template <typename T, bool kVectorized>
ROTARY_HOST_DEVICE void copy_tile(const HeadTensor& t, int64_t h, int64_t b, int64_t s, int64_t at) {
  const T* in = static_cast<const T*>(t.in) + b * t.in_stride[0] + h * t.in_stride[1] + s * t.in_stride[2];
  T* out = static_cast<T*>(t.out) + b * t.out_stride[0] + h * t.out_stride[1] + s * t.out_stride[2];
  if constexpr (kVectorized) {
    *reinterpret_cast<Vector<T>*>(out + at) = *reinterpret_cast<const Vector<T>*>(in + at);
  } else {
    out[at * t.out_stride[3]] = in[at * t.in_stride[3]];
  }
}

// The body of one CUDA thread, as a plain function of its index so that a
// CPU test can run the whole grid and check the indexing without a GPU.
template <typename T, bool kInterleaved, bool kVectorized>
ROTARY_HOST_DEVICE void rope_thread(const RopeParams& p, const Grid& g, int64_t thread) {
  using acc_t = typename Acc<T>::type;
  using TileT = Tile<T, kInterleaved, kVectorized>;
  const int64_t group = thread % g.groups;
  const int64_t rest = thread / g.groups;
  const int64_t head_block = rest % g.head_blocks;
  const int64_t row = rest / g.head_blocks;
  const int64_t b = row / p.seq;
  const int64_t s = row % p.seq;
  const int64_t h_begin = head_block * g.heads_per_thread;
  int64_t h_end = h_begin + g.heads_per_thread;
  if (h_end > p.q.heads + p.k.heads) h_end = p.q.heads + p.k.heads;

  if (group >= g.rotary_groups) {
    const int64_t at = p.rotary_dim + (group - g.rotary_groups) * (kVectorized ? TileT::kElems : 1);
    for (int64_t h = h_begin; h < h_end; ++h) {
      if (h < p.q.heads) {
        copy_tile<T, kVectorized>(p.q, h, b, s, at);
      } else {
        copy_tile<T, kVectorized>(p.k, h - p.q.heads, b, s, at);
      }
    }
    return;
  }

  // cos/sin read once per (token, pair) and reused for every head below.
  const int64_t j0 = group * TileT::kPairs;
  const int64_t pos = position_of(p, b, s);
  acc_t cos[TileT::kPairs], sin[TileT::kPairs];
#pragma unroll
  for (int j = 0; j < TileT::kPairs; ++j) rotation_of<acc_t>(p, pos, j0 + j, cos[j], sin[j]);

  for (int64_t h = h_begin; h < h_end; ++h) {
    if (h < p.q.heads) {
      rotate_tile<T, kInterleaved, kVectorized>(p.q, h, b, s, j0, p.rotary_dim, cos, sin);
    } else {
      rotate_tile<T, kInterleaved, kVectorized>(p.k, h - p.q.heads, b, s, j0, p.rotary_dim, cos, sin);
    }
  }
}

// True when every load and store of q and k can be one aligned 16-byte vector.
template <typename T>
inline bool can_vectorize(const RopeParams& p) {
  constexpr int64_t kElems = kVectorBytes / sizeof(T);
  const int64_t span = p.interleaved ? p.rotary_dim : p.rotary_dim / 2;
  if (span % kElems != 0 || (p.head_dim - p.rotary_dim) % kElems != 0) return false;
  auto aligned = [](const HeadTensor& t) {
    if (t.heads == 0) return true;
    if (t.in_stride[3] != 1 || t.out_stride[3] != 1) return false;
    if (reinterpret_cast<uintptr_t>(t.in) % kVectorBytes != 0) return false;
    if (reinterpret_cast<uintptr_t>(t.out) % kVectorBytes != 0) return false;
    for (int d = 0; d < 3; ++d) {
      if ((t.in_stride[d] * static_cast<int64_t>(sizeof(T))) % kVectorBytes != 0) return false;
      if ((t.out_stride[d] * static_cast<int64_t>(sizeof(T))) % kVectorBytes != 0) return false;
    }
    return true;
  };
  return aligned(p.q) && aligned(p.k);
}

#if defined(__CUDACC__)
template <typename T, bool kInterleaved, bool kVectorized>
__global__ void __launch_bounds__(256) rope_kernel(const RopeParams p, const Grid g) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < g.threads; t += stride) {
    rope_thread<T, kInterleaved, kVectorized>(p, g, t);
  }
}
#endif

}  // namespace kernel
}  // namespace rotary
