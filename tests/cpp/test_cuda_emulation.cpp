// Host emulation of the CUDA kernel: runs rope_thread, the exact per-thread
// body of the GPU kernel, over its whole grid on the CPU and compares with the
// float64 reference. Checks the CUDA indexing, vector path and fallbacks in CI,
// where there is no GPU.
#ifdef ROTARY_WITH_CUDA

#include "checks.h"
#include "cuda/rope_kernel.cuh"
#include "reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>

namespace {

using rotary::kernel::Grid;
using rotary::kernel::RopeParams;

template <typename T, bool kInterleaved, bool kVectorized>
void emulate_grid(const RopeParams& p, int64_t heads_per_thread) {
  const Grid g = rotary::kernel::make_grid<T, kInterleaved, kVectorized>(p, heads_per_thread);
  for (int64_t t = 0; t < g.threads; ++t) rotary::kernel::rope_thread<T, kInterleaved, kVectorized>(p, g, t);
}

template <typename T>
void emulate(const RopeParams& p, bool vectorized, int64_t heads_per_thread) {
  if (p.interleaved) {
    vectorized ? emulate_grid<T, true, true>(p, heads_per_thread)
               : emulate_grid<T, true, false>(p, heads_per_thread);
  } else {
    vectorized ? emulate_grid<T, false, true>(p, heads_per_thread)
               : emulate_grid<T, false, false>(p, heads_per_thread);
  }
}

enum class Layout { kContiguous, kTransposed, kPackedQkv, kMisaligned, kStridedLastDim };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kTransposed: return "transposed";
    case Layout::kPackedQkv: return "packed_qkv";
    case Layout::kMisaligned: return "misaligned";
    case Layout::kStridedLastDim: return "strided_last_dim";
  }
  return "?";
}

// q [B, Hq, S, D] and k [B, Hk, S, D] laid out as asked, filled with randn.
std::pair<at::Tensor, at::Tensor> make_qk(
    Layout layout, int64_t B, int64_t Hq, int64_t Hk, int64_t S, int64_t D, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  switch (layout) {
    case Layout::kContiguous:
      return {at::randn({B, Hq, S, D}, opts), at::randn({B, Hk, S, D}, opts)};
    case Layout::kTransposed:
      return {at::randn({B, S, Hq, D}, opts).transpose(1, 2), at::randn({B, S, Hk, D}, opts).transpose(1, 2)};
    case Layout::kPackedQkv: {
      auto qkv = at::randn({B, S, Hq + 2 * Hk, D}, opts).transpose(1, 2);
      return {qkv.narrow(1, 0, Hq), qkv.narrow(1, Hq, Hk)};
    }
    case Layout::kMisaligned: {
      // One element past an aligned base, so no row start is 16-byte aligned.
      auto flat_q = at::randn({B * Hq * S * D + 1}, opts);
      auto flat_k = at::randn({B * Hk * S * D + 1}, opts);
      return {flat_q.narrow(0, 1, B * Hq * S * D).view({B, Hq, S, D}),
              flat_k.narrow(0, 1, B * Hk * S * D).view({B, Hk, S, D})};
    }
    case Layout::kStridedLastDim:
      return {at::randn({B, Hq, S, D, 2}, opts).select(4, 1), at::randn({B, Hk, S, D, 2}, opts).select(4, 0)};
  }
  return {};
}

double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 2e-5;
    case at::kDouble: return 2e-6;  // the table is complex64
    case at::kHalf: return 4e-3;
    default: return 3e-2;           // bfloat16: one rounding of values up to ~4
  }
}

struct Case {
  at::ScalarType dtype;
  int64_t head_dim;
  int64_t hq, hk;
  int64_t seq;
  int64_t start_pos;
  bool interleaved;
  Layout layout;
  int positions_rank;  // -1: none; 0, 1, 2
  bool inverse;
  int64_t rotary_dim = 0;  // 0: head_dim
  bool in_place = false;
};

using Opt = std::optional<at::Tensor>;

