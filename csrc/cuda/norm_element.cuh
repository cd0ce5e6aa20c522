// The prologue's element path (norm_rope_kernel.cuh): one tensor's heads of
// a token row as a NormUnit, and a thread's two phases over its elements,
// norm_partial (the sum of squares) and norm_finish (normalize, rotate,
// store). Framework-free, host and device.
#pragma once

#include "norm_grid.cuh"
#include "params/fp8.h"
#include "params/norm_params.h"
#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>

namespace rotary {
namespace kernel {

// Heads [0, heads) of one tensor of token (b, s); elements are in_elem apart.
// kFp8Q: the instantiation that can write q as float8_e4m3fn (its own
// kernel, so the plain one carries none of its state).
template <typename T, bool kFp8Q>
struct NormUnit {
  using value_type = T;
  using acc_t = typename Acc<T>::type;
  static constexpr bool kFp8 = kFp8Q;
  const T* in;
  void* out;  // T, or float8_e4m3fn bytes with fp8
  int64_t in_head, out_head, in_elem, out_elem;
  const void* weight;   // weight_of's: null (ones), acc_t or T elements
  int64_t weight_head;  // 0 for norm "head": one weight row for every head
  int32_t heads;
  // q as fp8 (kFp8Q only): head h of the unit is q head h0 + h. Its scale
  // is read from the parameters when a thread reaches the head, so nothing
  // more stays live.
  bool fp8;
  int32_t h0;

  // Weight element d of head h of the unit; the flag and the offset stay in
  // the parameters, not in registers.
  ROTARY_HOST_DEVICE acc_t weight_at(const NormParams& n, int32_t h, int64_t d) const {
    return weight_of<T, acc_t>(weight, n.weight_acc, static_cast<acc_t>(n.weight_offset), h * weight_head + d);
  }
  // The fp8 scale of head h of the unit (fp8 units only).
  ROTARY_HOST_DEVICE float q8_scale(const NormParams& n, int32_t h) const {
    return n.q_scale[(h0 + h) * n.q_scale_stride];
  }

  // v into element `at` of the output: as T, or (fp8) its quantize_fp8 by
  // its head's scale q8.
  ROTARY_HOST_DEVICE void put(int64_t at, acc_t v, const Fp8Scale<acc_t>& q8) const {
    if constexpr (kFp8Q) {
      if (fp8) {
        static_cast<uint8_t*>(out)[at] = quantize_fp8(v, q8);
        return;
      }
    }
    static_cast<T*>(out)[at] = from_acc<T>(v);
  }
};

// Tensor i (0: q, 1: k) of token (b, s), heads [h, h + heads).
template <typename T, bool kFp8Q>
ROTARY_HOST_DEVICE NormUnit<T, kFp8Q> norm_unit(
    const RopeParams& p, const NormParams& n, int i, int64_t b, int64_t s, int64_t h, int32_t heads) {
  const HeadTensor& t = i == 0 ? p.q : p.k;
  const bool across = n.kind == NormKind::kHeads;
  NormUnit<T, kFp8Q> u;
  u.in = static_cast<const T*>(t.in) + b * t.in_stride[0] + s * t.in_stride[2] + h * t.in_stride[1];
  u.fp8 = kFp8Q && i == 0 && n.q_scale != nullptr;
  u.h0 = static_cast<int32_t>(h);
  const int64_t out_elem = u.fp8 ? 1 : static_cast<int64_t>(sizeof(T));
  u.out = static_cast<char*>(t.out) + (b * t.out_stride[0] + s * t.out_stride[2] + h * t.out_stride[1]) * out_elem;
  u.in_head = t.in_stride[1];
  u.out_head = t.out_stride[1];
  u.in_elem = t.in_stride[3];
  u.out_elem = t.out_stride[3];
  // Selects, not runtime indexing: an indexed kernel parameter would be
  // copied to local memory (the SASS contract forbids it).
  // A norm "heads" unit holds every head of its tensor (h is 0): its head
  // h's weights are row h. Norm "head" units share one row.
  u.weight = i == 0 ? n.weight[0] : n.weight[1];
  u.weight_head = across ? p.head_dim : 0;
  u.heads = heads;
  return u;
}

// Phase 1: thread tid of `threads` sums the squares of its elements, in
// element order. Loads go out kNormBatch at a time: a loop that summed each
// element before loading the next would wait a memory round trip per
// element. The loads are unconditional (past the end, of the unit's first
// element) and widened only in the sum, so no branch waits on one; past the
// end the sum adds +0, which leaves its bits alone.
template <typename Unit>
ROTARY_HOST_DEVICE typename Unit::acc_t norm_partial(const Unit& u, int32_t head_dim, int32_t tid, int32_t threads) {
  using T = typename Unit::value_type;
  using acc_t = typename Unit::acc_t;
  acc_t ss = 0;
  HeadWalk w(tid, head_dim);
  while (w.h < u.heads) {
    T raw[kNormBatch];
    bool in[kNormBatch];
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      in[j] = w.h < u.heads;
      raw[j] = u.in[in[j] ? w.h * u.in_head + w.i * u.in_elem : 0];
      if (in[j]) w.next(threads, head_dim);
    }
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const acc_t x = in[j] ? to_acc(raw[j]) : acc_t(0);
      ss += x * x;
    }
  }
  return ss;
}

