// Autograd from C++: the Jacobian of RoPE is the rotation itself, so the
// gradient of x is the upstream gradient rotated by the negative angle, and
// the backward (itself a RoPE call) is differentiable again.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <optional>

namespace {

using rotary_test::AllClose;
using rotary_test::kF64;
using rotary_test::ref_rope;
using rotary_test::Tolerance;
using rotary_test::tolerance_for;

class RopeAutograd : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(777); }
};

torch::Tensor leaf(at::IntArrayRef sizes, at::ScalarType dtype = at::kDouble) {
  return torch::randn(sizes, torch::kFloat).to(dtype).requires_grad_();
}

TEST_F(RopeAutograd, GradIsInverseRotationOfUpstream) {
  const int64_t B = 2, H = 3, S = 5, D = 20, L = 32;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto ids = torch::randint(0, L - 3, {B, S}, torch::kLong);
  for (auto dtype : {at::kDouble, at::kFloat}) {
    for (bool interleaved : {true, false}) {
      for (const std::optional<at::Tensor>& pos : {std::optional<at::Tensor>(), std::optional<at::Tensor>(ids)}) {
        auto x = leaf({B, H, S, D}, dtype);
        const auto g = torch::randn({B, H, S, D}, torch::kFloat).to(dtype);
        const auto P = rotary_test::op_positions(3, pos);
        const auto y = rotary::apply_rope(x, freqs, P.start_pos, interleaved, P.offsets, P.position_ids);
        ASSERT_TRUE(y.requires_grad());
        (y * g).sum().backward();
        ASSERT_TRUE(x.grad().defined());
        EXPECT_EQ(x.grad().scalar_type(), dtype);
        EXPECT_TRUE(AllClose(x.grad(), ref_rope(g, 3, interleaved, pos, /*inverse=*/true), tolerance_for(dtype)))
            << "dtype " << dtype << " interleaved " << interleaved << " positions " << pos.has_value();
      }
    }
  }
}

TEST_F(RopeAutograd, GradOfInverseOpIsForwardRotation) {
  const int64_t D = 16, L = 16;
  const auto freqs = rotary::rope_freqs(D, L);
  auto x = leaf({1, 2, 4, D});
  const auto g = torch::randn({1, 2, 4, D}, torch::kDouble);
  (rotary::apply_rope(x, freqs, 2, false, std::nullopt, std::nullopt, /*inverse=*/true) * g).sum().backward();
  EXPECT_TRUE(AllClose(x.grad(), ref_rope(g, 2, false), kF64));
}

TEST_F(RopeAutograd, GradWithConjugatedFreqs) {
  // freqs.conj() rotates by -angle, so its gradient rotates by +angle.
  const auto freqs = rotary::rope_freqs(16, 16).conj();
  for (bool interleaved : {true, false}) {
    auto x = leaf({1, 2, 4, 16});
    const auto g = torch::randn({1, 2, 4, 16}, torch::kDouble);
    (rotary::apply_rope(x, freqs, 3, interleaved) * g).sum().backward();
    EXPECT_TRUE(AllClose(x.grad(), ref_rope(g, 3, interleaved), kF64));
  }
}

TEST_F(RopeAutograd, GradWith16BitInputs) {
  const int64_t D = 64, L = 16;
  const auto freqs = rotary::rope_freqs(D, L);
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    auto x = leaf({2, 2, 3, D}, dtype);
    const auto g = torch::randn({2, 2, 3, D}, torch::kFloat).to(dtype);
    (rotary::apply_rope(x, freqs, 1) * g).sum().backward();
    EXPECT_EQ(x.grad().scalar_type(), dtype);
    // The upstream gradient reaching the op is exactly g (times ones).
    EXPECT_TRUE(AllClose(x.grad(), ref_rope(g, 1, true, std::nullopt, true), tolerance_for(dtype)));
  }
}

TEST_F(RopeAutograd, SumBackwardWithExpandedGrad) {
  // y.sum().backward() hands the op a stride-0 expanded gradient.
  const int64_t D = 10, L = 8;
  const auto freqs = rotary::rope_freqs(D, L);
  for (bool interleaved : {true, false}) {
    auto x = leaf({2, 3, 4, D});
    rotary::apply_rope(x, freqs, 2, interleaved).sum().backward();
    EXPECT_TRUE(AllClose(
        x.grad(), ref_rope(torch::ones({2, 3, 4, D}, torch::kDouble), 2, interleaved, std::nullopt, true), kF64));
  }
}

TEST_F(RopeAutograd, GradThroughTransposedView) {
  const int64_t B = 2, S = 4, H = 3, D = 8, L = 8;
  const auto freqs = rotary::rope_freqs(D, L);
  auto base = leaf({B, S, H, D});
  const auto x = base.transpose(1, 2);
  const auto g = torch::randn({B, H, S, D}, torch::kDouble);
  (rotary::apply_rope(x, freqs, 1) * g).sum().backward();
  EXPECT_TRUE(AllClose(base.grad().transpose(1, 2), ref_rope(g, 1, true, std::nullopt, true), kF64));
}

