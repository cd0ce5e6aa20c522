// RoPE variants from C++ (rotary::apply_rope*, rotary::sinusoidal_table,
// rotary::alibi_*) against the float64 reference of reference.h:
//   layouts    "BSHD" / "SBHD" are views of the reference's [B, H, S, D];
//   partial    the reference on x.narrow(-1, 0, r) (a head of size r) plus
//              the tail copied unchanged;
//   varlen     the reference run on each sequence of the packed batch alone.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using rotary_test::AllClose;
using rotary_test::dtype_name;
using rotary_test::ExpectError;
using rotary_test::poison_like;
using rotary_test::ref_rope;
using rotary_test::Tolerance;
using rotary_test::tolerance_for;

using OptTensor = std::optional<at::Tensor>;

constexpr Tolerance kF64{1e-6, 0.0};

at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype = at::kFloat) {
  return at::randn(sizes, at::kFloat).to(dtype);
}

at::Tensor longs(const std::vector<int64_t>& v) {
  return at::tensor(v, at::kLong);
}

at::Tensor cu_from_lens(const std::vector<int64_t>& lens, at::ScalarType dtype = at::kLong) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return at::tensor(cu, at::kLong).to(dtype);
}

std::vector<int64_t> shape_in(const std::string& layout, int64_t B, int64_t H, int64_t S, int64_t D) {
  if (layout == "BSHD") return {B, S, H, D};
  if (layout == "SBHD") return {S, B, H, D};
  return {B, H, S, D};
}

at::Tensor to_bhsd(const at::Tensor& x, const std::string& layout) {
  if (layout == "BSHD") return x.transpose(1, 2);
  if (layout == "SBHD") return x.permute({1, 2, 0, 3});
  return x;
}

at::Tensor from_bhsd(const at::Tensor& x, const std::string& layout) {
  if (layout == "BSHD") return x.transpose(1, 2);
  if (layout == "SBHD") return x.permute({2, 0, 1, 3});
  return x;
}

// Reference of a 4-D input in `layout`: dims [0, r) rotated as a head of
// size r, dims [r, D) copied.
at::Tensor ref_partial(
    const at::Tensor& x, int64_t r, int64_t start = 0, bool interleaved = true, const OptTensor& positions = {},
    bool inverse = false, const std::string& layout = "BHSD") {
  const at::Tensor xb = to_bhsd(x, layout);
  const int64_t D = xb.size(3);
  const at::Tensor rot = ref_rope(xb.narrow(3, 0, r), start, interleaved, positions, inverse);
  const at::Tensor tail = xb.narrow(3, r, D - r).to(at::kCPU).to(at::kDouble);
  return from_bhsd(at::cat({rot, tail}, 3), layout);
}

// Reference of a packed [T, H, D] batch: each sequence on its own.
// positions: none, a 0-d offset or [T] absolute ids.
at::Tensor ref_varlen(
    const at::Tensor& x, const at::Tensor& cu, int64_t r, int64_t start = 0, bool interleaved = true,
    const OptTensor& positions = {}, bool inverse = false) {
  const at::Tensor bounds = cu.to(at::kLong).contiguous();
  std::vector<at::Tensor> parts{at::empty({0, x.size(1), x.size(2)}, at::kDouble)};
  for (int64_t n = 0; n + 1 < bounds.numel(); ++n) {
    const int64_t a = bounds[n].item<int64_t>(), b = bounds[n + 1].item<int64_t>();
    const at::Tensor seg = x.slice(0, a, b).permute({1, 0, 2}).unsqueeze(0);  // [1, H, len, D]
    int64_t st = start;
    OptTensor pos;
    if (positions && positions->dim() == 0) {
      st += positions->item<int64_t>();
    } else if (positions) {
      pos = positions->slice(0, a, b).unsqueeze(0);  // [1, len] ids
    }
    parts.push_back(ref_partial(seg, r, st, interleaved, pos, inverse)[0].permute({1, 0, 2}));
  }
  return at::cat(parts, 0);
}

