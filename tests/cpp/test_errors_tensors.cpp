// Argument validation of the functional API, the tensors themselves: rank
// and head_dim, dtypes, the freqs table's dtype and shape, q against k, a
// freqs table that requires grad, meta tensors, rope_freqs' arguments and
// devices. Each bad input raises the right c10 exception type (ValueError /
// TypeError / IndexError, i.e. Python's ValueError / TypeError /
// IndexError) with a message naming the argument and the offending sizes.
// The argument errors are split by concern, to be read in one sitting:
// positions (start_pos, offsets, position_ids) are in
// test_errors_positions.cpp, one table across every entry point in
// test_bad_input_matrix.cpp.
#include "helpers.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/cuda.h>
#include <gtest/gtest.h>

#include <limits>
#include <optional>

namespace {

using rotary_test::ExpectError;
using rotary_test::freqs8;

using rotary_test::randn;

TEST(RopeErrors, OddHeadDim) {
  const auto freqs = rotary::rope_freqs(8, 16);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 7}), freqs); },
      {"apply_rope", "x.size(-1) (head_dim) must be even and > 0", "got 7", "[1, 2, 3, 7]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 2, 3, 5}), freqs); },
      {"apply_rope_qk", "k.size(-1) (head_dim) must be even", "got 5", "[1, 2, 3, 5]"});
}

TEST(RopeErrors, ZeroHeadDim) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(at::empty({1, 2, 3, 0}), freqs8()); },
      {"x.size(-1) (head_dim) must be even and > 0", "got 0", "[1, 2, 3, 0]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(at::empty({1, 2, 3, 0}), at::empty({1, 2, 3, 0}), freqs8()); },
      {"apply_rope_qk", "q.size(-1)", "got 0"});
}

TEST(RopeErrors, ThreeDimInput) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({2, 3, 8}), freqs8()); },
      {"apply_rope",
       "x must be 4-D [batch, heads, seq_len, head_dim], got shape [2, 3, 8] (layout BHSD); a 3-D [total_tokens, "
       "heads, head_dim] input needs cu_seqlens"});
  // Other layouts name their own dim order.
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope(randn({2, 3, 8}), freqs8(), 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BSHD");
      },
      {"x must be 4-D [batch, seq_len, heads, head_dim], got shape [2, 3, 8] (layout BSHD)", "needs cu_seqlens"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({2, 3, 8}), freqs8()); },
      {"apply_rope_qk", "k must be 4-D", "[2, 3, 8]"});
}

TEST(RopeErrors, FiveDimInput) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 4, 8}), freqs8()); },
      {"x must be 4-D [batch, heads, seq_len, head_dim], got shape [1, 2, 3, 4, 8] (layout BHSD)"});
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope(
            randn({1, 2, 3, 4, 8}), freqs8(), 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "SBHD");
      },
      {"x must be 4-D [seq_len, batch, heads, head_dim], got shape [1, 2, 3, 4, 8] (layout SBHD)"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 4, 8}), randn({1, 2, 3, 8}), freqs8()); },
      {"q must be 4-D", "[1, 2, 3, 4, 8]"});
}

TEST(RopeErrors, FreqsComplex128) {
  const auto freqs = rotary::rope_freqs(8, 16).to(at::kComplexDouble);
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); },
      {"apply_rope", "freqs must be complex64", "got ComplexDouble"});
}

TEST(RopeErrors, FreqsRealFloat) {
  const auto freqs = at::view_as_real(rotary::rope_freqs(8, 16)).select(-1, 0).contiguous();  // float32 [16, 4]
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); }, {"freqs must be complex64", "got Float"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 1, 3, 8}), freqs); },
      {"apply_rope_qk", "freqs must be complex64", "got Float"});
}

TEST(RopeErrors, FreqsWrongRank) {
  const auto f = rotary::rope_freqs(8, 16);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f.unsqueeze(0)); },
      {"freqs must have shape [max_seq_len, ", "[*, 4]", "head_dim", "got [1, 16, 4]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f.select(0, 0)); },
      {"freqs must have shape", "got [4]"});
}

// A table narrower than head_dim / 2 is partial rotary (valid; see the
// partial-rotary tests); wider than head_dim / 2, or 0 wide, is an error.
TEST(RopeErrors, FreqsWiderThanHeadDim) {
  const auto f = rotary::rope_freqs(16, 16);  // [16, 8]: for head_dim 16
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), f); },
      {"apply_rope",
       "freqs must have shape [max_seq_len, rotary_dim / 2] with 0 < rotary_dim <= head_dim = 8 (full rotation: "
       "[*, 4]), got [16, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), randn({1, 2, 3, 8}), f); },
      {"apply_rope_qk", "0 < rotary_dim <= head_dim = 8 (full rotation: [*, 4]), got [16, 8]"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs8().narrow(1, 0, 0)); },
      {"apply_rope", "0 < rotary_dim <= head_dim = 8", "got [16, 0]"});
}

