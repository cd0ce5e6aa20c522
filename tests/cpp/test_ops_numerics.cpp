// Numerical tests of the functional API (rotary::apply_rope,
// rotary::apply_rope_qk, rotary::rope_freqs) against the float64 reference:
// the harness's own teeth, dtype x pairing x head_dim, non-contiguous
// inputs, strided and offset freqs tables, meta tensors, the rope_freqs
// table itself and every device. Split by concern, to be read in one
// sitting: start_pos, edge sizes, offsets and position_ids are in
// test_ops_positions.cpp, inverse and conjugated tables in
// test_ops_inverse.cpp.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using rotary_test::AllClose;
using rotary_test::dtype_name;
using rotary_test::poison_like;
using rotary_test::ref_rope;
using rotary_test::Seeded;
using rotary_test::tolerance_for;

using rotary_test::kF64;

using rotary_test::randn;

// ---------------------------------------------------------------------------
// The harness has teeth: the comparison rejects the wrong convention, an
// off-by-one position, the inverse rotation and unwritten (NaN) elements.

TEST_F(Seeded, ComparisonRejectsWrongResults) {
  const int64_t D = 16;
  const auto freqs = rotary::rope_freqs(D, 16);
  const auto x = randn({1, 2, 3, D}, at::kDouble);
  const auto y = rotary::apply_rope(x, freqs, 2, true);
  ASSERT_TRUE(AllClose(y, ref_rope(x, 2, true), kF64));
  EXPECT_FALSE(AllClose(y, ref_rope(x, 2, false), kF64));
  EXPECT_FALSE(AllClose(y, ref_rope(x, 3, true), kF64));
  EXPECT_FALSE(AllClose(y, ref_rope(x, 2, true, std::nullopt, true), kF64));
  auto holed = y.clone();
  holed[0][1][2][5] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(AllClose(holed, ref_rope(x, 2, true), kF64));
  // fp16 rounding is visible at fp32 tolerance, so the 16-bit tolerances are
  // not vacuous either.
  const auto xh = randn({1, 2, 3, D}, at::kHalf);
  EXPECT_FALSE(AllClose(ref_rope(xh, 2).to(at::kHalf), ref_rope(xh, 2), {1e-6, 0.0}));
  EXPECT_TRUE(AllClose(ref_rope(xh, 2).to(at::kHalf), ref_rope(xh, 2), tolerance_for(at::kHalf)));
}

// ---------------------------------------------------------------------------
// dtype x pairing x head_dim against the reference.

using NumericsCase = std::tuple<at::ScalarType, bool, int64_t>;

class RopeNumerics : public ::testing::TestWithParam<NumericsCase> {
 protected:
  void SetUp() override { at::manual_seed(1234); }
};