// Phase 2: thread tid writes its items of every head: pairs [0, R/2)
// rotated, then the pass-through dims normalized. Each element is read and
// written by one thread, after every thread's phase 1 (in place is safe).
template <typename Unit>
ROTARY_HOST_DEVICE void norm_finish(
    const RopeParams& p, const NormParams& n, const Unit& u, typename Unit::acc_t scale, int64_t b, int64_t s,
    int64_t pos, int32_t tid, int32_t threads) {
  using T = typename Unit::value_type;
  using acc_t = typename Unit::acc_t;
  const int32_t pairs = static_cast<int32_t>(p.rotary_dim / 2);
  const int32_t off = static_cast<int32_t>(p.rotary_offset);
  const int32_t width = static_cast<int32_t>(p.head_dim) - pairs;  // items per head
  // fp8 q: the scale of the head in hand, made (its reciprocal, no division
  // per element) when the walk reaches a head; a norm "head" unit has one.
  Fp8Scale<acc_t> q8(1.0f, false);
  int32_t q8_head = -1;
  for (HeadWalk w(tid, width); w.h < u.heads; w.next(threads, width)) {
    if constexpr (Unit::kFp8) {
      if (u.fp8 && w.h != q8_head) {
        q8 = Fp8Scale<acc_t>(u.q8_scale(n, w.h), true);
        q8_head = w.h;
      }
    }
    const T* in = u.in + w.h * u.in_head;
    const int64_t out = w.h * u.out_head;
    if (w.i < pairs) {
      const int64_t j = w.i;
      const int64_t d0 = off + pair_first(j, p.rotary_dim, p.interleaved);
      const int64_t d1 = off + pair_second(j, p.rotary_dim, p.interleaved);
      const acc_t x0 = normalized(to_acc(in[d0 * u.in_elem]), scale, u.weight_at(n, w.h, d0));
      const acc_t x1 = normalized(to_acc(in[d1 * u.in_elem]), scale, u.weight_at(n, w.h, d1));
      acc_t c, sn, y0, y1;
      rotation_of<acc_t>(p, pair_position(p, b, s, pos, j), j, c, sn);
      rotate_pair(x0, x1, c, sn, y0, y1);
      u.put(out + d0 * u.out_elem, y0, q8);
      u.put(out + d1 * u.out_elem, y1, q8);
    } else {
      const int32_t k = w.i - pairs;
      const int64_t d = k < off ? k : k + p.rotary_dim;
      u.put(out + d * u.out_elem, normalized(to_acc(in[d * u.in_elem]), scale, u.weight_at(n, w.h, d)), q8);
    }
  }
}

}  // namespace kernel
}  // namespace rotary