TEST(RopeErrors, QkDifferentBatch) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({3, 4, 5, 8}), freqs8()); },
      {"apply_rope_qk", "k must match q in batch, seq_len and head_dim", "q has shape [2, 4, 5, 8]",
       "k has shape [3, 4, 5, 8]"});
}

TEST(RopeErrors, QkDifferentSeqLen) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 6, 8}), freqs8()); },
      {"k must match q", "q has shape [2, 4, 5, 8]", "k has shape [2, 4, 6, 8]"});
}

TEST(RopeErrors, QkDifferentHeadDim) {
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 5, 6}), freqs8()); },
      {"k must match q", "q has shape [2, 4, 5, 8]", "k has shape [2, 4, 5, 6]"});
}

TEST(RopeErrors, QkDifferentDtype) {
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({2, 4, 5, 8}), randn({2, 4, 5, 8}, at::kHalf), freqs8()); },
      {"apply_rope_qk", "k has dtype Half but q has dtype Float", "must share one dtype"});
}

TEST(RopeErrors, IntegerInput) {
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(at::ones({1, 2, 3, 8}, at::kInt), freqs8()); },
      {"apply_rope", "x must be float32, float64, float16 or bfloat16", "got Int"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope_qk(randn({1, 2, 3, 8}), at::ones({1, 2, 3, 8}, at::kLong), freqs8()); },
      {"apply_rope_qk", "k must be float32, float64, float16 or bfloat16", "got Long"});
  ExpectError<c10::TypeError>(
      [&] { rotary::apply_rope(rotary::rope_freqs(16, 4).view({1, 1, 4, 8}), freqs8()); },
      {"x must be float32", "got ComplexFloat"});
}

TEST(RopeErrors, FreqsRequiringGradAreRejected) {
  const auto freqs = rotary::rope_freqs(8, 16).requires_grad_();
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(randn({1, 2, 3, 8}), freqs); }, {"freqs requires grad", "freqs.detach()"});
}

TEST(RopeErrors, ErrorsAreRaisedForMetaTensorsToo) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  const auto freqs = rotary::rope_freqs(8, 16).to(at::kMeta);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(at::empty({1, 2, 3, 7}, meta), freqs); }, {"x.size(-1)", "got 7"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(at::empty({2, 4, 5, 8}, meta), at::empty({3, 4, 5, 8}, meta), freqs); },
      {"k must match q", "k has shape [3, 4, 5, 8]"});
}

TEST(RopeFreqsErrors, InvalidArguments) {
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(7, 16); }, {"rope_freqs", "dim must be even and > 0, got 7"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(0, 16); }, {"dim must be even and > 0, got 0"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(8, -1); }, {"max_seq_len must be >= 0, got -1"});
  ExpectError<c10::ValueError>([] { rotary::rope_freqs(8, 16, 0.0); }, {"theta must be finite and > 0, got 0"});
  ExpectError<c10::ValueError>(
      [] { rotary::rope_freqs(8, 16, std::numeric_limits<double>::quiet_NaN()); }, {"theta must be finite"});
}

TEST(RopeErrors, DeviceMismatch) {
  // Dispatch picks the CUDA kernel as soon as any argument is on CUDA, so the
  // check needs a CUDA build as well as a device.
  const auto op = c10::Dispatcher::singleton().findSchema({"rotary::apply_rope", ""});
  if (!torch::cuda::is_available() || !op || !op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) {
    GTEST_SKIP() << "needs a CUDA device and a CUDA build of rotary";
  }
  const auto x_cpu = randn({1, 2, 3, 8});
  const auto x_cuda = x_cpu.to(at::kCUDA);
  const auto freqs_cuda = freqs8().to(at::kCUDA);
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cuda, freqs8()); }, {"apply_rope", "freqs is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope_qk(x_cuda, x_cpu, freqs_cuda); }, {"apply_rope_qk", "k is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cuda, freqs_cuda, 0, true, at::zeros({1}, at::kLong)); },
      {"offsets is on cpu but q/x is on cuda:0"});
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x_cpu, freqs_cuda); }, {"freqs is on cuda:0 but q/x is on cpu"});
}

}  // namespace