at::Tensor inv_freq_f64(int64_t r) {
  std::vector<double> v;
  for (int64_t j = 0; j < r / 2; ++j) v.push_back(rotary_test::ref_inv_freq(j, r));
  return at::tensor(v, at::kDouble);
}

using DtypeCase = std::tuple<at::ScalarType, bool>;

std::string case_name(const ::testing::TestParamInfo<DtypeCase>& info) {
  return dtype_name(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_interleaved" : "_half");
}

class Variants : public ::testing::TestWithParam<DtypeCase> {
 protected:
  void SetUp() override { at::manual_seed(4242); }
};

// ---------------------------------------------------------------------------
// Layouts

TEST_P(Variants, LayoutsMatchReference) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, Hq = 4, Hk = 2, S = 5, D = 20, start = 3;
  const auto freqs = rotary::rope_freqs(D, 32);
  for (const std::string layout : {"BHSD", "BSHD", "SBHD"}) {
    const auto q = randn(shape_in(layout, B, Hq, S, D), dtype);
    const auto k = randn(shape_in(layout, B, Hk, S, D), dtype);
    const auto q_before = q.clone();
    poison_like(q);
    const auto y = rotary::apply_rope(q, freqs, start, interleaved, std::nullopt, false, std::nullopt, std::nullopt, layout);
    const auto [yq, yk] =
        rotary::apply_rope_qk(q, k, freqs, start, interleaved, std::nullopt, false, std::nullopt, std::nullopt, layout);
    EXPECT_TRUE(AllClose(y, ref_partial(q, D, start, interleaved, {}, false, layout), tolerance_for(dtype))) << layout;
    EXPECT_TRUE(AllClose(yk, ref_partial(k, D, start, interleaved, {}, false, layout), tolerance_for(dtype))) << layout;
    EXPECT_TRUE(at::equal(yq, y)) << layout;
    EXPECT_EQ(y.strides(), q.strides()) << "the output keeps the input's layout (" << layout << ")";
    EXPECT_TRUE(at::equal(q, q_before));
    // The layout name only picks the view: the BHSD call on it gives the same bits.
    EXPECT_TRUE(at::equal(to_bhsd(y, layout), rotary::apply_rope(to_bhsd(q, layout), freqs, start, interleaved)));
  }
}

TEST_P(Variants, LayoutsWithPositionsAndPartialRotary) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 3, H = 2, S = 4, D = 12, r = 8, L = 40, start = 2;
  const auto freqs = rotary::rope_freqs(r, L);
  const std::vector<OptTensor> forms = {
      std::nullopt, at::scalar_tensor(5, at::kLong), longs({0, 20, 3}), longs({11}),
      at::randint(0, L - start, {B, S}, at::kLong), at::randint(0, L - start, {1, S}, at::kLong),
      at::randint(0, L - start, {B, 1}, at::kLong)};
  for (const std::string layout : {"BSHD", "SBHD"}) {
    const auto x = randn(shape_in(layout, B, H, S, D), dtype);
    for (size_t i = 0; i < forms.size(); ++i) {
      const auto y = rotary::apply_rope(x, freqs, start, interleaved, forms[i], false, std::nullopt, std::nullopt, layout);
      EXPECT_TRUE(AllClose(y, ref_partial(x, r, start, interleaved, forms[i], false, layout), tolerance_for(dtype)))
          << layout << " positions form " << i;
      EXPECT_TRUE(at::equal(y.narrow(3, r, D - r), x.narrow(3, r, D - r)));
    }
  }
}

// ---------------------------------------------------------------------------
// Packed variable-length batches

