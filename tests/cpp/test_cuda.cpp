// GPU tests: the CUDA kernels against the float64 reference and the CPU path.
// They skip when no GPU is visible (CI), and run in benchmarks/gpu_check.sh.
#include "reference.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <limits>

namespace {

#define REQUIRE_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

double tol(at::ScalarType dtype) {
  return dtype == at::kFloat ? 2e-5 : dtype == at::kDouble ? 2e-6 : dtype == at::kHalf ? 4e-3 : 3e-2;
}

TEST(Cuda, MatchesReferenceAcrossDtypesLayoutsAndPairings) {
  REQUIRE_GPU();
  at::manual_seed(21);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (int64_t d : {64, 80, 128, 256}) {
      for (bool interleaved : {true, false}) {
        for (bool packed : {false, true}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + " D=" + std::to_string(d) +
                       (interleaved ? " interleaved" : " half") + (packed ? " packed qkv" : " contiguous"));
          at::Tensor q, k;
          if (packed) {
            auto qkv = at::randn({2, 9, 5 + 2 * 3, d}, cuda.dtype(dtype)).transpose(1, 2);
            q = qkv.narrow(1, 0, 5);
            k = qkv.narrow(1, 5, 3);
          } else {
            q = at::randn({2, 5, 9, d}, cuda.dtype(dtype));
            k = at::randn({2, 3, 9, d}, cuda.dtype(dtype));
          }
          auto freqs = rotary::rope_freqs(d, 64).to(at::kCUDA);
          auto [oq, ok] = rotary::apply_rope_qk(q, k, freqs, 17, interleaved);
          EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), rotary_test::ref_rope(q, 17, interleaved), tol(dtype), tol(dtype)));
          EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), rotary_test::ref_rope(k, 17, interleaved), tol(dtype), tol(dtype)));
          auto [cq, ck] = rotary::apply_rope_qk(q.cpu(), k.cpu(), freqs.cpu(), 17, interleaved);
          EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), cq.to(at::kDouble), tol(dtype), tol(dtype)));
          EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), ck.to(at::kDouble), tol(dtype), tol(dtype)));
        }
      }
    }
  }
}

TEST(Cuda, DecodeWithDevicePositions) {
  REQUIRE_GPU();
  at::manual_seed(22);
  auto q = at::randn({4, 8, 1, 128}, at::device(at::kCUDA).dtype(at::kBFloat16));
  auto k = at::randn({4, 2, 1, 128}, at::device(at::kCUDA).dtype(at::kBFloat16));
  auto freqs = rotary::rope_freqs(128, 256).to(at::kCUDA);
  auto offsets = at::tensor({int64_t{3}, int64_t{40}, int64_t{100}, int64_t{7}}).to(at::kCUDA);
  auto [oq, ok] = rotary::apply_rope_qk(q, k, freqs, 1, true, offsets);
  EXPECT_TRUE(at::allclose(oq.cpu().to(at::kDouble), rotary_test::ref_rope(q, 1, true, offsets), 3e-2, 3e-2));
  EXPECT_TRUE(at::allclose(ok.cpu().to(at::kDouble), rotary_test::ref_rope(k, 1, true, offsets), 3e-2, 3e-2));
}

TEST(Cuda, GradientIsInverseRotation) {
  REQUIRE_GPU();
  at::manual_seed(23);
  auto x = at::randn({2, 3, 6, 64}, at::device(at::kCUDA).dtype(at::kDouble)).requires_grad_(true);
  auto g = at::randn({2, 3, 6, 64}, at::device(at::kCUDA).dtype(at::kDouble));
  auto freqs = rotary::rope_freqs(64, 32).to(at::kCUDA);
  auto y = rotary::apply_rope(x, freqs, 4, false);
  (y * g).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad().cpu(), rotary_test::ref_rope(g, 4, false, std::nullopt, true), 2e-6, 2e-6));
}

TEST(Cuda, ModuleToCudaRunsOnGpu) {
  REQUIRE_GPU();
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(64).max_seq_len(128));
  rope->to(torch::kCUDA);
  rope->to(torch::kHalf);
  EXPECT_TRUE(rope->freqs.is_cuda());
  EXPECT_EQ(rope->freqs.scalar_type(), at::kComplexFloat);
  auto x = torch::randn({1, 2, 5, 64}, torch::device(torch::kCUDA).dtype(torch::kHalf));
  auto y = rope->forward(x, 3);
  EXPECT_TRUE(y.is_cuda());
  EXPECT_TRUE(at::allclose(y.cpu().to(at::kDouble), rotary_test::ref_rope(x, 3), 4e-3, 4e-3));
}

TEST(Cuda, DeviceMismatchIsAnError) {
  REQUIRE_GPU();
  auto x = at::randn({1, 1, 2, 8}, at::kCUDA);
  auto freqs = rotary::rope_freqs(8, 4);
  try {
    rotary::apply_rope(x, freqs);
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("freqs is on cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
