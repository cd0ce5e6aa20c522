// Framework-free CUDA kernel of the prologue op: q/k RMSNorm, then RoPE, one
// launch. No torch headers: the host-emulation test compiles it with g++.
//
// Work split: a block of kNormThreads threads (kNormWarps warps) owns a token
// row at a time and grid-strides over rows. Norm "head": each warp takes a
// head vector at a time (heads warp, warp + kNormWarps, ...), its 32 lanes
// sum squares over strided elements and reduce by a butterfly. Norm
// "heads": the whole block takes q's heads, then k's, reducing the warps'
// sums through shared memory in a fixed order. Then every thread writes its
// pairs (rotated) and its pass-through dims (normalized). Per thread, the
// two phases are norm_partial and norm_finish. The whole body is
// norm_rope_thread, which the host emulation runs for every thread, its
// barriers and shuffles through a Sync of its own, so the emulation gives
// the kernel's bits. The walks over rows (NormRows) and over (head, dim)
// (HeadWalk) step without a division per item; the element path's unit and
// phases are in norm_element.cuh. Aligned, unit-stride rows take the
// vector path instead (norm_vector.cuh): a segment of lanes per head, one
// item of two 16-byte vectors per lane and head, loaded once (norm "heads":
// once more after the block's sums). apply_qk_norm_rope_with_kv_cache_
// runs the same launch with a cache type: once a row's k is finished, the
// block writes it and v into the caches (norm_cache.cuh), at the cache row
// one thread found for the block (CacheDest).
#pragma once

#include "norm_cache.cuh"
#include "norm_element.cuh"
#include "norm_grid.cuh"
#include "norm_vector.cuh"
#include "params/kv_params.h"
#include "params/norm_params.h"
#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// The token rows block `block` owns: block, block + blocks, ... as (b, s).
// The first costs one division, later ones step by g without any; b past
// the batch ends the walk (only b and s stay live across rows). `place` is
// the row's position and sequence, shared by the rotation and the cache
// write.
struct NormRows {
  int64_t b, s;
  TokenPlace place;
  ROTARY_HOST_DEVICE NormRows(const RopeParams& p, int64_t block) : b(p.batch), s(0) {
    if (block >= p.batch * p.seq) return;  // rows > 0: seq > 0
    b = block / p.seq;
    s = block - b * p.seq;
    place = place_of(p, b, s);
  }
  ROTARY_HOST_DEVICE bool more(const RopeParams& p) const { return b < p.batch; }
  ROTARY_HOST_DEVICE void next(const RopeParams& p, const NormGrid& g) {
    step(p, g, b, s);
    if (b < p.batch) place = place_of(p, b, s);
  }
  // (b, s) one grid stride on (the block's next row), without a division.
  ROTARY_HOST_DEVICE static void step(const RopeParams& p, const NormGrid& g, int64_t& b, int64_t& s) {
    b += g.step_b;
    s += g.step_s;
    if (s >= p.seq) {
      s -= p.seq;
      ++b;
    }
  }
};

// Which instantiations prefetch: the vector ones, but for float32 data with
// an fp8 cache (at 128 registers the prefetch's state spilled there).
template <typename T, typename Cache, bool kVector>
constexpr bool kNormPrefetch = kVector && !(std::is_same_v<T, float> && std::is_same_v<Cache, uint8_t>);

// The vector path asks L2 for the block's next row while it works on this
// one (row (b, s); NormGrid.prefetch_log2): thread tid takes line slots
// tid, tid + kNormThreads, ... of the row's heads, q's then k's, a slot per
// 128 bytes of a head (the rest of a head's 2^prefetch_log2 idle). Every
// field is chosen by a select: indexing the parameters would copy them to
// local memory.
template <typename T, typename Sync>
ROTARY_HOST_DEVICE void prefetch_next_row(const RopeParams& p, const NormGrid& g, int64_t b, int64_t s, int32_t tid,
                                          Sync& sync) {
  if (g.prefetch_log2 < 0) return;
  NormRows::step(p, g, b, s);
  if (b >= p.batch) return;
  const int32_t q_heads = static_cast<int32_t>(p.q.heads);
  const int32_t slots = static_cast<int32_t>(p.q.heads + p.k.heads) << g.prefetch_log2;
  const int64_t head_bytes = p.head_dim * static_cast<int64_t>(sizeof(T));
  for (int32_t t = tid; t < slots; t += kNormThreads) {
    const int32_t h = t >> g.prefetch_log2;
    const int64_t at = static_cast<int64_t>(t - (h << g.prefetch_log2)) * kLineBytes;
    if (at >= head_bytes) continue;
    const bool q = h < q_heads;
    const T* in = static_cast<const T*>(q ? p.q.in : p.k.in);
    const int64_t off = b * (q ? p.q.in_stride[0] : p.k.in_stride[0]) + s * (q ? p.q.in_stride[2] : p.k.in_stride[2]) +
        (q ? h : h - q_heads) * (q ? p.q.in_stride[1] : p.k.in_stride[1]);
    sync.prefetch(reinterpret_cast<const char*>(in + off) + at);
  }
}