TEST_P(Variants, VarlenMatchesPerSequenceReference) {
  const auto [dtype, interleaved] = GetParam();
  const std::vector<int64_t> lens = {3, 0, 5, 1, 0, 4};
  const int64_t T = 13, Hq = 4, Hk = 2, D = 20, L = 32, start = 2;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto q = randn({T, Hq, D}, dtype);
  const auto k = randn({Hk, T, D}, dtype).transpose(0, 1);  // strided k
  const std::vector<OptTensor> forms = {std::nullopt, at::scalar_tensor(6, at::kLong), at::randint(0, L - start, {T}, at::kLong)};
  for (auto cu_dtype : {at::kInt, at::kLong}) {
    const auto cu = cu_from_lens(lens, cu_dtype);
    for (size_t i = 0; i < forms.size(); ++i) {
      poison_like(q);
      const auto y = rotary::apply_rope(q, freqs, start, interleaved, forms[i], false, cu);
      const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, start, interleaved, forms[i], false, cu);
      EXPECT_TRUE(AllClose(y, ref_varlen(q, cu, D, start, interleaved, forms[i]), tolerance_for(dtype)))
          << "positions form " << i;
      EXPECT_TRUE(AllClose(yk, ref_varlen(k, cu, D, start, interleaved, forms[i]), tolerance_for(dtype)))
          << "positions form " << i;
      EXPECT_TRUE(at::equal(yq, y));
    }
  }
}

TEST_P(Variants, VarlenPartialInverseRoundTrip) {
  const auto [dtype, interleaved] = GetParam();
  const auto cu = cu_from_lens({2, 0, 6}, at::kInt);
  const int64_t T = 8, D = 14, r = 8;
  const auto freqs = rotary::rope_freqs(r, 32);
  const auto x = randn({T, 3, D}, dtype);
  const auto ids = at::randint(0, 30, {T}, at::kLong);
  const auto inv = rotary::apply_rope(x, freqs, 1, interleaved, ids, true, cu);
  EXPECT_TRUE(AllClose(inv, ref_varlen(x, cu, r, 1, interleaved, ids, true), tolerance_for(dtype)));
  EXPECT_TRUE(at::equal(inv.narrow(2, r, D - r), x.narrow(2, r, D - r)));
  if (dtype == at::kDouble) {
    const auto back = rotary::apply_rope(rotary::apply_rope(x, freqs, 1, interleaved, ids, false, cu), freqs, 1,
                                         interleaved, ids, true, cu);
    EXPECT_TRUE(AllClose(back, x, kF64));
  }
}

TEST(VariantsVarlen, EdgeBatches) {
  at::manual_seed(1);
  const auto freqs = rotary::rope_freqs(8, 16);
  const std::vector<std::vector<int64_t>> batches = {{}, {0}, {0, 0}, {7}, {0, 7}, {7, 0, 0}, {1, 1, 1, 1}, {2, 0, 0, 5}};
  for (const auto& lens : batches) {
    int64_t T = 0;
    for (int64_t n : lens) T += n;
    const auto cu = cu_from_lens(lens, at::kInt);
    const auto x = randn({T, 2, 8}, at::kDouble);
    for (bool interleaved : {true, false}) {
      const auto y = rotary::apply_rope(x, freqs, 3, interleaved, std::nullopt, false, cu);
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_TRUE(AllClose(y, ref_varlen(x, cu, 8, 3, interleaved), kF64)) << "batch of " << lens.size();
    }
  }
  // One sequence is the plain BSHD call on it.
  const auto x = randn({9, 3, 16});
  const auto f16 = rotary::rope_freqs(16, 16);
  EXPECT_TRUE(at::equal(
      rotary::apply_rope(x, f16, 4, false, std::nullopt, false, cu_from_lens({9}), std::nullopt, "THD"),
      rotary::apply_rope(x.unsqueeze(0), f16, 4, false, std::nullopt, false, std::nullopt, std::nullopt, "BSHD")[0]));
}

// ---------------------------------------------------------------------------
// Partial rotary

