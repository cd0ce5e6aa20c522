// The prologue op on the CPU: at::parallel_for over (batch, tile of tokens);
// a task fills its tokens' rotation coefficients once (coefficients.h) and
// runs the norm kernel (kernel/norm_kernel.cpp, the build for this CPU) over
// every q and k head of the tile: each element is read once and written once.
#include "coefficients.h"
#include "cpu/kernel/norm_kernel.h"
#include "op/norm_backend.h"
#include "rope_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>

namespace rotary {
namespace cpu {
namespace {

using kernel::HeadTensor;
using kernel::NormKind;
using kernel::NormParams;
using kernel::RopeParams;

template <typename scalar_t>
void norm_rotate_run(const NormRun<scalar_t>& r, Capability cap) {
  ROTARY_CPU_DISPATCH(cap, isa::norm_rotate_run(r))
}

template <typename scalar_t>
void norm_tensor_tile(
    const RopeParams& p, const NormParams& n, int i, int64_t b, int64_t s0, int64_t tile,
    const at::opmath_type<scalar_t>* coef, int64_t coef_tok, const at::opmath_type<scalar_t>* weight,
    at::opmath_type<scalar_t>* scratch, Capability cap) {
  const HeadTensor& t = i == 0 ? p.q : p.k;
  // No heads, nothing to do; the 16-bit per-head kernel reads a group of
  // vectors ahead, bounded by tokens, and would read past an empty side.
  if (t.heads == 0) return;
  const bool across = n.kind == NormKind::kHeads;
  const float* fp8_scale = i == 0 ? n.q_scale : nullptr;  // q as float8_e4m3fn bytes
  const int64_t out_elem = fp8_scale ? 1 : int64_t(sizeof(scalar_t));
  const NormRun<scalar_t> r{
      static_cast<const scalar_t*>(t.in) + b * t.in_stride[0] + s0 * t.in_stride[2],
      static_cast<char*>(t.out) + (b * t.out_stride[0] + s0 * t.out_stride[2]) * out_elem,
      tile, t.in_stride[2], t.out_stride[2],
      t.heads, t.in_stride[1], t.out_stride[1],
      t.in_stride[3], t.out_stride[3],
      coef, coef_tok,
      weight, across ? p.head_dim : 0,
      p.head_dim, p.rotary_offset, p.rotary_dim,
      n.eps, across, p.interleaved,
      scratch,
      fp8_scale, n.q_scale_stride};
  norm_rotate_run(r, cap);
}

template <typename scalar_t>
void norm_rope_kernel(const RopeParams& p, const NormParams& n, Capability cap, const TileHook* hook) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t coef_per_token = row_values(p, p.interleaved);
  const int64_t tile = tile_tokens<acc_t>(p);
  const int64_t tiles_per_batch = (p.seq + tile - 1) / tile;
  const int64_t tasks = p.batch * tiles_per_batch;
  const int64_t task_elems = tile * (p.q.heads + p.k.heads) * p.head_dim;
  const int64_t grain = grain_tasks(task_elems);
  const bool across = n.kind == NormKind::kHeads;
  const int64_t scratch_len = std::max(across ? std::max(p.q.heads, p.k.heads) : 1, kNormScratch) * p.head_dim;
  const int64_t weight_len[2] = {(across ? p.q.heads : 1) * p.head_dim, (across ? p.k.heads : 1) * p.head_dim};
  const acc_t offset = static_cast<acc_t>(n.weight_offset);
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    // Uninitialised: fill_coefficients and the kernel write before they read.
    const std::unique_ptr<acc_t[]> coef(new acc_t[static_cast<size_t>(tile * coef_per_token)]);
    const std::unique_ptr<acc_t[]> scratch(new acc_t[static_cast<size_t>(scratch_len)]);
    // Each weight as the kernel multiplies by it, in acc_t (weight_of).
    std::unique_ptr<acc_t[]> weight[2];
    for (int i = 0; i < 2; ++i) {
      weight[i].reset(new acc_t[static_cast<size_t>(weight_len[i])]);
      for (int64_t d = 0; d < weight_len[i]; ++d) {
        weight[i][d] = kernel::weight_of<scalar_t, acc_t>(n.weight[i], n.weight_acc, offset, d);
      }
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tiles_per_batch;
      const int64_t s0 = (task % tiles_per_batch) * tile;
      const int64_t len = std::min(tile, p.seq - s0);
      for (int64_t s = 0; s < len; ++s) {
        fill_coefficients(p, b, s0 + s, p.interleaved, coef.get() + s * coef_per_token);
      }
      norm_tensor_tile<scalar_t>(p, n, 0, b, s0, len, coef.get(), coef_per_token, weight[0].get(), scratch.get(),
                                 cap);
      norm_tensor_tile<scalar_t>(p, n, 1, b, s0, len, coef.get(), coef_per_token, weight[1].get(), scratch.get(),
                                 cap);
      if (hook != nullptr) hook->fn(hook->ctx, b, s0, len, 0, p.k.heads);
    }
  });
}

void run_cpu(const detail::PreparedNormRope& prepared, at::ScalarType dtype) {
  norm_rope_cpu(prepared.rope.params, prepared.norm.params, dtype, nullptr);
}

}  // namespace

void norm_rope_cpu(
    const RopeParams& p, const NormParams& n, at::ScalarType dtype, const TileHook* hook, Capability cap) {
  if (p.batch * p.seq == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_norm_cpu", [&] {
    norm_rope_kernel<scalar_t>(p, n, cap, hook);
  });
}

void norm_rope_cpu(const RopeParams& p, const NormParams& n, at::ScalarType dtype, const TileHook* hook) {
  static const Capability cap = capability_from_aten();
  norm_rope_cpu(p, n, dtype, hook, cap);
}

}  // namespace cpu

TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  detail::NormBackendOps<&cpu::run_cpu>::register_all(m);
}

}  // namespace rotary