// Table from the reference formula, not from the library.
at::Tensor reference_table(int64_t len, int64_t rotary_dim) {
  auto freqs = at::empty({len, rotary_dim / 2}, at::kComplexFloat);
  auto* f = freqs.data_ptr<c10::complex<float>>();
  for (int64_t pos = 0; pos < len; ++pos) {
    for (int64_t j = 0; j < rotary_dim / 2; ++j) {
      const auto e = rotary_test::ref_freq(pos, j, rotary_dim);
      f[pos * (rotary_dim / 2) + j] = {static_cast<float>(e.real()), static_cast<float>(e.imag())};
    }
  }
  return freqs;
}

// Reference with partial rotary: dims past rotary_dim are copied.
at::Tensor reference_partial(
    const at::Tensor& x, int64_t rotary_dim, int64_t start, bool interleaved, const Opt& positions, bool inverse) {
  const auto rotated = rotary_test::ref_rope(x.narrow(3, 0, rotary_dim), start, interleaved, positions, inverse);
  return at::cat({rotated, x.narrow(3, rotary_dim, x.size(3) - rotary_dim).to(at::kDouble).cpu()}, 3);
}

// Runs the emulated grid of the CUDA kernel for dtype over p.
void emulate_dtype(at::ScalarType dtype, const RopeParams& p, bool vectorized, int64_t heads_per_thread) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "emulate", [&] {
    using T = std::conditional_t<
        std::is_same_v<scalar_t, at::Half>, __half,
        std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, __nv_bfloat16, scalar_t>>;
    emulate<T>(p, vectorized, heads_per_thread);
  });
}

bool vectorizable(at::ScalarType dtype, const RopeParams& p) {
  bool result = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "vectorizable", [&] {
    using T = std::conditional_t<
        std::is_same_v<scalar_t, at::Half>, __half,
        std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, __nv_bfloat16, scalar_t>>;
    result = rotary::kernel::can_vectorize<T>(p);
  });
  return result;
}

std::string describe(const Case& c) {
  return std::string(c10::toString(c.dtype)) + " D=" + std::to_string(c.head_dim) + " Hq=" +
      std::to_string(c.hq) + " Hk=" + std::to_string(c.hk) + " S=" + std::to_string(c.seq) + " start=" +
      std::to_string(c.start_pos) + (c.interleaved ? " interleaved " : " half ") + layout_name(c.layout) +
      " positions_rank=" + std::to_string(c.positions_rank) + (c.inverse ? " inverse" : "") + " rotary_dim=" +
      std::to_string(c.rotary_dim) + (c.in_place ? " in place" : "");
}