TEST_P(Variants, PartialRotaryRotatesOnlyTheFirstDims) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, Hq = 3, Hk = 1, S = 5, D = 40, start = 6;
  for (int64_t r : {2, 16, 34, 40}) {
    const auto freqs = rotary::rope_freqs(r, 32);
    const auto q = randn({B, Hq, S, D}, dtype);
    const auto k = randn({B, S, Hk, D}, dtype).transpose(1, 2);
    poison_like(q);
    const auto y = rotary::apply_rope(q, freqs, start, interleaved);
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, start, interleaved);
    EXPECT_TRUE(AllClose(y, ref_partial(q, r, start, interleaved), tolerance_for(dtype))) << "r " << r;
    EXPECT_TRUE(AllClose(yk, ref_partial(k, r, start, interleaved), tolerance_for(dtype))) << "r " << r;
    EXPECT_TRUE(at::equal(yq, y));
    EXPECT_TRUE(at::equal(y.narrow(3, r, D - r), q.narrow(3, r, D - r))) << "tail copied bit for bit, r " << r;
    // In place: [0, r) as out of place, [r, D) untouched (NaN stays NaN).
    auto x = q.clone();
    x.narrow(3, r, D - r).fill_(std::numeric_limits<double>::quiet_NaN());
    at::Tensor& ret = rotary::apply_rope_(x, freqs, start, interleaved);
    EXPECT_EQ(&ret, &x);
    EXPECT_TRUE(at::equal(x.narrow(3, 0, r), y.narrow(3, 0, r))) << "r " << r;
    EXPECT_TRUE(at::isnan(x.narrow(3, r, D - r)).all().item<bool>()) << "r " << r;
  }
}

// ---------------------------------------------------------------------------
// inv_freq: positions past the table

TEST(VariantsInvFreq, ComputesFarPositions) {
  at::manual_seed(5);
  const int64_t D = 16, L = 8;  // a table of 8 rows
  const auto freqs = rotary::rope_freqs(D, L);
  const auto inv = inv_freq_f64(D);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool interleaved : {true, false}) {
      for (int64_t where : {int64_t{1000000}, int64_t{1} << 31, int64_t{1} << 40}) {
        const auto x = randn({2, 2, 3, D}, dtype);
        const auto y = rotary::apply_rope(x, freqs, where, interleaved, std::nullopt, false, std::nullopt, inv);
        EXPECT_TRUE(AllClose(y, ref_rope(x, where, interleaved), tolerance_for(dtype))) << "start " << where;
        // ids inside and outside the table
        const auto ids = longs({where, 3, where + 7, 0, where - 1, 7}).view({2, 3});
        const auto y2 = rotary::apply_rope(x, freqs, 0, interleaved, ids, false, std::nullopt, inv);
        EXPECT_TRUE(AllClose(y2, ref_rope(x, 0, interleaved, ids), tolerance_for(dtype))) << "ids near " << where;
        const auto cu = cu_from_lens({4, 3}, at::kInt);
        const auto xv = randn({7, 2, D}, dtype);
        const auto yv = rotary::apply_rope(xv, freqs, where, interleaved, std::nullopt, false, cu, inv);
        EXPECT_TRUE(AllClose(yv, ref_varlen(xv, cu, D, where, interleaved), tolerance_for(dtype)));
        // Partial: inv_freq has rotary_dim / 2 entries.
        const auto yp = rotary::apply_rope(
            x, rotary::rope_freqs(10, L), where, interleaved, std::nullopt, false, std::nullopt, inv_freq_f64(10));
        EXPECT_TRUE(AllClose(yp, ref_partial(x, 10, where, interleaved), tolerance_for(dtype)));
      }
    }
  }
  // Without inv_freq the same call is an IndexError.
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope(randn({1, 1, 2, D}), freqs, 1000000); }, {"apply_rope", "exceeds the freqs table length"});
}

// ---------------------------------------------------------------------------
// In place

TEST_P(Variants, InPlaceEqualsOutOfPlace) {
  const auto [dtype, interleaved] = GetParam();
  const auto freqs = rotary::rope_freqs(16, 32);
  const auto pos = longs({4, 0});
  auto x = randn({5, 2, 3, 24}, dtype);  // SBHD, partial
  const auto want = rotary::apply_rope(x, freqs, 1, interleaved, pos, false, std::nullopt, std::nullopt, "SBHD");
  const auto version = x._version();
  at::Tensor& ret = rotary::apply_rope_(x, freqs, 1, interleaved, pos, false, std::nullopt, std::nullopt, "SBHD");
  EXPECT_EQ(&ret, &x);
  EXPECT_GT(x._version(), version);
  EXPECT_TRUE(at::equal(x, want));

  const auto cu = cu_from_lens({3, 0, 4}, at::kInt);
  auto q = randn({7, 4, 16}, dtype);
  auto k = randn({7, 1, 16}, dtype);
  const auto [wq, wk] = rotary::apply_rope_qk(q, k, freqs, 2, interleaved, std::nullopt, false, cu);
  rotary::apply_rope_qk_(q, k, freqs, 2, interleaved, std::nullopt, false, cu);
  EXPECT_TRUE(at::equal(q, wq));
  EXPECT_TRUE(at::equal(k, wk));
}

