// Host emulation of the CUDA kernel with a rotated span at an offset and N-D
// positions (pair_axes): every thread of the grid through rope_thread, on the
// vector and the strided path, against a float64 reference written here.
#ifdef ROTARY_EMULATION

#include "checks/checks.h"
#include "cuda/cuda_types.h"
#include "cuda/rope_kernel.cuh"
#include "reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace {

using rotary::kernel::Grid;
using rotary::kernel::RopeParams;

template <typename T, bool kInterleaved, bool kVectorized>
void emulate(const RopeParams& p) {
  const Grid g = rotary::kernel::make_grid<T, kInterleaved, kVectorized>(p);
  const Grid launched = rotary::kernel::launched(p, g, g.row_blocks);
  for (int64_t block = 0; block < g.row_blocks; ++block) {
    for (int32_t tid = 0; tid < g.block_threads; ++tid) {
      rotary::kernel::rope_thread<T, kInterleaved, kVectorized, int64_t>(p, launched, block, tid);
    }
  }
}

template <typename T>
void emulate_path(const RopeParams& p, bool vectorized) {
  if (p.interleaved) {
    vectorized ? emulate<T, true, true>(p) : emulate<T, true, false>(p);
  } else {
    vectorized ? emulate<T, false, true>(p) : emulate<T, false, false>(p);
  }
}

// float64 [B, H, S, D]: pair j of token (b, s) turns by ids[axes[j], b, s];
// dims outside [offset, offset + rotary_dim) are the input's.
at::Tensor reference_nd(
    const at::Tensor& x, const at::Tensor& ids, const std::vector<int64_t>& axes, int64_t rotary_dim, int64_t offset,
    bool interleaved) {
  auto out = x.to(at::kDouble).contiguous().clone();
  const auto in = out.clone();
  auto o = out.accessor<double, 4>();
  auto v = in.accessor<double, 4>();
  auto id = ids.accessor<int64_t, 3>();
  const int64_t half = rotary_dim / 2;
  for (int64_t b = 0; b < x.size(0); ++b) {
    for (int64_t h = 0; h < x.size(1); ++h) {
      for (int64_t s = 0; s < x.size(2); ++s) {
        for (int64_t j = 0; j < half; ++j) {
          const auto e = rotary_test::ref_freq(id[axes[j]][b][s], j, rotary_dim);
          const int64_t i0 = offset + (interleaved ? 2 * j : j);
          const int64_t i1 = offset + (interleaved ? 2 * j + 1 : j + half);
          o[b][h][s][i0] = v[b][h][s][i0] * e.real() - v[b][h][s][i1] * e.imag();
          o[b][h][s][i1] = v[b][h][s][i0] * e.imag() + v[b][h][s][i1] * e.real();
        }
      }
    }
  }
  return out;
}

void run(at::ScalarType dtype, bool interleaved, int64_t offset, bool nd, bool vectorized, bool strided) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + (interleaved ? " interleaved" : " half") + " offset=" +
               std::to_string(offset) + (nd ? " nd" : " 1d") + (vectorized ? " vector" : " strided") +
               (strided ? " strided-input" : ""));
  const int64_t B = 2, Hq = 3, Hk = 1, S = 5, D = 48, R = 32, L = 24;
  at::manual_seed(7);
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor q = strided ? at::randn({B, Hq, S, D, 2}, opts).select(4, 1) : at::randn({B, Hq, S, D}, opts);
  at::Tensor k = at::randn({B, Hk, S, D}, opts);
  std::vector<int64_t> axes;
  // Pair groups on one axis (0, then 2) and groups that mix axes 1 and 2.
  for (int64_t j = 0; j < R / 2; ++j) axes.push_back(nd ? (j < 8 ? 0 : j < 12 ? 2 : 1 + j % 2) : 0);
  const int64_t n_axes = nd ? 3 : 1;
  const auto ids = at::randint(0, L, {n_axes, B, S}, at::kLong);
  const auto freqs = at::polar(
      at::ones({L, R / 2}, at::kDouble),
      at::outer(at::arange(L, at::kDouble), at::pow(10000.0, -at::arange(0, R, 2, at::kDouble) / R))).to(at::kComplexFloat);
  const std::optional<at::Tensor> none, pid = ids;
  const rotary::detail::RopeArgs args{0, interleaved, none, pid, false, none, none, "BHSD", offset, axes};
  auto prepared = rotary::detail::prepare_rope("apply_rope_qk", q, &k, freqs, args, /*in_place=*/false);
  prepared.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
  prepared.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "emulate", [&] {
    using T = typename rotary::cuda::CudaType<scalar_t>::type;
    const bool aligned = !strided && offset % 8 == 0;
    ASSERT_EQ(rotary::kernel::can_vectorize<T>(prepared.params), aligned) << "the vector path needs an aligned span";
    emulate_path<T>(prepared.params, vectorized && aligned);
  });
  const double tol = dtype == at::kBFloat16 ? 3e-2 : dtype == at::kHalf ? 4e-3 : 2e-5;
  for (auto [out, in] : {std::pair{prepared.out_q, q}, std::pair{prepared.out_k, k}}) {
    const auto expected = reference_nd(in, ids, axes, R, offset, interleaved);
    EXPECT_TRUE(at::allclose(out.to(at::kDouble), expected, tol, tol)) << (out.to(at::kDouble) - expected).abs().max();
  }
}

TEST(CudaEmulationNd, OffsetSpanAndPairAxes) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (bool interleaved : {true, false}) {
      for (int64_t offset : {0, 8, 16, 6}) {
        for (bool nd : {false, true}) {
          for (bool strided : {false, true}) {
            // fp64 vectors hold 2 elements: an offset of 6 is still aligned.
            if (dtype == at::kDouble && offset == 6) continue;
            run(dtype, interleaved, offset, nd, /*vectorized=*/true, strided);
            run(dtype, interleaved, offset, nd, /*vectorized=*/false, strided);
          }
        }
      }
    }
  }
}

}  // namespace

#endif  // ROTARY_EMULATION
