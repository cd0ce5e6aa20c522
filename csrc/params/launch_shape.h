// The CUDA launch a RoPE call would make, for the launch model
// (benchmarks/launch_model.py). No CUDA headers: rotary._C includes it in
// every build.
#pragma once

#include "kv_params.h"
#include "launch_switches.h"
#include "norm_params.h"
#include "rope_params.h"

#include <ATen/core/ATen_fwd.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>

namespace rotary {
namespace detail {

// Fields of kernel::LaunchShape by name (vectorized, int32, load_bytes, the
// Grid's, and l2_prefetch: whether a grid-stride launch prefetches); with
// `resident` blocks resident on the device, also "blocks", the launch's grid
// (even_grid). Empty when librotary was built without CUDA.
std::map<std::string, int64_t> cuda_launch_shape(const kernel::RopeParams& p, at::ScalarType dtype,
                                                 int64_t resident = 0);

// The same for apply_rope_with_kv_cache_, plus "fused" (one launch also
// writes the caches: can_fuse_cache), "launches", and for a fused launch its
// copy split (copy_grid: copy_lanes, copy_rows_per_block, copy_row_blocks),
// the dependent memory round trips of a row's busiest thread (rope_trips,
// row_copy_trips: the rope rows' copy after them, copy_block_trips: a copy
// block's, beside them) and with `resident`, "copy_blocks"
// (use_copy_blocks: 0 when the rope rows copy).
std::map<std::string, int64_t> cuda_kv_launch(const kernel::KVCacheParams& p, at::ScalarType dtype,
                                              int64_t resident = 0);

// The prologue's launch (apply_qk_norm_rope) on a GPU of `sms` SMs: rows,
// blocks, block_threads, batch (loads per thread before the sum of squares
// sums them) and the vector path's split of a head (norm_grid): vector_items
// (0: the element path), vector_rotated, vector_lanes and vector_lane_heads.
std::map<std::string, int64_t> cuda_norm_launch(
    const kernel::RopeParams& p, const kernel::NormParams& n, at::ScalarType dtype, int64_t sms);

}  // namespace detail
}  // namespace rotary