// Runs one case through the emulated grid (vector path when allowed, and the
// strided path always) and checks every output element against the reference.
void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const int64_t B = 2;
  const int64_t table_len = c.start_pos + c.seq + 8;
  const uint64_t seed = static_cast<uint64_t>(at::randint(1, int64_t{1} << 40, {1}, at::kLong).item<int64_t>());
  at::manual_seed(seed);
  auto [q, k] = make_qk(c.layout, B, c.hq, c.hk, c.seq, c.head_dim, c.dtype);
  const auto q_before = q.clone();
  const auto k_before = k.clone();

  std::optional<at::Tensor> positions;
  if (c.positions_rank == 0) positions = at::tensor(int64_t{3});
  if (c.positions_rank == 1) positions = at::randint(0, 8, {B}, at::kLong);
  if (c.positions_rank == 2) positions = at::randint(0, c.start_pos + c.seq, {B, c.seq}, at::kLong);

  const int64_t rotary_dim = c.rotary_dim ? c.rotary_dim : c.head_dim;
  const auto freqs = reference_table(table_len, rotary_dim);
  const auto expected_q = reference_partial(q, rotary_dim, c.start_pos, c.interleaved, positions, c.inverse);
  const auto expected_k = reference_partial(k, rotary_dim, c.start_pos, c.interleaved, positions, c.inverse);
  const Opt none;
  const rotary::detail::RopeArgs args{c.start_pos, c.interleaved, positions, c.inverse, none, none, "BHSD"};

  for (bool try_vector : {true, false}) {
    // In place, each pass rotates a fresh copy of the inputs in the same layout.
    at::Tensor q_run = q, k_run = k;
    if (c.in_place) {
      at::manual_seed(seed);
      std::tie(q_run, k_run) = make_qk(c.layout, B, c.hq, c.hk, c.seq, c.head_dim, c.dtype);
    }
    auto prepared = rotary::detail::prepare_rope("emulate", q_run, &k_run, freqs, args, c.in_place);
    if (!c.in_place) {
      prepared.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
      prepared.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    const auto& p = prepared.params;
    const bool can_vector = vectorizable(c.dtype, p);
    if (c.layout == Layout::kMisaligned || c.layout == Layout::kStridedLastDim) {
      EXPECT_FALSE(can_vector) << "vector path must fall back";
    }
    if (c.layout == Layout::kContiguous && c.head_dim % 32 == 0 && rotary_dim % 32 == 0) {
      EXPECT_TRUE(can_vector) << "aligned contiguous input should take the vector path";
    }
    const bool vectorized = try_vector && can_vector;
    emulate_dtype(c.dtype, p, vectorized, /*heads_per_thread=*/3);
    SCOPED_TRACE(vectorized ? "vector path" : "strided path");
    const double tol = tolerance(c.dtype);
    EXPECT_TRUE(at::allclose(prepared.out_q.to(at::kDouble), expected_q, tol, tol));
    EXPECT_TRUE(at::allclose(prepared.out_k.to(at::kDouble), expected_k, tol, tol));
    EXPECT_FALSE(prepared.out_q.isnan().any().item<bool>()) << "unwritten q element";
    EXPECT_FALSE(prepared.out_k.isnan().any().item<bool>()) << "unwritten k element";
    if (!try_vector) break;
  }
  EXPECT_TRUE(at::equal(q, q_before));
  EXPECT_TRUE(at::equal(k, k_before));
}

