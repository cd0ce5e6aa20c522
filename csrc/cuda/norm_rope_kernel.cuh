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
// (HeadWalk) step without a division per item. Norm "head" on aligned,
// unit-stride rows takes the vector path instead (norm_vector.cuh): a
// segment of lanes per head, one item of two 16-byte vectors per lane and
// head, loaded once. apply_qk_norm_rope_with_kv_cache_ runs the same launch
// with a cache type: once a row's k is finished, the block writes it and v
// into the caches (norm_cache.cuh), at the cache row one thread found for
// the block (CacheDest).
#pragma once

#include "norm_cache.cuh"
#include "norm_grid.cuh"
#include "norm_vector.cuh"
#include "params/fp8.h"
#include "params/kv_params.h"
#include "params/norm_params.h"
#include "params/rope_params.h"
#include "rope_vector.cuh"

#include <cstdint>
#include <type_traits>

namespace rotary {
namespace kernel {

// Heads [0, heads) of one tensor of token (b, s); elements are in_elem apart.
// kFp8Q: the instantiation that can write q as float8_e4m3fn (its own
// kernel, so the plain one carries none of its state).
template <typename T, bool kFp8Q>
struct NormUnit {
  using value_type = T;
  using acc_t = typename Acc<T>::type;
  const T* in;
  void* out;  // T, or float8_e4m3fn bytes with fp8_scale
  int64_t in_head, out_head, in_elem, out_elem;
  const void* weight;   // weight_of's: null (ones), acc_t or T elements
  int64_t weight_head;  // 0 for norm "head": one weight row for every head
  int32_t heads;
  // q as fp8 (kFp8Q only): head h of the unit is q head h0 + h. Its scale
  // is read from the parameters at the store, so nothing more stays live.
  bool fp8;
  int32_t h0;

  // Weight element d of head h of the unit; the flag and the offset stay in
  // the parameters, not in registers.
  ROTARY_HOST_DEVICE acc_t weight_at(const NormParams& n, int32_t h, int64_t d) const {
    return weight_of<T, acc_t>(weight, n.weight_acc, static_cast<acc_t>(n.weight_offset), h * weight_head + d);
  }

  ROTARY_HOST_DEVICE void put(const NormParams& n, int32_t h, int64_t at, acc_t v) const {
    if constexpr (kFp8Q) {
      if (fp8) {
        static_cast<uint8_t*>(out)[at] = quantize_fp8(v, n.q_scale + (h0 + h) * n.q_scale_stride);
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
  for (HeadWalk w(tid, width); w.h < u.heads; w.next(threads, width)) {
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
      u.put(n, w.h, out + d0 * u.out_elem, y0);
      u.put(n, w.h, out + d1 * u.out_elem, y1);
    } else {
      const int32_t k = w.i - pairs;
      const int64_t d = k < off ? k : k + p.rotary_dim;
      u.put(n, w.h, out + d * u.out_elem, normalized(to_acc(in[d * u.in_elem]), scale, u.weight_at(n, w.h, d)));
    }
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
// idle ones with +0).
template <typename T, bool kInterleaved, typename Sync>
ROTARY_HOST_DEVICE void norm_vector_row(
    const RopeParams& p, const NormParams& n, const NormGrid& g, int64_t b, int64_t s, int64_t pos, int32_t lane,
    int32_t warp, Sync& sync) {
  using acc_t = typename Acc<T>::type;
  const int32_t q_heads = static_cast<int32_t>(p.q.heads), total = q_heads + static_cast<int32_t>(p.k.heads);
  const int32_t per_warp = 32 >> g.lanes_log2, slot = lane >> g.lanes_log2, item = lane & ((1 << g.lanes_log2) - 1);
  for (int32_t h0 = warp * per_warp * kNormLaneHeads; h0 < total; h0 += kNormWarps * per_warp * kNormLaneHeads) {
    NormUnit<T, false> u[kNormLaneHeads];
    bool on[kNormLaneHeads];
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      const int32_t hj = h0 + j * per_warp + slot;
      on[j] = hj < total && item < g.items;
      const int32_t h = on[j] ? hj : 0;
      const int i = h < q_heads ? 0 : 1;
      u[j] = norm_unit<T, false>(p, n, i, b, s, i ? h - q_heads : h, 1);
    }
    NormItem<T, kInterleaved> it;
    acc_t ss[kNormLaneHeads];
    if (on[0]) {
      norm_item_load<kInterleaved>(p, g, u, on, pos, item, it, ss);
    } else {
#pragma unroll
      for (int j = 0; j < kNormLaneHeads; ++j) ss[j] = 0;
    }
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      ss[j] = rms_scale(warp_sum(sync, ss[j], 1 << g.lanes_log2), p.head_dim, n.eps);
    }
#pragma unroll
    for (int j = 0; j < kNormLaneHeads; ++j) {
      if (on[j]) norm_item_store<kInterleaved>(n, u[j], it, j, ss[j]);
    }
  }
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
    const bool vector = kVector && vector_row_at(p, g, pos);  // this row's path, for all three phases
    if (vector) {
      if (p.interleaved) {
        norm_vector_row<T, true>(p, n, g, b, s, pos, lane, warp, sync);
      } else {
        norm_vector_row<T, false>(p, n, g, b, s, pos, lane, warp, sync);
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

template <typename T, bool kFp8Q, typename Cache, bool kVector>
__global__ void __launch_bounds__(kNormThreads) norm_rope_kernel(
    const __grid_constant__ KVCacheParams kv, const __grid_constant__ NormParams n, const NormGrid g) {
  __shared__ NormShared<typename Acc<T>::type> shared;
  DeviceSync sync;
  norm_rope_thread<T, kFp8Q, Cache, kVector>(kv, n, g, blockIdx.x, static_cast<int32_t>(threadIdx.x),
                                             static_cast<int32_t>(threadIdx.y), shared, sync);
}
#endif

}  // namespace kernel
}  // namespace rotary
