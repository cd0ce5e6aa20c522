// In-place ops from C++ (rotary::apply_rope_, rotary::apply_rope_qk_): the
// out-of-place bits, packed qkv views, and refused inputs left unwritten.
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <optional>

namespace {

using rotary_test::AllClose;
using rotary_test::ExpectError;
using rotary_test::tolerance_for;
using rotary_test::randn;
using rotary_test::longs;
using rotary_test::cu_from_lens;
using rotary_test::ref_partial;
using rotary_test::Variants;

// ---------------------------------------------------------------------------
// In place

TEST_P(Variants, InPlaceEqualsOutOfPlace) {
  const auto [dtype, interleaved] = GetParam();
  const auto freqs = rotary::rope_freqs(16, 32);
  const auto pos = longs({4, 0});
  auto x = randn({5, 2, 3, 24}, dtype);  // SBHD, partial
  const auto want = rotary::apply_rope(x, freqs, 1, interleaved, pos, std::nullopt, false, std::nullopt, std::nullopt, "SBHD");
  const auto version = x._version();
  at::Tensor& ret = rotary::apply_rope_(x, freqs, 1, interleaved, pos, std::nullopt, false, std::nullopt, std::nullopt, "SBHD");
  EXPECT_EQ(&ret, &x);
  EXPECT_GT(x._version(), version);
  EXPECT_TRUE(at::equal(x, want));

  const auto cu = cu_from_lens({3, 0, 4}, at::kInt);
  auto q = randn({7, 4, 16}, dtype);
  auto k = randn({7, 1, 16}, dtype);
  const auto [wq, wk] = rotary::apply_rope_qk(q, k, freqs, 2, interleaved, std::nullopt, std::nullopt, false, cu);
  rotary::apply_rope_qk_(q, k, freqs, 2, interleaved, std::nullopt, std::nullopt, false, cu);
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
  rotary::apply_rope_qk_(q, k, freqs, 2, interleaved, pos, std::nullopt, false, std::nullopt, std::nullopt, "BSHD");
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
      [&] { rotary::apply_rope_qk_(t, tk, freqs, 0, true, std::nullopt, std::nullopt, false, longs({0, 4, 2, 6})); },
      {"apply_rope_qk_", "cu_seqlens must start at 0, never decrease"});
  ExpectError<c10::IndexError>(
      [&] { rotary::apply_rope_qk_(t, tk, freqs, 13, true, std::nullopt, std::nullopt, false, longs({0, 2, 6})); },
      {"apply_rope_qk_", "outside the freqs table"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_(t, freqs, 0, true, at::scalar_tensor(-1, at::kLong), std::nullopt, false, longs({0, 2, 6})); },
      {"apply_rope_", "negative position -1"});
  EXPECT_TRUE(at::equal(t, t_before));
  EXPECT_TRUE(at::equal(tk, tk_before));
  EXPECT_TRUE(at::equal(x, x_before));
}

}  // namespace
