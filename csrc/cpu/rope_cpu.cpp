// CPU entry: the dispatcher impl, the at::parallel_for tiling and the pick of
// the kernel compiled for this CPU (kernel/rope_kernel.cpp, one copy per
// capability). Work is split into tasks of (batch, a tile of tokens); a task
// first turns the table rows of its tokens into rotation coefficients laid
// out for straight vector loads, then rotates every q and k head vector of
// the tile. Outputs too big for the caches are written with streaming stores.
#include "rope_cpu.h"

#include "op/backend_ops.h"
#include "coefficients.h"
#include "cpu/kernel/rope_kernel.h"
#include "pages.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace rotary {
namespace cpu {

using kernel::HeadTensor;
using kernel::RopeParams;

Capability capability_from_aten() {
  // ATen's pick: the best its CPU check allows, or ATEN_CPU_CAPABILITY.
  const std::string aten = at::get_cpu_capability();
#if defined(ROTARY_CPU_AVX512_BF16)
  // ATEN_CPU_CAPABILITY=avx512 asks for that build: AVX512 as it is.
  const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
  const bool plain = asked != nullptr && std::string(asked) == "avx512";
  if (aten == "AVX512" && !plain && __builtin_cpu_supports("avx512bf16")) return Capability::kAvx512Bf16;
#endif
#if defined(ROTARY_CPU_AVX512)
  if (aten == "AVX512") return Capability::kAvx512;
#endif
#if defined(ROTARY_CPU_AVX2)
  if (aten == "AVX512" || aten == "AVX2") return Capability::kAvx2;
#endif
  return Capability::kDefault;
}

const char* capability_name(Capability cap) {
  switch (cap) {
    case Capability::kAvx512Bf16:
      return "AVX512_BF16";
    case Capability::kAvx512:
      return "AVX512";
    case Capability::kAvx2:
      return "AVX2";
    default:
      return "DEFAULT";
  }
}

namespace {

// Fresh output pages of at least this many bytes are mapped up front
// (populate).
constexpr int64_t kPopulateBytes = int64_t{16} << 20;
// Mapped outputs take streaming stores past a line: half the last-level
// cache, taken as 16-32 MiB (so 8-16 MiB), where input and output together
// outgrow it. Every streaming build writes whole lines (rope_kernel.cpp:
// kPerLine), so the kernel is memory-bound there, and skipping the read for
// ownership of every output line saves a third of the traffic (Zen 5, 32
// MiB L3, outputs of 24-30 MiB: 1.4-2.1x `clone` with plain stores,
// 0.8-1.3x streamed at 1 thread and 0.8-1.8x at 2; at 12 MiB streaming won
// at 1 thread and lost at 2). A cache above 32 MiB (Intel's socket-wide
// L3) is taken as 32: the line was measured up to there.
constexpr int64_t kStreamWideBytes = int64_t{32} << 20;
int64_t stream_bytes() {
  static const int64_t bytes = [] {
    // ROTARY_CPU_STREAM_BYTES: the line for tests of the streaming path.
    if (const char* env = std::getenv("ROTARY_CPU_STREAM_BYTES")) return std::max<int64_t>(1, std::atoll(env));
    const int64_t llc = pages::shared_cache_bytes();
    return std::min(kStreamWideBytes, std::max<int64_t>(int64_t{16} << 20, llc)) / 2;
  }();
  return bytes;
}

// An out-of-place output's fresh pages, mapped in parallel before the
// rotation (each thread one contiguous slice). True when they are mapped now.
bool populate(const HeadTensor& t, int64_t bytes) {
  constexpr int64_t kSlice = int64_t{4} << 20;
  pages::advise_huge(t.out, bytes);
  const int64_t slices = (bytes + kSlice - 1) / kSlice;
  std::atomic<bool> ok{true};
  at::parallel_for(0, slices, 1, [&](int64_t begin, int64_t end) {
    char* base = static_cast<char*>(t.out) + begin * kSlice;
    if (!pages::populate_for_write(base, std::min(bytes, end * kSlice) - begin * kSlice)) ok = false;
  });
  return ok;
}

// Streaming stores need every store aligned to its width (up to 64 bytes):
// out of place, contiguous head vectors at 64-byte aligned addresses, and
// halves of rotary_dim that keep that alignment.
template <typename scalar_t>
bool stream_aligned(const RopeParams& p, const HeadTensor& t) {
  const int64_t elem = sizeof(scalar_t);
  if (p.in_place || p.rotary_dim != p.head_dim || p.rotary_offset != 0 || t.out_stride[3] != 1) return false;
  if (reinterpret_cast<uintptr_t>(t.out) % 64 != 0 || (p.rotary_dim / 2 * elem) % 64 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if ((t.out_stride[d] * elem) % 64 != 0) return false;
  }
  return true;
}

// Whether one output takes streaming stores: pages just populated (measured
// faster than plain stores over the kernel's zeros), or mapped pages of an
// output past the streaming line above. Dense outputs (those prepare_rope
// allocates) span batch * heads * seq vectors.
template <typename scalar_t>
bool stream_output(const RopeParams& p, const HeadTensor& t, int64_t out_bytes, Capability cap) {
  // Smaller outputs neither populate nor stream: no mincore on the decode path.
  if (t.heads == 0 || p.in_place || out_bytes < std::min(kPopulateBytes, stream_bytes())) return false;
  const int64_t bytes = p.batch * t.heads * p.seq * p.head_dim * int64_t(sizeof(scalar_t));
  const bool mapped = pages::mapped(t.out, bytes);
  const bool populated = !mapped && out_bytes >= kPopulateBytes && populate(t, bytes);
  if (cap == Capability::kDefault || !stream_aligned<scalar_t>(p, t)) return false;
  return populated || (mapped && out_bytes >= stream_bytes());
}

// The kernel's software prefetch along the walk (Run::prefetch) pays from a
// quarter of the last-level cache of output on (half the streaming line),
// where the data comes from memory. Below, it sits in cache and the
// prefetches cost only their instructions (Zen 5, outputs of 3-6 MiB: bf16
// 10-25% and fp32 5-20% faster without, at 1 and 2 threads; bf16 decode 10%).
// Intel's L3 is further away: 4- and 8-byte elements still gain where a
// thread's share of input and output outgrows its L2 (Xeon, fp32, 1 thread:
// decode 111.8 -> 98.0 us, a 128-token prefill in the HF layout 245.6 ->
// 215.7; at 2 threads decode's share fits in L2, and the prefetch cost 5%).
// 16-bit elements, bound by their instructions there, lose 5-10% with it.
bool prefetch_walk(int64_t out_bytes, int64_t data_bytes, int64_t elem_bytes) {
  static const bool far_l3 = pages::intel_cpu();
  static const int64_t l2 = pages::l2_cache_bytes();
  if (out_bytes >= stream_bytes() / 2) return true;
  return far_l3 && elem_bytes >= 4 && l2 > 0 && data_bytes / at::get_num_threads() > l2;
}

template <typename scalar_t>
void rotate_run(const Run<scalar_t>& r, int64_t dim, bool interleaved, Capability cap, bool nt) {
  ROTARY_CPU_DISPATCH(cap, isa::rotate_run(r, dim, interleaved, nt))
}

// Whether the build for cap reads its rows per element (kernel/rope_kernel.h).
template <typename scalar_t>
bool per_element_rows(bool interleaved, Capability cap) {
  const auto pairs = [&] { ROTARY_CPU_DISPATCH(cap, isa::interleaved_pair_rows<scalar_t>()) };
  return interleaved && !pairs();
}

// Out of place, dims [from, to) of every vector of the run (whose pointers
// start at dim 0) are copied unchanged: the dims around the rotated span.
template <typename scalar_t>
void copy_dims(const Run<scalar_t>& r, int64_t from, int64_t to) {
  if (to <= from) return;
  for (int64_t t = 0; t < r.tokens; ++t) {
    for (int64_t h = 0; h < r.heads; ++h) {
      const scalar_t* in = r.in + t * r.in_tok + h * r.in_head;
      scalar_t* out = r.out + t * r.out_tok + h * r.out_head;
      if (r.in_inner == 1 && r.out_inner == 1) {
        std::memcpy(out + from, in + from, (to - from) * sizeof(scalar_t));
      } else {
        for (int64_t i = from; i < to; ++i) out[i * r.out_inner] = in[i * r.in_inner];
      }
    }
  }
}

bool heads_major(const HeadTensor& t) {
  const auto abs64 = [](int64_t v) { return v < 0 ? -v : v; };
  return abs64(t.in_stride[2]) <= abs64(t.in_stride[1]);
}

// Heads [h0, h1) of one tensor for tokens [s0, s0 + tile) of batch b.
template <typename scalar_t>
void rotate_tensor_tile(
    const RopeParams& p, const HeadTensor& t, int64_t b, int64_t s0, int64_t tile, int64_t h0, int64_t h1,
    const at::opmath_type<scalar_t>* coef, int64_t coef_tok, Capability cap, bool nt, bool prefetch) {
  if (h1 <= h0) return;
  const int64_t dim = p.rotary_dim;
  // The run starts at dim rotary_offset: the kernel rotates its dims [0, dim).
  const int64_t off = p.rotary_offset;
  const Run<scalar_t> r{
      static_cast<const scalar_t*>(t.in) + b * t.in_stride[0] + s0 * t.in_stride[2] + h0 * t.in_stride[1] +
          off * t.in_stride[3],
      static_cast<scalar_t*>(t.out) + b * t.out_stride[0] + s0 * t.out_stride[2] + h0 * t.out_stride[1] +
          off * t.out_stride[3],
      tile, t.in_stride[2], t.out_stride[2], coef_tok,
      h1 - h0, t.in_stride[1], t.out_stride[1],
      t.in_stride[3], t.out_stride[3],
      coef,
      /*tokens_outer=*/tile == 1 || !heads_major(t), prefetch};
  rotate_run(r, dim, p.interleaved, cap, nt);
  if (!p.in_place && p.head_dim > dim) {
    Run<scalar_t> whole = r;
    whole.in -= off * t.in_stride[3];
    whole.out -= off * t.out_stride[3];
    copy_dims(whole, 0, off);
    copy_dims(whole, off + dim, p.head_dim);
  }
}

// Tasks are (batch, group of heads, tile of tokens), in that order. With
// several threads and heads-major tensors the q and k heads are cut into one
// group per thread, so that each thread writes one contiguous stretch of
// memory, as a copy does: when fresh output pages fault in, two threads
// faulting the same page tables in turn made the call ~1.3x a clone. Each
// group fills the coefficients of its tiles itself.
template <typename scalar_t>
void rope_cpu_kernel(const RopeParams& p, Capability cap, const TileHook* hook) {
  using acc_t = at::opmath_type<scalar_t>;
  const bool per_element = per_element_rows<scalar_t>(p.interleaved, cap);
  const int64_t coef_per_token = row_values(p, per_element);
  const int64_t tile = tile_tokens<acc_t>(p);
  const int64_t tiles_per_batch = (p.seq + tile - 1) / tile;
  const int64_t all_heads = p.q.heads + p.k.heads;
  if (all_heads == 0) return;  // nothing to rotate (and no group to divide the heads by)
  const bool split_heads = tiles_per_batch > 1 && heads_major(p.q) && (p.k.heads == 0 || heads_major(p.k));
  const int64_t groups = split_heads ? std::min<int64_t>(at::get_num_threads(), all_heads) : 1;
  const int64_t group_heads = (all_heads + groups - 1) / groups;
  const int64_t tasks = p.batch * groups * tiles_per_batch;
  const int64_t task_elems = tile * group_heads * p.head_dim;
  const int64_t grain = grain_tasks(task_elems);
  const int64_t out_bytes = all_heads * p.batch * p.seq * p.head_dim * int64_t(sizeof(scalar_t));
  const bool nt_q = stream_output<scalar_t>(p, p.q, out_bytes, cap);
  const bool nt_k = stream_output<scalar_t>(p, p.k, out_bytes, cap);
  const bool prefetch = prefetch_walk(out_bytes, (p.in_place ? 1 : 2) * out_bytes, sizeof(scalar_t));

  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    // Uninitialised: every value is written by fill_coefficients before it is read.
    const std::unique_ptr<acc_t[]> coef(new acc_t[static_cast<size_t>(tile * coef_per_token)]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (groups * tiles_per_batch);
      const int64_t g = task / tiles_per_batch % groups;
      const int64_t s0 = (task % tiles_per_batch) * tile;
      const int64_t n = std::min(tile, p.seq - s0);
      for (int64_t s = 0; s < n; ++s) {
        fill_coefficients(p, b, s0 + s, per_element, coef.get() + s * coef_per_token);
      }
      // Heads [h0, h1) of the q heads followed by the k heads.
      const int64_t h0 = g * group_heads, h1 = std::min(all_heads, h0 + group_heads);
      const int64_t qh = p.q.heads;
      rotate_tensor_tile<scalar_t>(p, p.q, b, s0, n, h0, std::min(h1, qh), coef.get(), coef_per_token, cap, nt_q,
                                 prefetch);
      if (p.k.heads > 0) {
        const int64_t k0 = std::max<int64_t>(h0 - qh, 0), k1 = std::max<int64_t>(h1 - qh, 0);
        rotate_tensor_tile<scalar_t>(p, p.k, b, s0, n, k0, k1, coef.get(), coef_per_token, cap, nt_k, prefetch);
        if (hook != nullptr && k1 > k0) hook->fn(hook->ctx, b, s0, n, k0, k1);
      }
    }
  });
}

}  // namespace

void rope_cpu(const RopeParams& p, at::ScalarType dtype, Capability cap) {
  if (p.batch * p.seq == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cpu", [&] {
    rope_cpu_kernel<scalar_t>(p, cap, nullptr);
  });
}

void rope_cpu(const RopeParams& p, at::ScalarType dtype, const TileHook& hook) {
  static const Capability cap = capability_from_aten();
  if (p.batch * p.seq == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cpu", [&] {
    rope_cpu_kernel<scalar_t>(p, cap, &hook);
  });
}

void rope_cpu(const RopeParams& p, at::ScalarType dtype) {
  static const Capability cap = capability_from_aten();
  rope_cpu(p, dtype, cap);
}

}  // namespace cpu

namespace {

void run_cpu(const detail::PreparedRope& prepared, at::ScalarType dtype) {
  cpu::rope_cpu(prepared.params, dtype);
}

}  // namespace

// Validation, allocation and the in-place rules come from BackendOps.
TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  detail::BackendOps<&run_cpu>::register_all(m);
}

}  // namespace rotary