TEST(CudaEmulation, HeadDimsDtypesPairings) {
  at::manual_seed(11);
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (int64_t d : {64, 80, 128, 256}) {
      for (bool interleaved : {true, false}) {
        run_case({dtype, d, 3, 1, 5, 0, interleaved, Layout::kContiguous, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, LayoutsFallBackWithoutCopies) {
  at::manual_seed(12);
  for (auto layout : {Layout::kTransposed, Layout::kPackedQkv, Layout::kMisaligned, Layout::kStridedLastDim}) {
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
      for (bool interleaved : {true, false}) {
        run_case({dtype, 64, 4, 2, 3, 2, interleaved, layout, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, HeadCountsDecodeAndStartPos) {
  at::manual_seed(13);
  for (auto [hq, hk] : {std::pair<int64_t, int64_t>{1, 1}, {5, 5}, {7, 1}, {8, 3}}) {
    for (int64_t seq : {1, 6}) {
      for (int64_t start : {0, 37}) {
        run_case({at::kBFloat16, 128, hq, hk, seq, start, hq % 2 == 1, Layout::kContiguous, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, PositionsAndInverse) {
  at::manual_seed(14);
  for (int rank : {0, 1, 2}) {
    for (bool inverse : {false, true}) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        run_case({dtype, 80, 3, 2, 4, 5, rank != 1, Layout::kContiguous, rank, inverse});
      }
    }
  }
}

TEST(CudaEmulation, PositionOutsideTableYieldsNanWithoutReading) {
  at::manual_seed(15);
  auto q = at::randn({1, 2, 3, 8});
  auto k = at::randn({1, 1, 3, 8});
  auto freqs = at::randn({4, 4}, at::kComplexFloat);
  Opt positions = at::tensor({int64_t{0}, int64_t{1}, int64_t{2}}).view({1, 3});
  const Opt none;
  const rotary::detail::RopeArgs args{0, true, positions, false, none, none, "BHSD"};
  auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
  // Device-side positions are not checked on the host; emulate one that is
  // past the end (and one negative) the way the GPU would see it.
  std::vector<int64_t> bad = {1, 1000000, -5};
  auto p = prepared.params;
  p.positions = bad.data();
  emulate<float>(p, false, 1);
  auto out = prepared.out_q;
  EXPECT_FALSE(out.select(2, 0).isnan().any().item<bool>());
  EXPECT_TRUE(out.select(2, 1).isnan().all().item<bool>());
  EXPECT_TRUE(out.select(2, 2).isnan().all().item<bool>());
}

TEST(CudaEmulation, PartialRotaryAndInPlace) {
  at::manual_seed(16);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool interleaved : {true, false}) {
      for (bool in_place : {false, true}) {
        for (auto layout : {Layout::kContiguous, Layout::kPackedQkv, Layout::kStridedLastDim}) {
          // 64 of 128 dims rotated (vector path with a copied tail), and 32 of 80.
          run_case({dtype, 128, 4, 2, 3, 7, interleaved, layout, -1, false, 64, in_place});
          run_case({dtype, 80, 3, 1, 2, 0, interleaved, layout, 1, true, 32, in_place});
        }
      }
    }
  }
}

TEST(CudaEmulation, PositionsPastTableUseInvFreq) {
  at::manual_seed(17);
  const int64_t D = 64;
  auto q = at::randn({2, 3, 4, D});
  auto k = at::randn({2, 1, 4, D});
  auto inv_freq = at::empty({D / 2}, at::kDouble);
  for (int64_t j = 0; j < D / 2; ++j) inv_freq[j] = rotary_test::ref_inv_freq(j, D);
  const auto freqs = reference_table(8, D);  // far shorter than the positions used
  const Opt positions = at::tensor({int64_t{5}, int64_t{100000}});
  const Opt none;
  const rotary::detail::RopeArgs args{3, true, positions, false, none, Opt(inv_freq), "BHSD"};
  auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
  emulate_dtype(at::kFloat, prepared.params, true, 2);
  EXPECT_TRUE(at::allclose(prepared.out_q.to(at::kDouble), rotary_test::ref_rope(q, 3, true, positions), 2e-5, 2e-5));
  EXPECT_TRUE(at::allclose(prepared.out_k.to(at::kDouble), rotary_test::ref_rope(k, 3, true, positions), 2e-5, 2e-5));
}

TEST(CudaEmulation, PackedVarlen) {
  at::manual_seed(18);
  const int64_t D = 64, T = 11;
  for (auto cu_dtype : {at::kInt, at::kLong}) {
    for (bool interleaved : {true, false}) {
      auto q = at::randn({T, 4, D}, at::kBFloat16);
      auto k = at::randn({T, 2, D}, at::kBFloat16);
      const auto cu = at::tensor({int64_t{0}, int64_t{3}, int64_t{3}, int64_t{10}, int64_t{11}}).to(cu_dtype);
      const auto freqs = reference_table(32, D);
      const Opt none;
      const Opt cu_opt(cu);
      const rotary::detail::RopeArgs args{2, interleaved, none, false, cu_opt, none, "THD"};
      auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
      emulate_dtype(at::kBFloat16, prepared.params, true, 4);
      // Reference: each sequence on its own, starting at start_pos.
      for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 3}, {3, 10}, {10, 11}}) {
        for (const auto& [in, out] : {std::pair{q, prepared.out_q}, std::pair{k, prepared.out_k}}) {
          const auto seq_in = in.narrow(0, begin, end - begin).transpose(0, 1).unsqueeze(0);
          const auto expected = rotary_test::ref_rope(seq_in, 2, interleaved)[0].transpose(0, 1);
          EXPECT_TRUE(at::allclose(out.narrow(0, begin, end - begin).to(at::kDouble), expected, 3e-2, 3e-2));
        }
      }
    }
  }
}

}  // namespace

#endif  // ROTARY_WITH_CUDA