TEST_P(Variants, InPlacePackedQkvViews) {
  const auto [dtype, interleaved] = GetParam();
  const int64_t B = 2, S = 6, Hq = 4, Hk = 2, D = 20, r = 12;
  const auto freqs = rotary::rope_freqs(r, 32);
  const auto qkv = randn({B, S, Hq + 2 * Hk, D}, dtype);
  const auto before = qkv.clone();
  auto q = qkv.narrow(2, 0, Hq);
  auto k = qkv.narrow(2, Hq, Hk);
  const auto pos = longs({3, 0});
  rotary::apply_rope_qk_(q, k, freqs, 2, interleaved, pos, false, std::nullopt, std::nullopt, "BSHD");
  EXPECT_TRUE(at::equal(qkv.narrow(2, Hq + Hk, Hk), before.narrow(2, Hq + Hk, Hk))) << "v was modified";
  EXPECT_TRUE(at::equal(qkv.narrow(3, r, D - r), before.narrow(3, r, D - r))) << "pass-through dims were modified";
  EXPECT_TRUE(AllClose(q, ref_partial(before.narrow(2, 0, Hq), r, 2, interleaved, pos, false, "BSHD"), tolerance_for(dtype)));
  EXPECT_TRUE(AllClose(k, ref_partial(before.narrow(2, Hq, Hk), r, 2, interleaved, pos, false, "BSHD"), tolerance_for(dtype)));
}

TEST(VariantsInPlace, RefusedInputsAreNotWritten) {
  at::manual_seed(2);
  const auto freqs = rotary::rope_freqs(8, 16);
  auto x = randn({1, 4, 3, 8});
  const auto x_before = x.clone();
  // Requires grad with grad mode on.
  at::Tensor leaf = randn({1, 2, 3, 8});
  leaf.set_requires_grad(true);
  const auto leaf_before = leaf.detach().clone();
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(leaf, freqs); },
      {"apply_rope_", "x requires grad", "in-place rotation is not differentiable"});
  ExpectError<c10::ValueError>([&] { rotary::apply_rope_qk_(x, leaf, freqs); }, {"apply_rope_qk_", "k requires grad"});
  EXPECT_TRUE(at::equal(leaf.detach(), leaf_before));
  {
    torch::NoGradGuard no_grad;
    rotary::apply_rope_(leaf, freqs, 1);  // allowed without grad mode
  }
  EXPECT_FALSE(at::equal(leaf.detach(), leaf_before));
  // Expanded (elements sharing memory).
  const auto base = randn({2, 1, 3, 8});
  const auto base_before = base.clone();
  auto expanded = base.expand({2, 4, 3, 8});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(expanded, freqs); }, {"apply_rope_", "x has elements sharing memory"});
  auto fresh = randn({2, 4, 3, 8});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk_(fresh, expanded, freqs); }, {"apply_rope_qk_", "k has elements sharing memory"});
  EXPECT_TRUE(at::equal(base, base_before));
  // q and k overlapping.
  ExpectError<c10::ValueError>([&] { rotary::apply_rope_qk_(x, x, freqs); }, {"q and k overlap in memory"});
  auto q3 = x.narrow(1, 0, 3);
  auto k3 = x.narrow(1, 2, 2);
  ExpectError<c10::ValueError>([&] { rotary::apply_rope_qk_(q3, k3, freqs); }, {"q and k overlap in memory"});
  // Late validation errors (cu_seqlens values, positions past the table): still nothing written.
  auto t = randn({6, 2, 8});
  const auto t_before = t.clone();
  auto tk = randn({6, 1, 8});
  const auto tk_before = tk.clone();
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk_(t, tk, freqs, 0, true, std::nullopt, false, longs({0, 4, 2, 6})); },
      {"apply_rope_qk_", "cu_seqlens must start at 0, never decrease"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope_qk_(t, tk, freqs, 13, true, std::nullopt, false, longs({0, 2, 6})); },
      {"apply_rope_qk_", "outside the freqs table"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(t, freqs, 0, true, at::scalar_tensor(-1, at::kLong), false, longs({0, 2, 6})); },
      {"apply_rope_", "negative position -1"});
  EXPECT_TRUE(at::equal(t, t_before));
  EXPECT_TRUE(at::equal(tk, tk_before));
  EXPECT_TRUE(at::equal(x, x_before));
}