// What a block's threads share, and how they meet. The kernel declares it
// __shared__ and meets through DeviceSync (CUDA's barrier and warp
// shuffle); the host emulation (tests/cpp/norm_emulation.h) runs every
// thread of a block as a fiber, with barriers of its own, through the same
// norm_rope_thread.
template <typename acc_t>
struct NormShared {
  acc_t warp_total[kNormWarps];
  // Norm "heads" on the vector path: each warp's q and k sums of squares.
  acc_t heads_total[2][kNormWarps];
  // With a cache: the rows' destinations, two so that thread 0 can write the
  // next row's while other warps still read this one's (the next row's
  // barrier comes before the one after it).
  CacheDest dest[2];
};

// The sum of v over each segment of `width` lanes (a power of two), by a
// xor butterfly: every lane ends with its segment's sum.
template <typename acc_t, typename Sync>
ROTARY_HOST_DEVICE acc_t warp_sum(Sync& sync, acc_t v, int width = 32) {
#pragma unroll
  for (int m = width / 2; m > 0; m /= 2) v += sync.shfl_xor(v, m);
  return v;
}

// The vector path's heads of one row for warp `warp`: kNormLaneHeads x (32
// >> lanes_log2) heads at a time; the lanes of segment `slot` take heads
// h0 + slot, h0 + slot + per_warp, ... (every lane takes part in the sums,
// idle ones with +0). kFp8Q: q heads are written as fp8, each by its scale,
// read with the item's loads so that phase 2 waits on no memory for it.
// Norm "heads": a first pass loads the same items for their squares alone,
// summed per tensor over the warp, then over the block's warps in a fixed
// order (sh.heads_total, between two barriers); the pass that writes loads
// them again, from L1 or L2 (DRAM is read once).
template <typename T, bool kFp8Q, bool kInterleaved, typename Sync>
ROTARY_HOST_DEVICE void norm_vector_row(
    const RopeParams& p, const NormParams& n, const NormGrid& g, int64_t b, int64_t s, int64_t pos, int32_t lane,
    int32_t warp, NormShared<typename Acc<T>::type>& sh, Sync& sync) {
  using acc_t = typename Acc<T>::type;
  const int32_t q_heads = static_cast<int32_t>(p.q.heads), total = q_heads + static_cast<int32_t>(p.k.heads);
  const int32_t per_warp = 32 >> g.lanes_log2, slot = lane >> g.lanes_log2, item = lane & ((1 << g.lanes_log2) - 1);
  const int32_t stride = kNormWarps * per_warp * kNormLaneHeads;
  // A step's heads h0 + j * per_warp + slot of this lane: their units, and
  // their item loaded (ss: its squares; 0 for heads that are off).
  const auto load = [&](int32_t h0, NormUnit<T, kFp8Q>(&u)[kNormLaneHeads], bool(&on)[kNormLaneHeads],
                        NormItem<T, kInterleaved>& it, acc_t(&ss)[kNormLaneHeads]) {
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      const int32_t hj = h0 + j * per_warp + slot;
      on[j] = hj < total && item < g.items;
      const int32_t h = on[j] ? hj : 0;
      const int i = h < q_heads ? 0 : 1;
      u[j] = norm_unit<T, kFp8Q>(p, n, i, b, s, i ? h - q_heads : h, 1);
    }
    if (on[0] && p.num_axes == 0) {
      norm_item_load<kInterleaved, false>(p, g, u, on, b, s, pos, item, it, ss);
    } else if (on[0]) {
      norm_item_load<kInterleaved, true>(p, g, u, on, b, s, pos, item, it, ss);
    } else {
#pragma unroll
      for (int j = 0; j < kNormLaneHeads; ++j) ss[j] = 0;
    }
  };
  // Norm "heads": the block's q and k sums of squares, in shared memory;
  // the pass that writes takes each head's scale from them as norm "head"
  // takes its own from the warp (no register holds them across the pass;
  // nor a row parity for two sets of them: the row ends at a barrier).
  // Selects, not an index that depends on the head: a register array
  // indexed at run time lives in local memory.
  const bool across = n.kind == NormKind::kHeads;
  acc_t(&totals)[2][kNormWarps] = sh.heads_total;
  if (across) {
    acc_t part[2] = {0, 0};
    for (int32_t h0 = warp * per_warp * kNormLaneHeads; h0 < total; h0 += stride) {
      NormUnit<T, kFp8Q> u[kNormLaneHeads];
      bool on[kNormLaneHeads];
      NormItem<T, kInterleaved> it;
      acc_t ss[kNormLaneHeads];
      load(h0, u, on, it, ss);
#pragma unroll
      for (int j = 0; j < kNormLaneHeads; ++j) {
        const bool q = h0 + j * per_warp + slot < q_heads;
        part[0] += q ? ss[j] : acc_t(0);  // squares: + 0 leaves the sum's bits
        part[1] += q ? acc_t(0) : ss[j];
      }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      part[t] = warp_sum(sync, part[t]);
      if (lane == 0) totals[t][warp] = part[t];
    }
    sync.block();
  }
  for (int32_t h0 = warp * per_warp * kNormLaneHeads; h0 < total; h0 += stride) {
    NormUnit<T, kFp8Q> u[kNormLaneHeads];
    bool on[kNormLaneHeads];
    NormItem<T, kInterleaved> it;
    acc_t ss[kNormLaneHeads];
    float q8[kNormLaneHeads] = {};
    load(h0, u, on, it, ss);
    if constexpr (kFp8Q) {
      if (on[0]) {
#pragma unroll
        for (int j = 0; j < kNormLaneHeads; ++j) q8[j] = u[j].fp8 ? u[j].q8_scale(n, 0) : 1.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      if (across) {
        const int t = h0 + j * per_warp + slot < q_heads ? 0 : 1;
        acc_t sum = totals[t][0];
#pragma unroll
        for (int w = 1; w < kNormWarps; ++w) sum += totals[t][w];
        ss[j] = rms_scale(sum, (t ? p.k.heads : p.q.heads) * p.head_dim, n.eps);
      } else {
        ss[j] = rms_scale(warp_sum(sync, ss[j], 1 << g.lanes_log2), p.head_dim, n.eps);
      }
    }
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      if (on[j]) norm_item_store<kInterleaved>(n, u[j], it, j, ss[j], q8[j]);
    }
  }
  if (across) sync.block();  // heads_total is rewritten by the next row
}

