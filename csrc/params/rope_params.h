// Framework-free description of one RoPE launch, shared by the CPU and CUDA
// kernels. No torch headers here: the CUDA translation units include this file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ROTARY_HOST_DEVICE __host__ __device__ __forceinline__
#define ROTARY_COLD inline __host__ __device__ __noinline__  // a subroutine: its registers stay out of the caller's
#else
#define ROTARY_HOST_DEVICE inline
#define ROTARY_COLD inline
#endif

namespace rotary {
namespace kernel {

// Most pairs (rotary_dim / 2) and position axes an N-D call may have.
constexpr int64_t kMaxPairs = 512;
constexpr int64_t kMaxAxes = 16;

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
  int64_t head_dim = 0;
  // Dims [rotary_offset, rotary_offset + rotary_dim) are rotated; the others
  // pass through (copied out of place, untouched in place). rotary_dim is even
  // and the span fits in head_dim.
  int64_t rotary_dim = 0;
  int64_t rotary_offset = 0;
  bool in_place = false;  // out == in for q and k

  // complex64 table [freqs_len, rotary_dim / 2], read as (cos, sin) floats.
  const float* freqs = nullptr;
  int64_t freqs_len = 0;
  int64_t freqs_stride_pos = 0;   // in complex elements
  int64_t freqs_stride_pair = 0;  // in complex elements
  // float64 [rotary_dim / 2] (optional). With it, a position outside the
  // table is computed exactly instead of being an error (NaN on the device).
  const double* inv_freq = nullptr;
  int64_t inv_freq_stride = 0;

  // The one integer tensor of the call, int32 or int64, read in place:
  //   offsets       position(b, s) = start_pos + offsets[b] + local index
  //                 (packed: offsets[n] of the token's sequence n)
  //   position_ids  position(b, s) = ids[b, s] (absolute; start_pos is 0)
  // Without one: start_pos + local index.
  int64_t start_pos = 0;
  const void* positions = nullptr;
  bool positions_int32 = false;
  int64_t pos_stride_b = 0;
  int64_t pos_stride_s = 0;
  bool positions_are_offsets = true;
  // N-D positions: position_ids has a leading axis dim of num_axes, and pair j
  // reads axis pair_axis[j] (absolute ids). num_axes 0: one position per token.
  int64_t num_axes = 0;
  int64_t pos_stride_axis = 0;
  uint8_t pair_axis[kMaxPairs] = {};

  // Packed variable-length batch ([T, H, D] seen as batch 1, seq T): token s
  // belongs to the last sequence n with cu_seqlens[n] <= s, and its local
  // index is s - cu_seqlens[n]. int32 or int64, num_seqs + 1 entries.
  const void* cu_seqlens = nullptr;
  int64_t cu_seqlens_stride = 1;
  bool cu_seqlens_int32 = false;
  int64_t num_seqs = 0;

