#include "launch_shape.h"

#ifdef ROTARY_WITH_CUDA
#include "cuda/cuda_types.h"
#include "cuda/norm_grid.cuh"
#include "cuda/rope_grid.cuh"
#include "cuda/rope_kv_grid.cuh"

#include <ATen/Dispatch.h>
#endif

#include <atomic>

namespace rotary {
namespace kernel {

namespace {
std::atomic<bool>& prefetch_setting() {
  static std::atomic<bool> on{true};
  return on;
}
std::atomic<bool>& copy_blocks_setting() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace

bool l2_prefetch() { return prefetch_setting().load(std::memory_order_relaxed); }
bool set_l2_prefetch(bool on) { return prefetch_setting().exchange(on); }
bool copy_blocks() { return copy_blocks_setting().load(std::memory_order_relaxed); }
bool set_copy_blocks(bool on) { return copy_blocks_setting().exchange(on); }

}  // namespace kernel

namespace detail {

std::map<std::string, int64_t> cuda_launch_shape(const kernel::RopeParams& p, at::ScalarType dtype, int64_t resident) {
  std::map<std::string, int64_t> out;
#ifdef ROTARY_WITH_CUDA
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_launch_shape", [&] {
    const auto s = kernel::launch_shape<typename cuda::CudaType<scalar_t>::type>(p);
    const auto& g = s.grid;
    out = {{"vectorized", s.vectorized}, {"int32", s.int32}, {"load_bytes", s.load_bytes},
           {"rotary_groups", g.rotary_groups}, {"groups", g.groups}, {"group_threads", g.group_threads},
           {"chunks", g.chunks}, {"lanes", g.lanes}, {"rows_per_block", g.rows_per_block},
           {"block_threads", g.block_threads}, {"heads", g.heads}, {"rows", g.rows}, {"row_blocks", g.row_blocks},
           {"l2_prefetch", s.prefetch}};
    if (resident > 0) out["blocks"] = kernel::even_grid(g.row_blocks, resident);
  });
#else
  (void)p;
  (void)dtype;
  (void)resident;
#endif
  return out;
}

namespace {
#ifdef ROTARY_WITH_CUDA
int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }

// Dependent memory round trips of a row's busiest thread: `items` split over
// `threads`, `heads` over `chunks`, kHeads heads' loads per trip.
int64_t row_trips(int64_t items, int64_t threads, int64_t heads, int64_t chunks, int64_t k_heads) {
  return ceil_div(items, threads) * ceil_div(ceil_div(heads, chunks), k_heads);
}

template <typename T, typename Cache, bool kInterleaved>
void add_copy_grid(const kernel::KVCacheParams& p, const kernel::LaunchShape& s, int64_t resident,
                   std::map<std::string, int64_t>& out) {
  const bool fused = kernel::can_fuse_cache<T, Cache>(p, s);
  out["fused"] = fused;
  out["launches"] = fused ? 1 : 2;
  if (!fused) return;
  constexpr int64_t kHeads = kernel::Tile<T, kInterleaved, true>::kHeads;
  const kernel::Grid& g = s.grid;
  const kernel::CopyGrid c = kernel::copy_grid<T, Cache>(p, g);
  out["copy_lanes"] = c.lanes;
  out["copy_rows_per_block"] = c.rows_per_block;
  out["copy_row_blocks"] = c.row_blocks;
  out["rope_trips"] = row_trips(g.groups, g.group_threads, g.heads, g.chunks, kHeads);
  out["row_copy_trips"] = row_trips(c.row_chunks, g.group_threads, p.rope.k.heads, g.chunks, kHeads);
  out["copy_block_trips"] = row_trips(c.row_chunks, c.group_threads, p.rope.k.heads, c.chunks, kHeads);
  if (resident > 0) {
    const kernel::Grid launched = kernel::launched(p.rope, g, kernel::even_grid(g.row_blocks, resident));
    out["copy_blocks"] = kernel::use_copy_blocks(s, launched, c, resident).blocks;
  }
}

template <typename T, typename Cache>
void add_copy_grid(const kernel::KVCacheParams& p, const kernel::LaunchShape& s, int64_t resident,
                   std::map<std::string, int64_t>& out) {
  p.rope.interleaved ? add_copy_grid<T, Cache, true>(p, s, resident, out)
                     : add_copy_grid<T, Cache, false>(p, s, resident, out);
}
#endif
}  // namespace

std::map<std::string, int64_t> cuda_kv_launch(const kernel::KVCacheParams& p, at::ScalarType dtype, int64_t resident) {
  std::map<std::string, int64_t> out = cuda_launch_shape(p.rope, dtype, resident);
#ifdef ROTARY_WITH_CUDA
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_kv_launch", [&] {
    using T = typename cuda::CudaType<scalar_t>::type;
    const auto s = kernel::launch_shape<T>(p.rope);
    if (p.fp8) {
      add_copy_grid<T, uint8_t>(p, s, resident, out);
    } else {
      add_copy_grid<T, T>(p, s, resident, out);
    }
  });
#else
  (void)resident;
#endif
  return out;
}

std::map<std::string, int64_t> cuda_norm_launch(
    const kernel::RopeParams& p, const kernel::NormParams& n, at::ScalarType dtype, int64_t sms) {
  std::map<std::string, int64_t> out;
#ifdef ROTARY_WITH_CUDA
  const int64_t rows = p.batch * p.seq;
  const int64_t blocks = kernel::norm_blocks(rows, sms);
  const kernel::NormGrid g = kernel::norm_grid(p, blocks, c10::elementSize(dtype));
  out = {{"rows", rows}, {"blocks", blocks}, {"block_threads", kernel::kNormThreads}, {"batch", kernel::kNormBatch},
         {"vector_items", g.items}, {"vector_rotated", g.rotated},
         {"vector_lanes", g.items > 0 ? int64_t{1} << g.lanes_log2 : 0}, {"vector_lane_heads", kernel::kNormLaneHeads},
         {"l2_prefetch", g.prefetch_log2 >= 0 && blocks < rows}, {"fp8_q", n.q_scale != nullptr}};
#else
  (void)p;
  (void)n;
  (void)dtype;
  (void)sms;
#endif
  return out;
}

}  // namespace detail
}  // namespace rotary
