// The rotation coefficients of one token as the CPU kernels read them
// (layouts: kernel/rope_kernel.h), shared by the RoPE and prologue drivers.
#pragma once

#include "params/rope_params.h"

#include <algorithm>
#include <cstdint>

namespace rotary {
namespace cpu {

// Values in a token's row (layouts: kernel/rope_kernel.h): rotary_dim as
// pairs, twice that per element.
inline int64_t row_values(const kernel::RopeParams& p, bool per_element) {
  return (per_element ? 2 : 1) * p.rotary_dim;
}

// Tokens per tile: a head is streamed in runs of that many tokens (the L2
// prefetcher restarts at every 4 KiB page, so longer is better), and their
// rows stay within 64 KiB of L2 (per element; pairs take half).
template <typename acc_t>
inline int64_t tile_tokens(const kernel::RopeParams& p) {
  constexpr int64_t kCoefBytes = 64 * 1024;
  const int64_t per_token = row_values(p, /*per_element=*/true) * int64_t(sizeof(acc_t));
  return std::min<int64_t>(p.seq, std::max<int64_t>(1, kCoefBytes / per_token));
}

// Tasks per parallel chunk: at least 2^15 elements.
inline int64_t grain_tasks(int64_t task_elems) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(task_elems, 1));
}

// Row of token (b, s), of pairs or per element (kernel/rope_kernel.h). In-table rows
// with contiguous pairs and one position per token are read straight;
// anything else (N-D positions, positions past the table, strided tables)
// goes through rotation_of pair by pair.
template <typename acc_t>
inline void fill_coefficients(const kernel::RopeParams& p, int64_t b, int64_t s_idx, bool per_element, acc_t* coef) {
  const int64_t pos = kernel::position_of(p, b, s_idx);
  const int64_t dim = p.rotary_dim;
  const int64_t pairs = dim / 2;
  acc_t* c = coef;
  acc_t* s = coef + (per_element ? dim : pairs);
  // Per element: (c, c) and (-s, s) per pair, so one multiply-add with the
  // pair-swapped input rotates both members.
  const auto put = [&](int64_t j, acc_t cj, acc_t sj) {
    if (per_element) {
      c[2 * j] = c[2 * j + 1] = cj;
      s[2 * j] = -sj;
      s[2 * j + 1] = sj;
    } else {
      c[j] = cj;
      s[j] = sj;
    }
  };
  const acc_t sign = p.inverse ? acc_t(-1) : acc_t(1);  // exact
  if (p.num_axes == 0 && pos >= 0 && pos < p.freqs_len && p.freqs_stride_pair == 1) {
    const float* row = p.freqs + 2 * pos * p.freqs_stride_pos;
    for (int64_t j = 0; j < pairs; ++j) {
      put(j, static_cast<acc_t>(row[2 * j]), sign * static_cast<acc_t>(row[2 * j + 1]));
    }
    return;
  }
  if (p.num_axes > 0 && p.freqs_stride_pair == 1) {
    // N-D: one table row per axis, read once; pair j takes its axis's row.
    const float* rows[kernel::kMaxAxes];
    bool in_table = true;
    for (int64_t a = 0; a < p.num_axes; ++a) {
      const int64_t pa = p.start_pos + kernel::given_position(p, b, s_idx, a);
      const bool in = pa >= 0 && pa < p.freqs_len;
      in_table = in_table && in;
      rows[a] = p.freqs + (in ? 2 * pa * p.freqs_stride_pos : 0);
    }
    if (in_table) {
      for (int64_t j = 0; j < pairs; ++j) {
        const float* e = rows[p.pair_axis[j]] + 2 * j;
        put(j, static_cast<acc_t>(e[0]), sign * static_cast<acc_t>(e[1]));
      }
      return;
    }
  }
  for (int64_t j = 0; j < pairs; ++j) {
    acc_t cj, sj;
    kernel::rotation_of<acc_t>(p, kernel::pair_position(p, b, s_idx, pos, j), j, cj, sj);
    put(j, cj, sj);
  }
}

}  // namespace cpu
}  // namespace rotary