TEST_F(RopeAutograd, QkGradsWithGroupedHeads) {
  const int64_t B = 2, Hq = 8, Hk = 2, S = 5, D = 32, L = 16;
  const auto freqs = rotary::rope_freqs(D, L);
  const auto offsets = torch::tensor({0, 4}, torch::kLong);
  for (bool interleaved : {true, false}) {
    auto q = leaf({B, Hq, S, D});
    auto k = leaf({B, Hk, S, D});
    const auto gq = torch::randn({B, Hq, S, D}, torch::kDouble);
    const auto gk = torch::randn({B, Hk, S, D}, torch::kDouble);
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 2, interleaved, offsets);
    ((yq * gq).sum() + (yk * gk).sum()).backward();
    EXPECT_TRUE(AllClose(q.grad(), ref_rope(gq, 2, interleaved, offsets, true), kF64));
    EXPECT_TRUE(AllClose(k.grad(), ref_rope(gk, 2, interleaved, offsets, true), kF64));
  }
}

TEST_F(RopeAutograd, QkGradWhenOnlyOneOutputIsUsed) {
  const int64_t D = 8, L = 8;
  const auto freqs = rotary::rope_freqs(D, L);
  auto q = leaf({1, 2, 3, D});
  auto k = leaf({1, 1, 3, D});
  const auto g = torch::randn({1, 2, 3, D}, torch::kDouble);
  {
    const auto [yq, yk] = rotary::apply_rope_qk(q, k, freqs, 1);
    (yq * g).sum().backward();
  }
  EXPECT_TRUE(AllClose(q.grad(), ref_rope(g, 1, true, std::nullopt, true), kF64));
  if (k.grad().defined()) EXPECT_EQ(k.grad().abs().max().item<double>(), 0.0);

  // And only k, with q not requiring grad at all.
  auto k2 = leaf({1, 1, 3, D});
  const auto q2 = torch::randn({1, 2, 3, D}, torch::kDouble);
  const auto gk = torch::randn({1, 1, 3, D}, torch::kDouble);
  const auto [yq2, yk2] = rotary::apply_rope_qk(q2, k2, freqs, 4, false);
  (yk2 * gk).sum().backward();
  EXPECT_TRUE(AllClose(k2.grad(), ref_rope(gk, 4, false, std::nullopt, true), kF64));
}

TEST_F(RopeAutograd, DoubleBackward) {
  const int64_t D = 12, L = 16;
  const auto freqs = rotary::rope_freqs(D, L);
  for (bool interleaved : {true, false}) {
    auto x = leaf({2, 2, 3, D});
    auto g = leaf({2, 2, 3, D});
    const auto y = rotary::apply_rope(x, freqs, 5, interleaved);
    const auto gx = torch::autograd::grad({y}, {x}, {g}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    ASSERT_TRUE(gx.requires_grad()) << "backward was not recorded with create_graph=true";
    EXPECT_TRUE(AllClose(gx, ref_rope(g, 5, interleaved, std::nullopt, true), kF64));
    // d/dg <R^-1 g, h> = R h; gx does not depend on x (the op is linear).
    const auto h = torch::randn({2, 2, 3, D}, torch::kDouble);
    const auto second = torch::autograd::grad(
        {(gx * h).sum()}, {g, x}, /*grad_outputs=*/{}, /*retain_graph=*/std::nullopt, /*create_graph=*/false,
        /*allow_unused=*/true);
    EXPECT_TRUE(AllClose(second[0], ref_rope(h, 5, interleaved), kF64));
    if (second[1].defined()) EXPECT_EQ(second[1].abs().max().item<double>(), 0.0);
  }
}

TEST_F(RopeAutograd, NoGradModeRecordsNothing) {
  const auto freqs = rotary::rope_freqs(8, 8);
  auto x = leaf({1, 1, 2, 8});
  torch::NoGradGuard no_grad;
  const auto y = rotary::apply_rope(x, freqs);
  EXPECT_FALSE(y.requires_grad());
  const auto [yq, yk] = rotary::apply_rope_qk(x, x, freqs);
  EXPECT_FALSE(yq.requires_grad());
  EXPECT_FALSE(yk.requires_grad());
}

class AutogradOnDevice : public rotary_test::OnDevice {};

TEST_P(AutogradOnDevice, GradientIsInverseRotation) {
  auto x = at::randn({2, 3, 6, 64}, on(at::kDouble)).requires_grad_(true);
  auto g = at::randn({2, 3, 6, 64}, on(at::kDouble));
  auto freqs = rotary::rope_freqs(64, 32).to(GetParam());
  auto y = rotary::apply_rope(x, freqs, 4, false);
  (y * g).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad().cpu(), rotary_test::ref_rope(g, 4, false, std::nullopt, true), 2e-6, 2e-6));
}

ROTARY_ON_DEVICES(AutogradOnDevice);

}  // namespace
