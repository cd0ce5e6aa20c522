// The prologue kernel's vector path (NormGrid.items > 0): norm "head" or
// "heads" with every q/k access an aligned 16-byte vector. A head is split
// into items (norm_grid.cuh); a lane loads its item of kNormLaneHeads heads
// once, with the cos/sin of its pairs, in phase 1, and keeps them in
// registers for phase 2: one memory round trip per head and 16-byte stores,
// where the element path makes one 2- or 4-byte access per element and
// reads each element twice. Between them, each head's segment of lanes
// sums its squares (warp_sum). No torch headers.
#pragma once

#include "norm_grid.cuh"
#include "params/fp8.h"
#include "params/norm_params.h"
#include "params/rope_params.h"
#include "rope_rotations.cuh"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// True when the vector path serves row (b, s) at position pos: its cos/sin
// are table reads (with N-D positions, every axis's row is in the table). A
// row past the table (inv_freq) takes the element path, so the vector path
// holds no sin/cos call.
ROTARY_HOST_DEVICE bool vector_row_at(const RopeParams& p, const NormGrid& g, int64_t b, int64_t s, int64_t pos) {
  if (g.items == 0) return false;
  for (int64_t a = 0; a < p.num_axes; ++a) {
    const int64_t at = p.start_pos + given_position(p, b, s, a);
    if (at < 0 || at >= p.freqs_len) return false;
  }
  return pos >= 0 && pos < p.freqs_len;
}

// cos/sin of the kPairs pairs from j0 of row (b, s) at position pos, in the
// table (vector_row_at): float4 reads of row pos, or, with N-D positions
// (kAxes), each pair's (cos, sin) from its axis's row.
template <bool kAxes, typename acc_t, int kPairs>
ROTARY_HOST_DEVICE void load_item_rotations(
    const RopeParams& p, int64_t b, int64_t s, int64_t pos, int32_t j0, acc_t (&c)[kPairs], acc_t (&sn)[kPairs]) {
  if constexpr (!kAxes) {
    load_table_pairs<acc_t, kPairs>(p, pos, j0, c, sn);
  } else {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int64_t row = p.start_pos + given_position(p, b, s, p.pair_axis[j0 + j]);
      const float2 e =
          load_table_pair(reinterpret_cast<const float2*>(p.freqs + 2 * (row * p.freqs_stride_pos + j0 + j)));
      c[j] = static_cast<acc_t>(e.x);
      sn[j] = static_cast<acc_t>(p.inverse ? -e.y : e.y);
    }
  }
}

// One lane's item of kNormLaneHeads heads: each head's vectors at element
// offsets a0 and a1 (a rotated item: kPairs pairs, as two adjacent vectors
// when interleaved, one from each half of the span for rotate_half; a
// pass-through item: x[h][0] only), and the cos/sin of its pairs, which
// every head of the row shares.
template <typename T, bool kInterleaved>
struct NormItem {
  using acc_t = typename Acc<T>::type;
  static constexpr int kElems = kVectorBytes / static_cast<int>(sizeof(T));
  static constexpr int kPairs = kElems;  // of a rotated item
  static constexpr int kVectors = 2;     // of a rotated item, per head
  Vector x[kNormLaneHeads][kVectors];
  acc_t c[kPairs], s[kPairs];
  int32_t a0, a1;
  bool rotated;
};

// The squares of a vector's elements added to ss, in element order.
template <typename T>
ROTARY_HOST_DEVICE void add_squares(const Vector& x, typename Acc<T>::type& ss) {
  using acc_t = typename Acc<T>::type;
#pragma unroll
  for (int k = 0; k < kVectorBytes / static_cast<int>(sizeof(T)) / 2; ++k) {
    acc_t e0, e1;
    Pairs<T>::get(x, k, e0, e1);
    ss += e0 * e0;
    ss += e1 * e1;
  }
}

