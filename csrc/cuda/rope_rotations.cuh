// cos/sin reads of the CUDA kernels (the RoPE kernel and the prologue's
// vector path): a table row as float4 reads, or pair by pair. Device and
// host-emulation code; no torch headers.
#pragma once

#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>

namespace rotary {
namespace kernel {

// cos/sin of pairs [j0, j0 + kPairs) (kPairs even, j0 even) of table row
// pos, which the caller checked is in the table: kPairs / 2 aligned float4
// reads (table_rows_vector).
template <typename acc_t, int kPairs>
ROTARY_HOST_DEVICE void load_table_pairs(
    const RopeParams& p, int64_t pos, int64_t j0, acc_t (&c)[kPairs], acc_t (&s)[kPairs]) {
  static_assert(kPairs % 2 == 0, "float4 reads hold two pairs");
  const float4* f = reinterpret_cast<const float4*>(p.freqs + 2 * (pos * p.freqs_stride_pos + j0));
#pragma unroll
  for (int j = 0; j < kPairs / 2; ++j) {
    const float4 e = load_table(f + j);
    c[2 * j] = static_cast<acc_t>(e.x);
    s[2 * j] = static_cast<acc_t>(p.inverse ? -e.y : e.y);
    c[2 * j + 1] = static_cast<acc_t>(e.z);
    s[2 * j + 1] = static_cast<acc_t>(p.inverse ? -e.w : e.w);
  }
}

// cos/sin of pairs [j0, j0 + kPairs) of token (b, s) at position pos: one
// aligned row read of the table when table_vector (table_rows_vector) and
// the row is in it, else rotation_of pair by pair. N-D positions (pair j at
// its axis's position): one position read per run of pairs on one axis, so
// a group on one axis reads it once per row.
template <typename acc_t, int kPairs>
ROTARY_HOST_DEVICE void load_rotations(
    const RopeParams& p, bool table_vector, int64_t b, int64_t s_idx, int64_t pos, int64_t j0, acc_t (&c)[kPairs],
    acc_t (&s)[kPairs]) {
  if constexpr (kPairs % 2 == 0) {
    if (table_vector && p.num_axes == 0 && pos >= 0 && pos < p.freqs_len) return load_table_pairs(p, pos, j0, c, s);
  }
  int axis = -1;  // of the run of pairs pos is read for (1-D: none)
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    if (p.num_axes > 0 && p.pair_axis[j0 + j] != axis) {
      axis = p.pair_axis[j0 + j];
      pos = pair_position(p, b, s_idx, pos, j0 + j);
    }
    rotation_of<acc_t>(p, pos, j0 + j, c[j], s[j]);
  }
}

}  // namespace kernel
}  // namespace rotary