// The body of thread (lane, warp) of block `block`, as a plain function of
// its indices, its block's shared memory and its Sync, so that the host
// emulation runs the kernel's whole loop nest. Cache: void
// (apply_qk_norm_rope), or the cache element (T, or uint8_t for
// float8_e4m3fn) of apply_qk_norm_rope_with_kv_cache_. kVector: the
// instantiation for NormGrid.items > 0, with the vector path (rows past the
// table still take the element path); its own, so that the element path's
// launches keep their lower register count.
template <typename T, bool kFp8Q, typename Cache, bool kVector, typename Sync>
ROTARY_HOST_DEVICE void norm_rope_thread(
    const KVCacheParams& kv, const NormParams& n, const NormGrid& g, int64_t block, int32_t lane, int32_t warp,
    NormShared<typename Acc<T>::type>& sh, Sync& sync) {
  using acc_t = typename Acc<T>::type;
  const RopeParams& p = kv.rope;
  int32_t parity = 0;
  const int32_t tid = warp * 32 + lane;
  const int32_t D = static_cast<int32_t>(p.head_dim);
  const int32_t q_heads = static_cast<int32_t>(p.q.heads), k_heads = static_cast<int32_t>(p.k.heads);
  for (NormRows r(p, block); r.more(p); r.next(p, g)) {
    const int64_t b = r.b, s = r.s, pos = r.place.pos;
    if constexpr (kNormPrefetch<T, Cache, kVector>) prefetch_next_row<T>(p, g, b, s, tid, sync);
    if constexpr (!std::is_void_v<Cache>) {
      if (tid == 0) sh.dest[parity] = cache_dest(kv, b, s, r.place);  // read after the barrier below
    }
    const bool vector = kVector && vector_row_at(p, g, b, s, pos);  // this row's path, for all three phases
    if (vector) {
      if constexpr (kVector) {  // only the vector instantiations hold it
        if (p.interleaved) {
          norm_vector_row<T, kFp8Q, true>(p, n, g, b, s, pos, lane, warp, sh, sync);
        } else {
          norm_vector_row<T, kFp8Q, false>(p, n, g, b, s, pos, lane, warp, sh, sync);
        }
      }
    } else if (n.kind == NormKind::kHead) {
      for (int32_t h = warp; h < q_heads + k_heads; h += kNormWarps) {
        const int i = h < q_heads ? 0 : 1;
        const auto u = norm_unit<T, kFp8Q>(p, n, i, b, s, i ? h - q_heads : h, 1);
        const acc_t scale = rms_scale(warp_sum(sync, norm_partial(u, D, lane, 32)), D, n.eps);
        norm_finish(p, n, u, scale, b, s, pos, lane, 32);
      }
    } else {
      for (int i = 0; i < 2; ++i) {
        const int32_t heads = i == 0 ? q_heads : k_heads;
        const auto u = norm_unit<T, kFp8Q>(p, n, i, b, s, 0, heads);
        const acc_t sum = warp_sum(sync, norm_partial(u, D, tid, kNormThreads));
        if (lane == 0) sh.warp_total[warp] = sum;
        sync.block();
        acc_t total = sh.warp_total[0];
#pragma unroll
        for (int w = 1; w < kNormWarps; ++w) total += sh.warp_total[w];
        sync.block();  // warp_total is rewritten by the next unit
        norm_finish(p, n, u, rms_scale(total, static_cast<int64_t>(heads) * D, n.eps), b, s, pos, tid, kNormThreads);
      }
    }
    if constexpr (!std::is_void_v<Cache>) {
      sync.block();  // every warp's k elements of the row, and dest[parity], are written
      if (vector && g.cache_vector) {
        norm_cache_vectors<T, Cache>(kv, sh.dest[parity], tid, kNormThreads);
      } else {
        norm_cache_row<T, Cache>(kv, sh.dest[parity], tid, kNormThreads);
      }
      parity ^= 1;
    }
  }
}