// ---------------------------------------------------------------------------
// Gradients: the inverse rotation, through varlen, partial rotary and layouts

TEST(VariantsAutograd, GradIsInverseRotation) {
  torch::manual_seed(3);
  const auto cu = cu_from_lens({2, 0, 4}, at::kInt);
  const auto ids = longs({5, 0, 3, 1, 2, 9});
  for (bool interleaved : {true, false}) {
    // varlen, partial
    auto x = torch::randn({6, 2, 10}, torch::kDouble).requires_grad_();
    const auto w = torch::randn({6, 2, 10}, torch::kDouble);
    const auto f6 = rotary::rope_freqs(6, 16);
    (rotary::apply_rope(x, f6, 1, interleaved, ids, false, cu) * w).sum().backward();
    EXPECT_TRUE(AllClose(x.grad(), ref_varlen(w, cu, 6, 1, interleaved, ids, true), kF64));
    EXPECT_TRUE(at::equal(x.grad().narrow(2, 6, 4), w.narrow(2, 6, 4))) << "pass-through gradient is the identity";
    // SBHD with [B] offsets, q and k
    auto q = torch::randn({3, 2, 2, 8}, torch::kDouble).requires_grad_();
    auto k = torch::randn({3, 2, 1, 8}, torch::kDouble).requires_grad_();
    const auto wq = torch::randn(q.sizes(), torch::kDouble);
    const auto wk = torch::randn(k.sizes(), torch::kDouble);
    const auto f8 = rotary::rope_freqs(8, 16);
    const auto off = longs({1, 4});
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, f8, 2, interleaved, off, false, std::nullopt, std::nullopt, "SBHD");
    ((yq * wq).sum() + (yk * wk).sum()).backward();
    EXPECT_TRUE(AllClose(q.grad(), ref_partial(wq, 8, 2, interleaved, off, true, "SBHD"), kF64));
    EXPECT_TRUE(AllClose(k.grad(), ref_partial(wk, 8, 2, interleaved, off, true, "SBHD"), kF64));
  }
}