TEST_P(RopeNumerics, ApplyRopeMatchesReference) {
  const auto [dtype, interleaved, D] = GetParam();
  const int64_t B = 2, H = 3, S = 7, L = 64, start = 5;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto x = randn({B, H, S, D}, dtype);
  const auto x_before = x.clone();
  poison_like(x);
  const auto y = rotary::apply_rope(x, freqs, start, interleaved);
  EXPECT_EQ(y.scalar_type(), dtype);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_TRUE(AllClose(y, ref_rope(x, start, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(x, x_before)) << "input was modified";
}

TEST_P(RopeNumerics, ApplyRopeQkMatchesReference) {
  const auto [dtype, interleaved, D] = GetParam();
  const int64_t B = 2, Hq = 4, Hk = 2, S = 5, L = 32, start = 3;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({B, Hq, S, D}, dtype);
  const auto k = randn({B, Hk, S, D}, dtype);
  const auto q_before = q.clone();
  const auto k_before = k.clone();
  poison_like(q);
  poison_like(k);
  const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, start, interleaved);
  EXPECT_EQ(yq.scalar_type(), dtype);
  EXPECT_EQ(yk.scalar_type(), dtype);
  EXPECT_TRUE(AllClose(yq, ref_rope(q, start, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(AllClose(yk, ref_rope(k, start, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(q, q_before));
  EXPECT_TRUE(at::equal(k, k_before));
  // One fused launch computes exactly what two single-tensor calls do.
  EXPECT_TRUE(at::equal(yq, rotary::apply_rope(q, freqs, start, interleaved)));
  EXPECT_TRUE(at::equal(yk, rotary::apply_rope(k, freqs, start, interleaved)));
}

// 2 and 6: only the scalar tail; 20 (10 pairs) and 36 (18 pairs): vector
// body plus a tail; 64, 80, 128: typical head sizes.
INSTANTIATE_TEST_SUITE_P(
    AllDtypes,
    RopeNumerics,
    ::testing::Combine(
        ::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16),
        ::testing::Bool(),
        ::testing::Values<int64_t>(2, 6, 20, 36, 64, 80, 128)),
    [](const ::testing::TestParamInfo<NumericsCase>& info) {
      return dtype_name(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_interleaved" : "_half") +
          "_d" + std::to_string(std::get<2>(info.param));
    });

// ---------------------------------------------------------------------------
// Non-contiguous inputs: outputs match the reference, inputs are untouched.

using LayoutCase = std::tuple<at::ScalarType, bool>;

class RopeLayouts : public ::testing::TestWithParam<LayoutCase> {
 protected:
  void SetUp() override { at::manual_seed(99); }
};

TEST_P(RopeLayouts, TransposedBshdInput) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, S = 6, H = 3, D = 40;
  const auto base = randn({B, S, H, D}, dtype);  // [B, S, H, D], the usual projection layout
  const auto base_before = base.clone();
  const auto x = base.transpose(1, 2);  // [B, H, S, D] view
  ASSERT_FALSE(x.is_contiguous());
  const auto freqs = rotary::rope_freqs(D, 16);
  const auto y = rotary::apply_rope(x, freqs, 2, interleaved);
  EXPECT_TRUE(AllClose(y, ref_rope(x, 2, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(base, base_before));
}

TEST_P(RopeLayouts, PackedQkvSlices) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, S = 5, Hq = 4, Hk = 2, D = 36;
  const auto qkv = randn({B, S, Hq + 2 * Hk, D}, dtype);
  const auto qkv_before = qkv.clone();
  const auto q = qkv.narrow(2, 0, Hq).transpose(1, 2);
  const auto k = qkv.narrow(2, Hq, Hk).transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  ASSERT_FALSE(k.is_contiguous());
  const auto freqs = rotary::rope_freqs(D, 32);
  const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 7, interleaved);
  EXPECT_TRUE(AllClose(yq, ref_rope(q, 7, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(AllClose(yk, ref_rope(k, 7, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(qkv, qkv_before)) << "q, k or v inside the packed tensor were modified";
}

TEST_P(RopeLayouts, LastDimStrided) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, H = 3, S = 4, D = 12;
  const auto wide = randn({B, H, S, D, 2}, dtype);
  const auto wide_before = wide.clone();
  const auto x = wide.select(-1, 0);  // last-dim stride 2
  ASSERT_EQ(x.stride(3), 2);
  const auto freqs = rotary::rope_freqs(D, 8);
  poison_like(x);
  const auto y = rotary::apply_rope(x, freqs, 1, interleaved);
  EXPECT_TRUE(AllClose(y, ref_rope(x, 1, interleaved), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(wide, wide_before));
}

TEST_P(RopeLayouts, LastDimTransposed) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 1, H = 2, S = 9, D = 10;
  const auto base = randn({B, H, D, S}, dtype);
  const auto base_before = base.clone();
  const auto x = base.transpose(2, 3);  // dense, but head_dim has stride S
  ASSERT_EQ(x.stride(3), S);
  const auto freqs = rotary::rope_freqs(D, 16);
  const auto [yq, yk] = rotary::apply_rope_qk(x, x, freqs, 0, interleaved);
  const auto expected = ref_rope(x, 0, interleaved);
  EXPECT_TRUE(AllClose(yq, expected, tolerance_for(dtype)));
  EXPECT_TRUE(AllClose(yk, expected, tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(base, base_before));
}

TEST_P(RopeLayouts, ExpandedStrideZeroInput) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, H = 4, S = 3, D = 8;
  const auto one_head = randn({B, 1, S, D}, dtype);
  const auto x = one_head.expand({B, H, S, D});  // stride 0 over heads (as autograd's sum() grads are)
  const auto freqs = rotary::rope_freqs(D, 8);
  const auto y = rotary::apply_rope(x, freqs, 2, interleaved);
  EXPECT_TRUE(AllClose(y, ref_rope(x, 2, interleaved), tolerance_for(dtype)));
  // Every head received its own, fully written, output row.
  EXPECT_TRUE(at::equal(y.select(1, 0), y.select(1, H - 1)));
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes,
    RopeLayouts,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16), ::testing::Bool()),
    [](const ::testing::TestParamInfo<LayoutCase>& info) {
      return dtype_name(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_interleaved" : "_half");
    });

// ---------------------------------------------------------------------------
// The freqs table itself may be a strided or offset view.

TEST_F(Seeded, FreqsTransposedLayout) {
  const int64_t D = 16, L = 12;
  const auto table = rotary::rope_freqs(D, L);
  const auto freqs = table.t().contiguous().t();  // same values, stride (1, L)
  ASSERT_FALSE(freqs.is_contiguous());
  const auto x = randn({2, 2, 5, D}, at::kDouble);
  for (bool interleaved : {true, false}) {
    const auto y = rotary::apply_rope(x, freqs, 4, interleaved);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 4, interleaved), kF64));
  }
}

TEST_F(Seeded, FreqsRowSliceHasStorageOffset) {
  const int64_t D = 8, L = 20;
  const auto freqs = rotary::rope_freqs(D, L).slice(0, 6);  // rows 6 .. 19
  ASSERT_GT(freqs.storage_offset(), 0);
  const auto x = randn({1, 3, 4, D}, at::kDouble);
  const auto y = rotary::apply_rope(x, freqs, 2);
  EXPECT_TRUE(AllClose(y, ref_rope(x, 6 + 2), kF64));
}

TEST_F(Seeded, CustomThetaTable) {
  const int64_t D = 64;
  const double theta = 500000.0;
  const auto freqs = rotary::rope_freqs(D, 128, theta);
  const auto x = randn({1, 2, 9, D}, at::kDouble);
  for (bool interleaved : {true, false}) {
    const auto y = rotary::apply_rope(x, freqs, 100, interleaved);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 100, interleaved, std::nullopt, false, theta), kF64));
  }
}

// ---------------------------------------------------------------------------
// Meta tensors: shapes only, no data.

TEST_F(Seeded, MetaTensorsGiveShapesAndDtypes) {
  const auto freqs = rotary::rope_freqs(16, 32).to(at::kMeta);
  const auto q = at::empty({2, 8, 5, 16}, at::TensorOptions().dtype(at::kHalf).device(at::kMeta));
  const auto k = at::empty({2, 2, 5, 16}, at::TensorOptions().dtype(at::kHalf).device(at::kMeta));
  const auto y = rotary::apply_rope(q, freqs, 3);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), q.sizes());
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 3, false);
  EXPECT_EQ(yq.sizes(), q.sizes());
  EXPECT_EQ(yk.sizes(), k.sizes());
  EXPECT_TRUE(yk.is_meta());
}

