// Gradients of the variants from C++: the inverse rotation, through
// varlen, partial rotary and layouts, and double backward through varlen.
#include "helpers.h"
#include "reference.h"
#include "variants.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <optional>

namespace {

using rotary_test::AllClose;
using rotary_test::kF64;
using rotary_test::longs;
using rotary_test::cu_from_lens;
using rotary_test::ref_partial;
using rotary_test::ref_varlen;

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
    (rotary::apply_rope(x, f6, 0, interleaved, std::nullopt, ids + 1, false, cu) * w).sum().backward();
    EXPECT_TRUE(AllClose(x.grad(), ref_varlen(w, cu, 6, 1, interleaved, ids, true), kF64));
    EXPECT_TRUE(at::equal(x.grad().narrow(2, 6, 4), w.narrow(2, 6, 4))) << "pass-through gradient is the identity";
    // SBHD with [B] offsets, q and k
    auto q = torch::randn({3, 2, 2, 8}, torch::kDouble).requires_grad_();
    auto k = torch::randn({3, 2, 1, 8}, torch::kDouble).requires_grad_();
    const auto wq = torch::randn(q.sizes(), torch::kDouble);
    const auto wk = torch::randn(k.sizes(), torch::kDouble);
    const auto f8 = rotary::rope_freqs(8, 16);
    const auto off = longs({1, 4});
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, f8, 2, interleaved, off, std::nullopt, false, std::nullopt, std::nullopt, "SBHD");
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
  const auto y = rotary::apply_rope(x, f, 2, false, std::nullopt, std::nullopt, false, cu);
  const auto gx = torch::autograd::grad({y}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  ASSERT_TRUE(gx.requires_grad());
  EXPECT_TRUE(AllClose(gx, ref_varlen(g, cu, 6, 2, false, {}, true), kF64));
  // d(gx)/dg is the inverse rotation again: its vector-Jacobian product with w rotates w forward.
  const auto w = torch::randn({5, 2, 8}, torch::kDouble);
  const auto gg = torch::autograd::grad({gx}, {g}, {w})[0];
  EXPECT_TRUE(AllClose(gg, ref_varlen(w, cu, 6, 2, false), kF64));
}

}  // namespace