TEST(VariantsAutograd, DoubleBackwardThroughVarlen) {
  torch::manual_seed(4);
  const auto cu = cu_from_lens({3, 2});
  const auto f = rotary::rope_freqs(6, 16);
  auto x = torch::randn({5, 2, 8}, torch::kDouble).requires_grad_();
  const auto g = torch::randn({5, 2, 8}, torch::kDouble).requires_grad_();
  const auto y = rotary::apply_rope(x, f, 2, false, std::nullopt, false, cu);
  const auto gx = torch::autograd::grad({y}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  ASSERT_TRUE(gx.requires_grad());
  EXPECT_TRUE(AllClose(gx, ref_varlen(g, cu, 6, 2, false, {}, true), kF64));
  // d(gx)/dg is the inverse rotation again: its vector-Jacobian product with w rotates w forward.
  const auto w = torch::randn({5, 2, 8}, torch::kDouble);
  const auto gg = torch::autograd::grad({gx}, {g}, {w})[0];
  EXPECT_TRUE(AllClose(gg, ref_varlen(w, cu, 6, 2, false), kF64));
}

// ---------------------------------------------------------------------------
// Errors: type and a message naming the argument

TEST(VariantsErrors, CuSeqlens) {
  const auto freqs = rotary::rope_freqs(8, 16);
  const auto x = randn({5, 2, 8});
  const auto x_before = x.clone();
  auto call = [&](const at::Tensor& cu) { rotary::apply_rope(x, freqs, 0, true, std::nullopt, false, cu); };
  ExpectError<c10::ValueError>([&] { call(longs({1, 2, 5})); },
                               {"apply_rope: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5",
                                "got [1, 2, 5]"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 3, 2, 5})); }, {"cu_seqlens must start at 0", "got [0, 3, 2, 5]"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 2, 4}).to(at::kInt)); }, {"end at total_tokens = 5", "got [0, 2, 4]"});
  ExpectError<c10::TypeError>([&] { call(longs({0, 5}).to(at::kFloat)); }, {"cu_seqlens must be int32 or int64, got Float"});
  ExpectError<c10::ValueError>([&] { call(longs({0, 2, 5}).view({1, 3})); },
                               {"cu_seqlens must be 1-D [num_seqs + 1]", "got shape [1, 3]"});
  ExpectError<c10::ValueError>([&] { call(at::empty({0}, at::kLong)); }, {"cu_seqlens must be 1-D", "got shape [0]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 5, 2, 8}), freqs, 0, true, std::nullopt, false, longs({0, 5})); },
      {"with cu_seqlens, x must be 3-D [total_tokens, heads, head_dim]", "got shape [1, 5, 2, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x, randn({1, 5, 1, 8}), freqs, 0, true, std::nullopt, false, longs({0, 5})); },
      {"apply_rope_qk: with cu_seqlens, k must be 3-D"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 0, true, at::zeros({1, 5}, at::kLong), false, longs({0, 5})); },
      {"with cu_seqlens, positions must have shape []", "[total_tokens] = [5]", "got [1, 5]"});
  EXPECT_TRUE(at::equal(x, x_before));
}