// ---------------------------------------------------------------------------
// rope_freqs: complex64 [L, D/2] holding exp(i pos theta_j).

TEST(RopeFreqs, MatchesDoublePrecisionTable) {
  for (const auto& [D, L, theta] : std::vector<std::tuple<int64_t, int64_t, double>>{
           {2, 5, 10000.0}, {64, 4096, 10000.0}, {80, 300, 500000.0}, {6, 17, 2.0}}) {
    const auto f = rotary::rope_freqs(D, L, theta);
    ASSERT_EQ(f.scalar_type(), at::kComplexFloat);
    ASSERT_EQ(f.sizes(), at::IntArrayRef({L, D / 2}));
    const auto re = at::real(f).to(at::kDouble).contiguous();
    const auto im = at::imag(f).to(at::kDouble).contiguous();
    auto re_a = re.accessor<double, 2>();
    auto im_a = im.accessor<double, 2>();
    double worst = 0.0;
    for (int64_t p = 0; p < L; ++p) {
      for (int64_t j = 0; j < D / 2; ++j) {
        const auto e = rotary_test::ref_freq(p, j, D, theta);
        worst = std::max({worst, std::abs(re_a[p][j] - e.real()), std::abs(im_a[p][j] - e.imag())});
      }
    }
    EXPECT_LE(worst, 1e-7) << "D " << D << " L " << L << " theta " << theta;
  }
  EXPECT_EQ(rotary::rope_freqs(8, 0).sizes(), at::IntArrayRef({0, 4}));
}