// Phase 1: item `item` of the heads u[h] with on[h] (a token at position
// pos, which vector_row_at checked; on[0] holds) is loaded into it: every
// head's data first, then the cos/sin, so all round trips overlap (kAxes:
// N-D positions, chosen by the caller, so no branch between the two). The
// loads are unconditional, so no branch sits between them: a head that is
// off loads head 0's item, a pass-through item loads its vector twice and
// reads the table's first pairs. ss[h] is head h's sum of squares (0 when
// off).
template <bool kInterleaved, bool kAxes, typename Unit, typename T = typename Unit::value_type>
ROTARY_HOST_DEVICE void norm_item_load(
    const RopeParams& p, const NormGrid& g, const Unit (&u)[kNormLaneHeads], const bool (&on)[kNormLaneHeads],
    int64_t b, int64_t s, int64_t pos, int32_t item, NormItem<T, kInterleaved>& it,
    typename Acc<T>::type (&ss)[kNormLaneHeads]) {
  using Item = NormItem<T, kInterleaved>;
  using acc_t = typename Acc<T>::type;
  const int32_t off = static_cast<int32_t>(p.rotary_offset), R = static_cast<int32_t>(p.rotary_dim);
  it.rotated = item < g.rotated;
  const int32_t j0 = it.rotated ? item * Item::kPairs : 0;
  if (it.rotated) {
    it.a0 = off + (kInterleaved ? 2 * j0 : j0);
    it.a1 = kInterleaved ? it.a0 + Item::kElems : off + j0 + R / 2;
  } else {
    const int32_t from = (item - g.rotated) * Item::kElems;  // pass-through dims [0, off), then past the span
    it.a0 = it.a1 = from < off ? from : from + R;
  }
#pragma unroll
  for (int h = 0; h < kNormLaneHeads; ++h) {
    const T* in = on[h] ? u[h].in : u[0].in;
    it.x[h][0] = load_stream(reinterpret_cast<const Vector*>(in + it.a0));
    it.x[h][1] = load_stream(reinterpret_cast<const Vector*>(in + it.a1));
  }
  load_item_rotations<kAxes, acc_t, Item::kPairs>(p, b, s, pos, j0, it.c, it.s);
#pragma unroll
  for (int h = 0; h < kNormLaneHeads; ++h) {
    acc_t sum = 0;
    add_squares<T>(it.x[h][0], sum);
    if (it.rotated) add_squares<T>(it.x[h][1], sum);
    ss[h] = on[h] ? sum : acc_t(0);
  }
}

// Where phase 2 puts a head's finished item: as T, 16-byte vectors
// (VectorOut), or as fp8 q, each element's quantize_fp8 from its acc_t value
// (not rounded to T first, as the element path and the CPU kernel do), a
// vector's bytes in one 8- or 4-byte store (Fp8Out). put(v, k, a, b) sets
// elements 2k and 2k + 1 of output vector v; store(v, at) writes it at
// element `at` of the head.
template <typename T>
struct VectorOut {
  using acc_t = typename Acc<T>::type;
  T* out;
  Vector y[2];
  ROTARY_HOST_DEVICE void put(int v, int k, acc_t a, acc_t b) { Pairs<T>::put(y[v], k, a, b); }
  ROTARY_HOST_DEVICE void store(int v, int32_t at) { store_stream(reinterpret_cast<Vector*>(out + at), y[v]); }
};
template <typename T>
struct Fp8Out {
  using acc_t = typename Acc<T>::type;
  using W = typename CacheChunk<T, uint8_t>::type;  // a vector's bytes: 8 (16-bit T) or 4 (float)
  uint8_t* out;
  Fp8Scale<acc_t> scale;
  W y[2] = {0, 0};
  ROTARY_HOST_DEVICE void put(int v, int k, acc_t a, acc_t b) { y[v] |= fp8_pair<W>(k, a, b, scale); }
  ROTARY_HOST_DEVICE void store(int v, int32_t at) { store_stream(reinterpret_cast<W*>(out + at), y[v]); }
};

