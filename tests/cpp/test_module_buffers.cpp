// rotary::RotaryEmbedding's buffers, freqs (the complex64 table) and
// inv_freq (float64): registered, independent in a clone, never cast by
// to(dtype) (inside a parent module too), restored by save / load, and
// moved to every device. A file of its own to be read in one sitting (the
// table and forward passes: test_module_forward.cpp).
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingImpl;
using rotary::RotaryEmbeddingOptions;
using rotary_test::AllClose;
using rotary_test::ref_rope;
using rotary_test::RotaryModule;
using rotary_test::tolerance_for;

using rotary_test::kF32;

TEST_F(RotaryModule, NamedBuffersHoldFreqsAndInvFreq) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(10).theta(500.0));
  const auto buffers = rope->named_buffers();
  EXPECT_EQ(buffers.keys(), (std::vector<std::string>{"freqs", "inv_freq"}));
  ASSERT_TRUE(buffers.contains("freqs"));
  EXPECT_TRUE(buffers["freqs"].is_same(rope->freqs));
  ASSERT_TRUE(buffers.contains("inv_freq"));
  EXPECT_TRUE(buffers["inv_freq"].is_same(rope->inv_freq));
  ASSERT_EQ(rope->inv_freq.scalar_type(), torch::kDouble);
  ASSERT_EQ(rope->inv_freq.sizes(), torch::IntArrayRef({4}));
  for (int64_t j = 0; j < 4; ++j) {
    const double expected = rotary_test::ref_inv_freq(j, 8, 500.0);
    EXPECT_NEAR(rope->inv_freq[j].item<double>(), expected, 1e-15 * expected) << "j " << j;
  }
  EXPECT_TRUE(rope->parameters().empty()) << "RoPE has nothing to train";
}

TEST_F(RotaryModule, CloneIsIndependentWithEqualTable) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(20).theta(123.0).interleaved(false));
  const auto cloned = std::dynamic_pointer_cast<RotaryEmbeddingImpl>(rope->clone());
  ASSERT_NE(cloned, nullptr);
  EXPECT_EQ(cloned->options.dim(), 16);
  EXPECT_EQ(cloned->options.max_seq_len(), 20);
  EXPECT_DOUBLE_EQ(cloned->options.theta(), 123.0);
  EXPECT_FALSE(cloned->options.interleaved());
  ASSERT_EQ(cloned->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_TRUE(torch::equal(cloned->freqs, rope->freqs));
  EXPECT_NE(cloned->freqs.data_ptr(), rope->freqs.data_ptr());
  // The clone's member and its registered buffer are one tensor.
  EXPECT_EQ(cloned->named_buffers()["freqs"].data_ptr(), cloned->freqs.data_ptr());
  ASSERT_EQ(cloned->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(cloned->inv_freq, rope->inv_freq));
  EXPECT_NE(cloned->inv_freq.data_ptr(), rope->inv_freq.data_ptr());
  EXPECT_EQ(cloned->named_buffers()["inv_freq"].data_ptr(), cloned->inv_freq.data_ptr());

  const auto original = rope->freqs.clone();
  {
    torch::NoGradGuard no_grad;
    cloned->freqs.zero_();
  }
  EXPECT_TRUE(torch::equal(rope->freqs, original)) << "mutating the clone changed the original";
  const auto x = torch::randn({1, 2, 3, 16});
  EXPECT_TRUE(AllClose(rope->forward(x, 2), ref_rope(x, 2, false, std::nullopt, false, 123.0), kF32));
}

TEST_F(RotaryModule, ToDtypeKeepsComplex64Table) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(32).max_seq_len(64));
  const auto original = rope->freqs.clone();
  std::map<std::string, torch::Tensor> buffers_before;
  for (const auto& item : rope->named_buffers()) buffers_before[item.key()] = item.value().clone();
  const auto original_inv = rope->inv_freq.clone();
  EXPECT_EQ(buffers_before.size(), 2u);  // freqs and inv_freq
  auto check = [&](const char* what) {
    EXPECT_EQ(rope->freqs.scalar_type(), torch::kComplexFloat) << what;
    EXPECT_TRUE(torch::equal(rope->freqs, original)) << what;
    EXPECT_TRUE(rope->named_buffers()["freqs"].is_same(rope->freqs)) << what;
    EXPECT_EQ(rope->inv_freq.scalar_type(), torch::kDouble) << what;
    EXPECT_TRUE(torch::equal(rope->inv_freq, original_inv)) << what;
    EXPECT_TRUE(rope->named_buffers()["inv_freq"].is_same(rope->inv_freq)) << what;
    // No buffer (the table or any companion) is cast.
    for (const auto& item : rope->named_buffers()) {
      EXPECT_EQ(item.value().scalar_type(), buffers_before.at(item.key()).scalar_type()) << what << " " << item.key();
      EXPECT_TRUE(torch::equal(item.value(), buffers_before.at(item.key()))) << what << " " << item.key();
    }
  };
  rope->to(torch::kHalf);
  check("to(kHalf)");
  rope->to(torch::kBFloat16);
  check("to(kBFloat16)");
  rope->to(torch::kCPU, torch::kHalf);
  check("to(kCPU, kHalf)");
  rope->to(torch::kDouble);
  check("to(kDouble)");
  rope->to(torch::kCPU);
  check("to(kCPU)");

  // A half-precision model still gets fp32-accurate rotation.
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    const auto x = torch::randn({2, 2, 4, 32}).to(dtype);
    const auto y = rope->forward(x, 3);
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_TRUE(AllClose(y, ref_rope(x, 3), tolerance_for(dtype)));
  }
}

