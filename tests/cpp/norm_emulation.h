// The prologue's CUDA kernel (cuda/norm_rope_kernel.cuh) run on the CPU:
// its loop nest, thread by thread, through the kernel's own phase functions
// (the element path's and the vector path's) and reduction order, so the
// result has the kernel's bits. Used by the emulation tests of
// apply_qk_norm_rope and of its KV-cache form.
#pragma once

#include "cuda/norm_rope_kernel.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary_test {

// The vector path's heads of one row for warp `warp`, as norm_vector_row
// runs them: each lane's item of its heads loaded, the segments' sums in the
// kernel's order, then each lane's stores.
template <typename T, bool kInterleaved>
void emulate_vector_row(
    const rotary::kernel::RopeParams& p, const rotary::kernel::NormParams& n, const rotary::kernel::NormGrid& g,
    int64_t b, int64_t s, int64_t pos, int32_t warp) {
  namespace k = rotary::kernel;
  using acc_t = typename k::Acc<T>::type;
  constexpr int H = k::kNormLaneHeads;
  const int32_t q_heads = static_cast<int32_t>(p.q.heads), total = q_heads + static_cast<int32_t>(p.k.heads);
  const int32_t width = 1 << g.lanes_log2, per_warp = 32 >> g.lanes_log2;
  for (int32_t h0 = warp * per_warp * H; h0 < total; h0 += k::kNormWarps * per_warp * H) {
    k::NormItem<T, kInterleaved> it[32];
    acc_t ss[H][32];
    bool on[32][H];
    k::NormUnit<T, false> u[32][H];
    for (int32_t l = 0; l < 32; ++l) {
      const int32_t item = l & (width - 1);
      for (int j = 0; j < H; ++j) {
        const int32_t h = h0 + j * per_warp + (l >> g.lanes_log2);
        on[l][j] = h < total && item < g.items;
        const int i = h < q_heads ? 0 : 1;
        if (on[l][j]) u[l][j] = k::norm_unit<T, false>(p, n, i, b, s, i ? h - q_heads : h, 1);
      }
      acc_t lane_ss[H] = {};
      if (on[l][0]) k::norm_item_load<kInterleaved>(p, g, u[l], on[l], pos, item, it[l], lane_ss);
      for (int j = 0; j < H; ++j) ss[j][l] = lane_ss[j];
    }
    for (int j = 0; j < H; ++j) k::warp_reduce_order(ss[j], width);
    for (int32_t l = 0; l < 32; ++l) {
      for (int j = 0; j < H; ++j) {
        if (on[l][j]) k::norm_item_store<kInterleaved>(n, u[l][j], it[l], j, k::rms_scale(ss[j][l], p.head_dim, n.eps));
      }
    }
  }
}

// `blocks` blocks stride over the rows; each reduction sees every thread's
// phase 1 before any phase 2, and with a Cache (not void) every thread's
// phase 2 before any cache write, as the kernel's barriers order them.
template <typename T, bool kFp8Q, typename Cache = void>
void emulate_norm_rope(const rotary::kernel::KVCacheParams& kv, const rotary::kernel::NormParams& n, int64_t blocks) {
  namespace k = rotary::kernel;
  using acc_t = typename k::Acc<T>::type;
  const k::RopeParams& p = kv.rope;
  const int32_t D = static_cast<int32_t>(p.head_dim);
  const int32_t heads[2] = {static_cast<int32_t>(p.q.heads), static_cast<int32_t>(p.k.heads)};
  const k::NormGrid g = k::norm_grid_for<T, Cache>(kv, n, blocks);
  for (int64_t block = 0; block < blocks; ++block) {
    for (k::NormRows r(p, block); r.more(p); r.next(p, g)) {
      const int64_t b = r.b, s = r.s, pos = r.place.pos;
      const bool vector = !kFp8Q && k::vector_row_at(p, g, pos);  // the row's path, as the kernel decides it
      if (vector) {
        for (int32_t warp = 0; warp < k::kNormWarps; ++warp) {
          if (p.interleaved) {
            emulate_vector_row<T, true>(p, n, g, b, s, pos, warp);
          } else {
            emulate_vector_row<T, false>(p, n, g, b, s, pos, warp);
          }
        }
      } else if (n.kind == k::NormKind::kHead) {
        for (int32_t warp = 0; warp < k::kNormWarps; ++warp) {
          for (int32_t h = warp; h < heads[0] + heads[1]; h += k::kNormWarps) {
            const int i = h < heads[0] ? 0 : 1;
            const auto u = k::norm_unit<T, kFp8Q>(p, n, i, b, s, i ? h - heads[0] : h, 1);
            acc_t lane[32];
            for (int l = 0; l < 32; ++l) lane[l] = k::norm_partial(u, D, l, 32);
            const acc_t scale = k::rms_scale(k::warp_reduce_order(lane), D, n.eps);
            for (int l = 0; l < 32; ++l) k::norm_finish(p, n, u, scale, b, s, pos, l, 32);
          }
        }
      } else {
        for (int i = 0; i < 2; ++i) {
          const auto u = k::norm_unit<T, kFp8Q>(p, n, i, b, s, 0, heads[i]);
          acc_t warp_total[k::kNormWarps];
          for (int w = 0; w < k::kNormWarps; ++w) {
            acc_t lane[32];
            for (int l = 0; l < 32; ++l) lane[l] = k::norm_partial(u, D, w * 32 + l, k::kNormThreads);
            warp_total[w] = k::warp_reduce_order(lane);
          }
          const acc_t scale =
              k::rms_scale(k::block_reduce_order(warp_total), static_cast<int64_t>(heads[i]) * D, n.eps);
          for (int t = 0; t < k::kNormThreads; ++t) k::norm_finish(p, n, u, scale, b, s, pos, t, k::kNormThreads);
        }
      }
      if constexpr (!std::is_void_v<Cache>) {
        const k::CacheDest dest = k::cache_dest(kv, b, s, r.place);  // thread 0's, shared
        for (int t = 0; t < k::kNormThreads; ++t) {
          if (vector && g.cache_vector) {
            k::norm_cache_vectors<T, Cache>(kv, dest, t, k::kNormThreads);
          } else {
            k::norm_cache_row<T, Cache>(kv, dest, t, k::kNormThreads);
          }
        }
      }
    }
  }
}

}  // namespace rotary_test
