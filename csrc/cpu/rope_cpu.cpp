// CPU kernel: rows (batch, token) in parallel; per row the cos/sin of every
// pair is read from the table once and applied to all q and k heads.
#include "../checks.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <vector>

namespace rotary {
namespace {

using kernel::HeadTensor;
using kernel::RopeParams;

// Rotates one head vector whose elements are contiguous (in may equal out).
template <typename acc_t>
void rotate_contiguous(
    const acc_t* in, acc_t* out, const acc_t* cos, const acc_t* sin, int64_t pairs, bool interleaved) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kLanes = Vec::size();
  int64_t j = 0;
  if (interleaved) {
    for (; j + kLanes <= pairs; j += kLanes) {
      auto [x0, x1] = at::vec::deinterleave2(Vec::loadu(in + 2 * j), Vec::loadu(in + 2 * j + kLanes));
      const Vec c = Vec::loadu(cos + j);
      const Vec s = Vec::loadu(sin + j);
      auto [lo, hi] = at::vec::interleave2(x0 * c - x1 * s, x0 * s + x1 * c);
      lo.store(out + 2 * j);
      hi.store(out + 2 * j + kLanes);
    }
  } else {
    for (; j + kLanes <= pairs; j += kLanes) {
      const Vec x0 = Vec::loadu(in + j);
      const Vec x1 = Vec::loadu(in + pairs + j);
      const Vec c = Vec::loadu(cos + j);
      const Vec s = Vec::loadu(sin + j);
      (x0 * c - x1 * s).store(out + j);
      (x0 * s + x1 * c).store(out + pairs + j);
    }
  }
  const int64_t dim = 2 * pairs;
  for (; j < pairs; ++j) {
    const int64_t i0 = kernel::pair_first(j, dim, interleaved);
    const int64_t i1 = kernel::pair_second(j, dim, interleaved);
    kernel::rotate_pair<acc_t>(in[i0], in[i1], cos[j], sin[j], out[i0], out[i1]);
  }
}

template <typename scalar_t, typename acc_t>
void rotate_strided(
    const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step,
    const acc_t* cos, const acc_t* sin, int64_t pairs, bool interleaved) {
  const int64_t dim = 2 * pairs;
  for (int64_t j = 0; j < pairs; ++j) {
    const int64_t i0 = kernel::pair_first(j, dim, interleaved);
    const int64_t i1 = kernel::pair_second(j, dim, interleaved);
    acc_t y0, y1;
    kernel::rotate_pair<acc_t>(
        static_cast<acc_t>(in[i0 * in_step]), static_cast<acc_t>(in[i1 * in_step]), cos[j], sin[j], y0, y1);
    out[i0 * out_step] = static_cast<scalar_t>(y0);
    out[i1 * out_step] = static_cast<scalar_t>(y1);
  }
}

// Per-thread scratch: the row's cos/sin, and a float copy of one head for
// 16-bit inputs (converted once, rotated in fp32, rounded once).
template <typename acc_t>
struct RowScratch {
  std::vector<acc_t> cos, sin, head;
  explicit RowScratch(int64_t dim) : cos(dim / 2), sin(dim / 2), head(dim) {}
};

template <typename scalar_t, typename acc_t>
void rotate_heads(
    const RopeParams& p, const HeadTensor& t, int64_t b, int64_t s, RowScratch<acc_t>& scratch) {
  const int64_t pairs = p.head_dim / 2;
  const auto* in_base = static_cast<const scalar_t*>(t.in) + b * t.in_stride[0] + s * t.in_stride[2];
  auto* out_base = static_cast<scalar_t*>(t.out) + b * t.out_stride[0] + s * t.out_stride[2];
  const bool contiguous = t.in_stride[3] == 1 && t.out_stride[3] == 1;
  for (int64_t h = 0; h < t.heads; ++h) {
    const scalar_t* in = in_base + h * t.in_stride[1];
    scalar_t* out = out_base + h * t.out_stride[1];
    if (!contiguous) {
      rotate_strided<scalar_t, acc_t>(
          in, t.in_stride[3], out, t.out_stride[3], scratch.cos.data(), scratch.sin.data(), pairs,
          p.interleaved);
    } else if constexpr (std::is_same_v<scalar_t, acc_t>) {
      rotate_contiguous<acc_t>(in, out, scratch.cos.data(), scratch.sin.data(), pairs, p.interleaved);
    } else {
      acc_t* head = scratch.head.data();
      at::vec::convert(in, head, p.head_dim);
      rotate_contiguous<acc_t>(head, head, scratch.cos.data(), scratch.sin.data(), pairs, p.interleaved);
      at::vec::convert(head, out, p.head_dim);
    }
  }
}

template <typename scalar_t>
void rope_cpu_kernel(const RopeParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = p.batch * p.seq;
  const int64_t pairs = p.head_dim / 2;
  const int64_t row_elems = (p.q.heads + p.k.heads) * p.head_dim;
  // About 32K elements per task: enough to amortise a task, small enough that
  // decode-sized calls still split across threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(row_elems, 1));
  const float sin_sign = p.inverse ? -1.0f : 1.0f;

  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    RowScratch<acc_t> scratch(p.head_dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / p.seq;
      const int64_t s = row % p.seq;
      const float* table = p.freqs + 2 * kernel::position_of(p, b, s) * p.freqs_stride_pos;
      for (int64_t j = 0; j < pairs; ++j) {
        scratch.cos[j] = static_cast<acc_t>(table[2 * j * p.freqs_stride_pair]);
        scratch.sin[j] = static_cast<acc_t>(sin_sign * table[2 * j * p.freqs_stride_pair + 1]);
      }
      rotate_heads<scalar_t, acc_t>(p, p.q, b, s, scratch);
      rotate_heads<scalar_t, acc_t>(p, p.k, b, s, scratch);
    }
  });
}

void run_cpu(const detail::PreparedRope& prepared, at::ScalarType dtype) {
  if (prepared.params.batch * prepared.params.seq == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "rotary_cpu", [&] {
    rope_cpu_kernel<scalar_t>(prepared.params);
  });
}

at::Tensor apply_rope_cpu(
    const at::Tensor& x,
    const at::Tensor& freqs,
    int64_t start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  auto prepared =
      detail::prepare_rope("apply_rope", x, nullptr, freqs, start_pos, positions, interleaved, inverse);
  run_cpu(prepared, x.scalar_type());
  return prepared.out_q;
}

std::tuple<at::Tensor, at::Tensor> apply_rope_qk_cpu(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    int64_t start_pos,
    bool interleaved,
    const std::optional<at::Tensor>& positions,
    bool inverse) {
  auto prepared =
      detail::prepare_rope("apply_rope_qk", q, &k, freqs, start_pos, positions, interleaved, inverse);
  run_cpu(prepared, q.scalar_type());
  return {prepared.out_q, prepared.out_k};
}

}  // namespace

TORCH_LIBRARY_IMPL(rotary, CPU, m) {
  m.impl("apply_rope", &apply_rope_cpu);
  m.impl("apply_rope_qk", &apply_rope_qk_cpu);
}

}  // namespace rotary
