// Framework-free description of one RoPE launch, shared by the CPU and CUDA
// kernels. No torch headers here: the CUDA translation units include this file.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ROTARY_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ROTARY_HOST_DEVICE inline
#endif

namespace rotary {
namespace kernel {

// One of q or k, viewed as [batch, heads, seq, head_dim]. Strides are in
// elements and are read as given: transposed views and slices of a packed qkv
// tensor run without a copy.
struct HeadTensor {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;  // 0 means "not present" (single-tensor op)
  int64_t in_stride[4] = {0, 0, 0, 0};
  int64_t out_stride[4] = {0, 0, 0, 0};
};

struct RopeParams {
  HeadTensor q;
  HeadTensor k;
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;  // even; pairs = head_dim / 2

  // complex64 table [freqs_len, head_dim / 2], read as (cos, sin) float pairs.
  const float* freqs = nullptr;
  int64_t freqs_len = 0;
  int64_t freqs_stride_pos = 0;   // in complex elements
  int64_t freqs_stride_pair = 0;  // in complex elements

  // position(b, s) = start_pos + positions[b, s] (+ s when positions are
  // offsets). Without a positions tensor: start_pos + s.
  int64_t start_pos = 0;
  const int64_t* positions = nullptr;
  int64_t pos_stride_b = 0;
  int64_t pos_stride_s = 0;
  bool positions_are_offsets = true;

  bool interleaved = true;  // pairs (2j, 2j+1); false: (j, j + head_dim/2)
  bool inverse = false;     // rotate by -angle (the backward pass)
};

ROTARY_HOST_DEVICE int64_t position_of(const RopeParams& p, int64_t b, int64_t s) {
  int64_t pos = p.start_pos;
  if (p.positions == nullptr) return pos + s;
  pos += p.positions[b * p.pos_stride_b + s * p.pos_stride_s];
  return p.positions_are_offsets ? pos + s : pos;
}

// Element offsets of the two members of pair j inside one head vector.
ROTARY_HOST_DEVICE int64_t pair_first(int64_t j, int64_t head_dim, bool interleaved) {
  return interleaved ? 2 * j : j;
}
ROTARY_HOST_DEVICE int64_t pair_second(int64_t j, int64_t head_dim, bool interleaved) {
  return interleaved ? 2 * j + 1 : j + head_dim / 2;
}

// The whole of RoPE for one pair: a 2-D rotation by an angle with the given
// cosine and sine. Every backend calls this (or its vectorised twin).
template <typename acc_t>
ROTARY_HOST_DEVICE void rotate_pair(acc_t x0, acc_t x1, acc_t c, acc_t s, acc_t& y0, acc_t& y1) {
  y0 = x0 * c - x1 * s;
  y1 = x0 * s + x1 * c;
}

}  // namespace kernel
}  // namespace rotary