// ---- every device: the same checks on the CPU and on CUDA

class OpsOnDevice : public rotary_test::OnDevice {};

double device_tol(at::ScalarType dtype) {
  return dtype == at::kFloat ? 2e-5 : dtype == at::kDouble ? 2e-6 : dtype == at::kHalf ? 4e-3 : 3e-2;
}

TEST_P(OpsOnDevice, MatchesReferenceAcrossDtypesLayoutsAndPairings) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (int64_t d : {64, 80, 128, 256}) {
      for (bool interleaved : {true, false}) {
        for (bool packed : {false, true}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + " D=" + std::to_string(d) +
                       (interleaved ? " interleaved" : " half") + (packed ? " packed qkv" : " contiguous"));
          at::Tensor q, k;
          if (packed) {
            auto qkv = at::randn({2, 9, 5 + 2 * 3, d}, on(dtype)).transpose(1, 2);
            q = qkv.narrow(1, 0, 5);
            k = qkv.narrow(1, 5, 3);
          } else {
            q = at::randn({2, 5, 9, d}, on(dtype));
            k = at::randn({2, 3, 9, d}, on(dtype));
          }
          auto freqs = rotary::rope_freqs(d, 64).to(GetParam());
          auto [oq, ok] = rotary::apply_rope_qk(q, k, freqs, 17, interleaved);
          const double t = device_tol(dtype);
          EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), rotary_test::ref_rope(q, 17, interleaved), t, t));
          EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), rotary_test::ref_rope(k, 17, interleaved), t, t));
          if (GetParam() == c10::kCPU) continue;  // next to the CPU kernel: one rounding apart
          auto [cq, ck] = rotary::apply_rope_qk(q.cpu(), k.cpu(), freqs.cpu(), 17, interleaved);
          EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), cq.to(at::kDouble), t, t));
          EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), ck.to(at::kDouble), t, t));
        }
      }
    }
  }
}

TEST_P(OpsOnDevice, DecodeWithDevicePositions) {
  auto q = at::randn({4, 8, 1, 128}, on(at::kBFloat16));
  auto k = at::randn({4, 2, 1, 128}, on(at::kBFloat16));
  auto freqs = rotary::rope_freqs(128, 256).to(GetParam());
  auto offsets = at::tensor({int64_t{3}, int64_t{40}, int64_t{100}, int64_t{7}}).to(GetParam());
  auto [oq, ok] = rotary::apply_rope_qk(q, k, freqs, 1, true, offsets);
  EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), rotary_test::ref_rope(q, 1, true, offsets), 3e-2, 3e-2));
  EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), rotary_test::ref_rope(k, 1, true, offsets), 3e-2, 3e-2));
}

ROTARY_ON_DEVICES(OpsOnDevice);

}  // namespace