#if defined(__CUDACC__)
struct DeviceSync {
  __device__ __forceinline__ void block() const { __syncthreads(); }
  __device__ __forceinline__ void prefetch(const void* at) const { prefetch_l2(at); }
  template <typename V>
  __device__ __forceinline__ V shfl_xor(V v, int m) const {
    return __shfl_xor_sync(0xffffffffu, v, m);
  }
};

// The resident blocks the vector instantiations' registers must leave room
// for: 3 (ptxas would keep float32's to 4 blocks' 128 registers, and
// spill); none asked of the element path (its choice: 64-100).
template <bool kVector>
constexpr int kNormMinBlocks = kVector ? 3 : 1;

template <typename T, bool kFp8Q, typename Cache, bool kVector>
__global__ void __launch_bounds__(kNormThreads, kNormMinBlocks<kVector>) norm_rope_kernel(
    const __grid_constant__ KVCacheParams kv, const __grid_constant__ NormParams n, const NormGrid g) {
  __shared__ NormShared<typename Acc<T>::type> shared;
  DeviceSync sync;
  norm_rope_thread<T, kFp8Q, Cache, kVector>(kv, n, g, blockIdx.x, static_cast<int32_t>(threadIdx.x),
                                             static_cast<int32_t>(threadIdx.y), shared, sync);
}
#endif

}  // namespace kernel
}  // namespace rotary