TEST(VariantsErrors, LayoutsAndShapes) {
  const auto freqs = rotary::rope_freqs(8, 16);
  const auto x = randn({2, 2, 3, 8});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 0, true, std::nullopt, false, std::nullopt, std::nullopt, "BHDS"); },
      {"apply_rope: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs, 0, true, std::nullopt, false, longs({0, 5}), std::nullopt, "SBHD"); },
      {"with cu_seqlens the layout is 'THD', got 'SBHD'"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs); },
      {"x must be 4-D [batch, heads, seq_len, head_dim], got shape [5, 2, 8] (layout BHSD)",
       "a 3-D [total_tokens, heads, head_dim] input needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({5, 2, 8}), freqs, 0, true, std::nullopt, false, std::nullopt, std::nullopt, "SBHD"); },
      {"x must be 4-D [seq_len, batch, heads, head_dim]", "(layout SBHD)", "needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, rotary::rope_freqs(10, 16)); },
      {"freqs must have shape [max_seq_len, rotary_dim / 2] with 0 < rotary_dim <= head_dim = 8", "got [16, 5]"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(x, freqs, 20, true, std::nullopt, false, std::nullopt, at::ones({4}, at::kFloat)); },
      {"inv_freq must be float64, got Float"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 20, true, std::nullopt, false, std::nullopt, at::ones({8}, at::kDouble)); },
      {"inv_freq must have shape [rotary_dim / 2] = [4] to match freqs, got [8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({2, 3, 2, 8}), freqs, 0, true, longs({0, 1, 2}), false, std::nullopt, std::nullopt, "BSHD"); },
      {"positions must have shape", "batch = 2, seq_len = 3", "got [3]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, freqs, 1, true, longs({0, -2})); },
      {"apply_rope: token (batch 1, seq 0) has negative position -1 (start_pos 1 + positions)"});
}

// ---------------------------------------------------------------------------
// The older schemes (seed 001): sinusoidal table and ALiBi

TEST(Schemes, SinusoidalTableIsSeedFormula) {
  for (double base : {10000.0, 500.0}) {
    const int64_t n = 37, d = 16;
    const auto pe = rotary::sinusoidal_table(n, d, base);
    ASSERT_EQ(pe.scalar_type(), at::kFloat);
    ASSERT_EQ(pe.sizes(), at::IntArrayRef({n, d}));
    const auto a = pe.accessor<float, 2>();
    for (int64_t pos = 0; pos < n; ++pos) {
      for (int64_t i = 0; i < d / 2; ++i) {
        const double theta = static_cast<double>(pos) / std::pow(base, static_cast<double>(2 * i) / d);
        EXPECT_EQ(a[pos][2 * i], static_cast<float>(std::sin(theta))) << pos << ", " << i;
        EXPECT_EQ(a[pos][2 * i + 1], static_cast<float>(std::cos(theta))) << pos << ", " << i;
      }
    }
  }
  EXPECT_EQ(rotary::sinusoidal_table(0, 8).sizes(), at::IntArrayRef({0, 8}));
  // Row 0: sin 0 = 0, cos 0 = 1.
  EXPECT_TRUE(at::equal(rotary::sinusoidal_table(1, 4)[0], at::tensor({0.f, 1.f, 0.f, 1.f})));
}

TEST(Schemes, AlibiSlopesAndBias) {
  for (int64_t heads : {1, 4, 8, 12}) {
    const auto m = rotary::alibi_slopes(heads);
    ASSERT_EQ(m.scalar_type(), at::kFloat);
    ASSERT_EQ(m.numel(), heads);
    for (int64_t h = 0; h < heads; ++h) {
      EXPECT_EQ(m[h].item<float>(), static_cast<float>(std::pow(2.0, -8.0 * (h + 1) / heads)));
    }
  }
  // Powers of two for 8 heads: 1/2, 1/4, ..., 1/256.
  EXPECT_EQ(rotary::alibi_slopes(8)[0].item<float>(), 0.5f);
  EXPECT_EQ(rotary::alibi_slopes(8)[7].item<float>(), 1.0f / 256);
  const int64_t H = 3, S = 6;
  for (bool causal : {true, false}) {
    const auto bias = rotary::alibi_bias(H, S, causal);
    ASSERT_EQ(bias.sizes(), at::IntArrayRef({H, S, S}));
    ASSERT_EQ(bias.scalar_type(), at::kFloat);
    const auto a = bias.accessor<float, 3>();
    for (int64_t h = 0; h < H; ++h) {
      const double slope = std::pow(2.0, -8.0 * (h + 1) / H);
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          if (causal && j > i) {
            EXPECT_TRUE(std::isinf(a[h][i][j]) && a[h][i][j] < 0) << h << " " << i << " " << j;
          } else {
            EXPECT_EQ(a[h][i][j], static_cast<float>(-slope * std::abs(i - j))) << h << " " << i << " " << j;
          }
        }
      }
    }
  }
  EXPECT_EQ(rotary::alibi_bias(2, 0).sizes(), at::IntArrayRef({2, 0, 0}));
}

TEST(Schemes, InvalidArguments) {
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(-1, 8); }, {"sinusoidal_table: n", ">= 0, got -1"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 7); }, {"sinusoidal_table: d", "even and > 0, got 7"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 0); }, {"sinusoidal_table: d", "got 0"});
  ExpectError<c10::ValueError>([] { rotary::sinusoidal_table(4, 8, 0.0); }, {"sinusoidal_table: base must be finite and > 0"});
  ExpectError<c10::ValueError>(
      [] { rotary::sinusoidal_table(4, 8, std::numeric_limits<double>::quiet_NaN()); }, {"base must be finite"});
  ExpectError<c10::ValueError>([] { rotary::alibi_slopes(0); }, {"alibi_slopes: n_heads must be > 0, got 0"});
  ExpectError<c10::ValueError>([] { rotary::alibi_bias(-2, 4); }, {"alibi_bias: n_heads must be > 0, got -2"});
  ExpectError<c10::ValueError>([] { rotary::alibi_bias(2, -1); }, {"alibi_bias: seq_len must be >= 0, got -1"});
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypes,
    Variants,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16), ::testing::Bool()),
    case_name);

}  // namespace
