// The launch description of the prologue's CUDA kernel
// (norm_rope_kernel.cuh): block shape, batch, grid and its stride in (b, s).
// Host code only, no device code and no torch headers: the launch, the host
// emulation and rotary._C's launch model all include it.
#pragma once

#include "params/rope_params.h"

#include <cstdint>

namespace rotary {
namespace kernel {

constexpr int kNormWarps = 4;
constexpr int kNormThreads = 32 * kNormWarps;
// Loads a thread issues before it uses any of them (the sum of squares, the
// cache write).
constexpr int kNormBatch = 8;

// The launch: one block per row, at most kNormBlocksPerSm per SM, which
// then grid-stride over the rows (16 resident per SM cover the latency).
constexpr int64_t kNormBlocksPerSm = 16;
inline int64_t norm_blocks(int64_t rows, int64_t sms) {
  return rows < kNormBlocksPerSm * sms ? rows : kNormBlocksPerSm * sms;
}

// The launch's grid stride over token rows (its block count) as a step in
// (b, s), found once on the host (norm_grid) so that the kernel reads it
// from its parameters and divides nothing per row.
struct NormGrid {
  int64_t step_b, step_s;
};
inline NormGrid norm_grid(const RopeParams& p, int64_t blocks) {
  NormGrid g;
  g.step_b = p.seq > 0 ? blocks / p.seq : 0;
  g.step_s = blocks - g.step_b * p.seq;
  return g;
}

}  // namespace kernel
}  // namespace rotary