  bool interleaved = true;  // pairs (2j, 2j+1); false: (j, j + rotary_dim/2)
  bool inverse = false;     // rotate by -angle (the backward pass)
};

// Bit casts without memcpy on the device (a memcpy there can go through
// local memory).
ROTARY_HOST_DEVICE uint32_t bits_of_float(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
ROTARY_HOST_DEVICE float float_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

ROTARY_HOST_DEVICE int64_t cu_seqlen(const RopeParams& p, int64_t n) {
  const int64_t i = n * p.cu_seqlens_stride;
  return p.cu_seqlens_int32 ? static_cast<const int32_t*>(p.cu_seqlens)[i]
                            : static_cast<const int64_t*>(p.cu_seqlens)[i];
}

// The packed sequence token s belongs to (0 without cu_seqlens): a binary
// search, or, given `from` (the sequence of an earlier token), one load while
// s is still in that sequence and a binary search over the later ones when
// it is not. A walk over increasing tokens then mostly pays one load a token.
ROTARY_HOST_DEVICE int64_t sequence_of(const RopeParams& p, int64_t s, int64_t from = -1) {
  if (p.cu_seqlens == nullptr) return 0;
  int64_t lo = 0, hi = p.num_seqs - 1;  // never leaves [0, num_seqs)
  if (from >= 0 && from <= hi) {
    if (from == hi || cu_seqlen(p, from + 1) > s) return from;
    lo = from + 1;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (cu_seqlen(p, mid) <= s) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The entry of the positions tensor (offset or id) for token (b, s) on `axis`.
ROTARY_HOST_DEVICE int64_t given_position(const RopeParams& p, int64_t b, int64_t s, int64_t axis = 0) {
  const int64_t i = axis * p.pos_stride_axis + b * p.pos_stride_b + s * p.pos_stride_s;
  return p.positions_int32 ? static_cast<const int32_t*>(p.positions)[i]
                           : static_cast<const int64_t*>(p.positions)[i];
}

// The entry of the positions tensor token (b, s) reads: the offset of its
// sequence (the batch row b, or its packed sequence), or its own id.
ROTARY_HOST_DEVICE int64_t entry_of(const RopeParams& p, int64_t b, int64_t s, int64_t sequence) {
  return p.positions_are_offsets ? given_position(p, sequence, 0) : given_position(p, b, s);
}

// Where token (b, s) is: its sequence (b, or its packed sequence with
// cu_seqlens: one search, shared by the rotation and the cache row) and its
// rotary position.
struct TokenPlace {
  int64_t sequence = 0;
  int64_t pos = 0;
};

// `from`: as for sequence_of (a kernel's previous row passes its sequence).
ROTARY_HOST_DEVICE TokenPlace place_of(const RopeParams& p, int64_t b, int64_t s, int64_t from = -1) {
  TokenPlace t;
  t.sequence = b;
  int64_t local = s;  // index of the token inside its own sequence
  if (p.cu_seqlens != nullptr) {
    t.sequence = sequence_of(p, s, from);
    local = s - cu_seqlen(p, t.sequence);
  }
  t.pos = p.positions == nullptr
      ? p.start_pos + local
      : p.start_pos + entry_of(p, b, s, t.sequence) + (p.positions_are_offsets ? local : 0);
  return t;
}

ROTARY_HOST_DEVICE int64_t position_of(const RopeParams& p, int64_t b, int64_t s) {
  return place_of(p, b, s).pos;
}

// The position pair j of token (b, s) turns by; `pos` is position_of(p, b, s).
// N-D ids are absolute, so a token whose axes agree gets the 1-D rotation.
ROTARY_HOST_DEVICE int64_t pair_position(const RopeParams& p, int64_t b, int64_t s, int64_t pos, int64_t j) {
  return p.num_axes == 0 ? pos : p.start_pos + given_position(p, b, s, p.pair_axis[j]);
}

// Element offsets of the two members of pair j inside one head vector.
ROTARY_HOST_DEVICE int64_t pair_first(int64_t j, int64_t rotary_dim, bool interleaved) {
  return interleaved ? 2 * j : j;
}
ROTARY_HOST_DEVICE int64_t pair_second(int64_t j, int64_t rotary_dim, bool interleaved) {
  return interleaved ? 2 * j + 1 : j + rotary_dim / 2;
}

// A product and a sum rounded on their own: nvcc contracts a * b + c into an
// FMA by default, which breaks reduced_angle's error-free transformations
// (the CPU sources build with -ffp-contract=off).
ROTARY_HOST_DEVICE double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
ROTARY_HOST_DEVICE double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// The angle of pair j at pos: the exact product pos * f (f a float64
// frequency) reduced by whole turns. A plain double product rounds pos itself
// past 2^53 and errs by about pos * f * 2^-53 rad; here pos splits into two
// exact doubles, each product stays a double-double (fma), and 2*pi is
// carried to 160 bits, so the error stays below 1e-13 rad up to 2^60. A
// subroutine on the device: the cold path's double-double registers stay out
// of the kernel bodies (inlined, the prologue kernel spilled).
ROTARY_COLD double reduced_angle(int64_t pos, double f) {
  constexpr int64_t kLow = (int64_t{1} << 30) - 1;
  const double hi = static_cast<double>(pos & ~kLow), lo = static_cast<double>(pos & kLow);
  const double p1 = mul_rn(hi, f), e1 = ::fma(hi, f, -p1);
  const double p2 = mul_rn(lo, f), e2 = ::fma(lo, f, -p2);
  const double sum = add_rn(p1, p2), b = add_rn(sum, -p1);
  const double t = add_rn(add_rn(p1, -add_rn(sum, -b)), add_rn(p2, -b));
  const double tail = add_rn(add_rn(t, e1), e2);  // pos * f = sum + tail
  constexpr double kTurn1 = 0x1.921fb54442d18p+2, kTurn2 = 0x1.1a62633145c07p-52, kTurn3 = -0x1.f1976b7ed8fbcp-108;
  const double k = ::rint(mul_rn(sum, 0x1.45f306dc9c883p-3));  // whole turns (1 / 2pi)
  const double q = mul_rn(k, kTurn1), qe = ::fma(k, kTurn1, -q);  // sum - q is exact
  const double r = add_rn(add_rn(sum, -q), add_rn(tail, -qe));
  return add_rn(add_rn(r, -mul_rn(k, kTurn2)), -mul_rn(k, kTurn3));
}

// cos and sin of pos * f in float64 (reduced_angle): the kernels' path past
// the table, and every float64-angle table row.
struct CosSin {
  double c, s;
};
ROTARY_HOST_DEVICE CosSin cos_sin_at(int64_t pos, double f) {
  const double angle = reduced_angle(pos, f);
  CosSin out;
#if defined(__CUDA_ARCH__)
  sincos(angle, &out.s, &out.c);
#else
  out.s = std::sin(angle);
  out.c = std::cos(angle);
#endif
  return out;
}

// cos and sin of pair j at position pos (negated sine for the inverse).
// Inside the table: the stored entry. Outside, with inv_freq and a position
// in [0, 2^60): reduced_angle's sin/cos, scaled like the table. Otherwise
// NaN, so a bad device-side position is visible and nothing is read out of
// bounds.
template <typename acc_t>
ROTARY_HOST_DEVICE void rotation_of(const RopeParams& p, int64_t pos, int64_t j, acc_t& c, acc_t& s) {
  if (pos >= 0 && pos < p.freqs_len) {
    const float* f = p.freqs + 2 * (pos * p.freqs_stride_pos + j * p.freqs_stride_pair);
    c = static_cast<acc_t>(f[0]);
    s = static_cast<acc_t>(f[1]);
  } else if (p.inv_freq != nullptr && pos >= 0 && pos < (int64_t{1} << 60)) {  // rotary::kMaxPosition
    const CosSin cs = cos_sin_at(pos, p.inv_freq[j * p.inv_freq_stride]);
    // Row 0 is the attention scaling times e^{i 0}: |entry| with the real
    // part's sign, so a negated table stays negated past its end.
    const double scale = p.freqs_len > 0
        ? ::copysign(::hypot(static_cast<double>(p.freqs[0]), static_cast<double>(p.freqs[1])),
                     static_cast<double>(p.freqs[0]))
        : 1.0;
    c = static_cast<acc_t>(static_cast<float>(scale * cs.c));
    s = static_cast<acc_t>(static_cast<float>(scale * cs.s));
  } else {
    c = s = static_cast<acc_t>(__builtin_nanf(""));
  }
  if (p.inverse) s = -s;
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