// Phase 2 with the weights read as W (float, or T: one type per launch, so
// each element holds one weight register, not one of each type).
template <typename W, typename T, bool kInterleaved, typename Out>
ROTARY_HOST_DEVICE void norm_item_write(
    const NormItem<T, kInterleaved>& it, int h, typename Acc<T>::type scale, const W* w, typename Acc<T>::type w_offset,
    Out& out) {
  using Item = NormItem<T, kInterleaved>;
  using acc_t = typename Acc<T>::type;
  const auto weight = [&](int32_t d) { return weight_element(w, w_offset, d); };
  constexpr int kWords = Item::kElems / 2;  // element pairs per vector
  if (!it.rotated) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      acc_t e0, e1;
      Pairs<T>::get(it.x[h][0], k, e0, e1);
      const acc_t y0 = normalized(e0, scale, weight(it.a0 + 2 * k));
      out.put(0, k, y0, normalized(e1, scale, weight(it.a0 + 2 * k + 1)));
    }
    out.store(0, it.a0);
    return;
  }
  if constexpr (kInterleaved) {  // pair v * kWords + j is elements (2j, 2j + 1) of vector v
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int32_t at = v ? it.a1 : it.a0;
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        acc_t e0, e1, y0, y1;
        Pairs<T>::get(it.x[h][v], j, e0, e1);
        rotate_pair<acc_t>(normalized(e0, scale, weight(at + 2 * j)), normalized(e1, scale, weight(at + 2 * j + 1)),
                           it.c[v * kWords + j], it.s[v * kWords + j], y0, y1);
        out.put(v, j, y0, y1);
      }
    }
  } else {  // pair j is element j of the low and of the high vector
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      acc_t lo[2], hi[2], ylo[2], yhi[2];
      Pairs<T>::get(it.x[h][0], k, lo[0], lo[1]);
      Pairs<T>::get(it.x[h][1], k, hi[0], hi[1]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 2 * k + e;
        rotate_pair<acc_t>(normalized(lo[e], scale, weight(it.a0 + j)), normalized(hi[e], scale, weight(it.a1 + j)),
                           it.c[j], it.s[j], ylo[e], yhi[e]);
      }
      out.put(0, k, ylo[0], ylo[1]);
      out.put(1, k, yhi[0], yhi[1]);
    }
  }
  out.store(0, it.a0);
  out.store(1, it.a1);
}

// Phase 2 into one output, the weights read as weight_of reads them: the
// unit's head's row (norm "heads": row h0 of the tensor's weights; norm
// "head": the one row).
template <bool kInterleaved, typename Unit, typename Out, typename T = typename Unit::value_type>
ROTARY_HOST_DEVICE void norm_item_put(
    const NormParams& n, const Unit& u, const NormItem<T, kInterleaved>& it, int h, typename Acc<T>::type scale,
    Out& out) {
  using acc_t = typename Acc<T>::type;
  const acc_t offset = static_cast<acc_t>(n.weight_offset);
  const int64_t row = u.h0 * u.weight_head;
  if (std::is_same_v<T, acc_t> || u.weight == nullptr || n.weight_acc) {
    const acc_t* w = static_cast<const acc_t*>(u.weight);
    norm_item_write(it, h, scale, w != nullptr ? w + row : w, offset, out);
  } else {
    norm_item_write(it, h, scale, static_cast<const T*>(u.weight) + row, offset, out);
  }
}

// Phase 2: head h's item normalized by scale and the weights of its dims,
// its pairs rotated, stored into u (that head): as 16-byte vectors, or, for
// an fp8 q unit, as fp8 bytes by the head's scale `q8` (read with the
// phase-1 loads).
template <bool kInterleaved, typename Unit, typename T = typename Unit::value_type>
ROTARY_HOST_DEVICE void norm_item_store(
    const NormParams& n, const Unit& u, const NormItem<T, kInterleaved>& it, int h, typename Acc<T>::type scale,
    float q8) {
  if constexpr (Unit::kFp8) {
    if (u.fp8) {
      Fp8Out<T> out{static_cast<uint8_t*>(u.out), Fp8Scale<typename Acc<T>::type>(q8, true)};
      return norm_item_put(n, u, it, h, scale, out);
    }
  }
  VectorOut<T> out{static_cast<T*>(u.out)};
  norm_item_put(n, u, it, h, scale, out);
}

}  // namespace kernel
}  // namespace rotary