struct ParentImpl : torch::nn::Module {
  ParentImpl()
      : proj(register_module("proj", torch::nn::Linear(16, 16))),
        rope(register_module("rope", RotaryEmbedding(RotaryEmbeddingOptions(16).max_seq_len(32)))) {}
  torch::nn::Linear proj;
  RotaryEmbedding rope;
};
TORCH_MODULE(Parent);

TEST_F(RotaryModule, ParentModuleCastKeepsComplex64Table) {
  Parent parent;
  const auto original = parent->rope->freqs.clone();
  EXPECT_TRUE(parent->named_buffers().contains("rope.freqs"));

  parent->to(torch::kHalf);
  EXPECT_EQ(parent->proj->weight.scalar_type(), torch::kHalf);  // the rest of the model is cast
  EXPECT_EQ(parent->rope->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_TRUE(torch::equal(parent->rope->freqs, original));
  EXPECT_EQ(parent->named_buffers()["rope.freqs"].scalar_type(), torch::kComplexFloat);
  EXPECT_EQ(parent->rope->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_EQ(parent->named_buffers()["rope.inv_freq"].scalar_type(), torch::kDouble);

  parent->to(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(parent->proj->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(parent->rope->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_EQ(parent->rope->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(parent->rope->freqs, original));

  const auto x = torch::randn({1, 2, 3, 16}).to(torch::kBFloat16);
  EXPECT_TRUE(AllClose(parent->rope->forward(x, 1), ref_rope(x, 1), tolerance_for(torch::kBFloat16)));
}

TEST_F(RotaryModule, SaveLoadRoundTrip) {
  RotaryEmbedding saved(RotaryEmbeddingOptions(24).max_seq_len(40).theta(777.0));
  std::stringstream stream;
  torch::save(saved, stream);

  RotaryEmbedding loaded(RotaryEmbeddingOptions(24).max_seq_len(40).theta(777.0));
  {
    torch::NoGradGuard no_grad;
    loaded->freqs.zero_();  // so the comparison proves the load wrote it
    loaded->inv_freq.zero_();
  }
  torch::load(loaded, stream);
  EXPECT_EQ(loaded->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_TRUE(torch::equal(loaded->freqs, saved->freqs));
  EXPECT_TRUE(loaded->named_buffers()["freqs"].is_same(loaded->freqs));
  EXPECT_EQ(loaded->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(loaded->inv_freq, saved->inv_freq));
  EXPECT_TRUE(loaded->named_buffers()["inv_freq"].is_same(loaded->inv_freq));
  const auto x = torch::randn({1, 1, 5, 24});
  EXPECT_TRUE(torch::equal(loaded->forward(x, 3), saved->forward(x, 3)));
  EXPECT_TRUE(torch::equal(loaded->forward(x, 100), saved->forward(x, 100)));  // past max_seq_len: inv_freq
}

// ---- CUDA (skipped without a device and a CUDA build)

bool cuda_kernels_available() {
  if (!torch::cuda::is_available()) return false;
  const auto op = c10::Dispatcher::singleton().findSchema({"rotary::apply_rope", ""});
  return op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

TEST_F(RotaryModule, MoveToCudaKeepsComplex64Table) {
  if (!cuda_kernels_available()) GTEST_SKIP() << "needs a CUDA device and a CUDA build of rotary";
  RotaryEmbedding rope(RotaryEmbeddingOptions(64).max_seq_len(32));
  const auto original = rope->freqs.clone();
  rope->to(torch::kCUDA, torch::kHalf);
  EXPECT_TRUE(rope->freqs.is_cuda());
  EXPECT_EQ(rope->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_TRUE(torch::equal(rope->freqs.cpu(), original));
  const auto x = torch::randn({2, 4, 5, 64}).to(torch::kHalf);
  EXPECT_TRUE(AllClose(rope->forward(x.cuda(), 3), ref_rope(x, 3), tolerance_for(torch::kHalf)));
}

class ModuleOnDevice : public rotary_test::OnDevice {};

TEST_P(ModuleOnDevice, ModuleMovesToTheDeviceAndRunsThere) {
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(64).max_seq_len(128));
  rope->to(torch::Device(GetParam()));
  rope->to(torch::kHalf);
  EXPECT_EQ(rope->freqs.device().type(), GetParam());
  EXPECT_EQ(rope->freqs.scalar_type(), at::kComplexFloat);
  auto x = torch::randn({1, 2, 5, 64}, on(at::kHalf));
  auto y = rope->forward(x, 3);
  EXPECT_EQ(y.device().type(), GetParam());
  EXPECT_TRUE(at::allclose(y.cpu().to(at::kDouble), rotary_test::ref_rope(x, 3), 4e-3, 4e-3));
}

ROTARY_ON_DEVICES(ModuleOnDevice);

}  // namespace
