// rotary::RotaryEmbedding: its options, the cached complex64 table, forward
// passes, and argument errors (start positions past the table run, from
// inv_freq). Split by concern, to be read in one sitting: the buffers
// through clone / to / save / load and devices are in
// test_module_buffers.cpp.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <gtest/gtest.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;
using rotary_test::AllClose;
using rotary_test::ExpectError;
using rotary_test::ref_rope;
using rotary_test::RotaryModule;

using rotary_test::kF32;

// Largest |table - exp(i pos theta_j)| over the given rows, all in double.
double table_error(const torch::Tensor& freqs, int64_t dim, double theta, const std::vector<int64_t>& rows) {
  const auto re = torch::real(freqs).to(torch::kDouble).contiguous();
  const auto im = torch::imag(freqs).to(torch::kDouble).contiguous();
  auto re_a = re.accessor<double, 2>();
  auto im_a = im.accessor<double, 2>();
  double worst = 0.0;
  for (int64_t p : rows) {
    for (int64_t j = 0; j < dim / 2; ++j) {
      const auto e = rotary_test::ref_freq(p, j, dim, theta);
      worst = std::max({worst, std::abs(re_a[p][j] - e.real()), std::abs(im_a[p][j] - e.imag())});
    }
  }
  return worst;
}

TEST_F(RotaryModule, DefaultOptions) {
  const RotaryEmbeddingOptions opts(64);
  EXPECT_EQ(opts.dim(), 64);
  EXPECT_EQ(opts.max_seq_len(), 4096);
  EXPECT_DOUBLE_EQ(opts.theta(), 10000.0);
  EXPECT_TRUE(opts.interleaved());
  RotaryEmbedding rope(64);  // implicit options from dim
  EXPECT_EQ(rope->freqs.sizes(), torch::IntArrayRef({4096, 32}));
}

TEST_F(RotaryModule, FreqsBufferIsComplex64TableOfExactAngles) {
  struct Case {
    int64_t dim, len;
    double theta;
  };
  for (const auto& c : {Case{64, 4096, 10000.0}, Case{128, 1000, 500000.0}, Case{6, 33, 10.0}}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(c.dim).max_seq_len(c.len).theta(c.theta).interleaved(false));
    const auto& f = rope->freqs;
    ASSERT_EQ(f.scalar_type(), torch::kComplexFloat);
    ASSERT_EQ(f.sizes(), torch::IntArrayRef({c.len, c.dim / 2}));
    EXPECT_FALSE(f.requires_grad());
    const std::vector<int64_t> rows = {0, 1, 2, 7, c.len / 2, c.len - 2, c.len - 1};
    EXPECT_LE(table_error(f, c.dim, c.theta, rows), 1e-7) << "dim " << c.dim << " theta " << c.theta;
  }
}

TEST_F(RotaryModule, ForwardMatchesReference) {
  const int64_t D = 64, L = 128;
  for (bool interleaved : {true, false}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(D).max_seq_len(L).theta(50000.0).interleaved(interleaved));
    const auto x = torch::randn({2, 4, 6, D});
    EXPECT_TRUE(AllClose(rope->forward(x), ref_rope(x, 0, interleaved, std::nullopt, false, 50000.0), kF32));
    EXPECT_TRUE(AllClose(rope->forward(x, 17), ref_rope(x, 17, interleaved, std::nullopt, false, 50000.0), kF32));
    // start_pos + seq_len == max_seq_len is allowed.
    EXPECT_TRUE(AllClose(rope->forward(x, L - 6), ref_rope(x, L - 6, interleaved, std::nullopt, false, 50000.0), kF32));
  }
}

TEST_F(RotaryModule, ForwardQkMatchesReference) {
  const int64_t D = 80, L = 64;
  for (bool interleaved : {true, false}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(D).max_seq_len(L).interleaved(interleaved));
    const auto q = torch::randn({2, 8, 5, D});
    const auto k = torch::randn({2, 2, 5, D});
    const auto [yq, yk] = rope->forward(q, k, 9);
    EXPECT_TRUE(AllClose(yq, ref_rope(q, 9, interleaved), kF32));
    EXPECT_TRUE(AllClose(yk, ref_rope(k, 9, interleaved), kF32));
    const auto [dq, dk] = rope->forward(q.narrow(2, 0, 1), k.narrow(2, 0, 1), L - 1);  // decode, last row
    EXPECT_TRUE(AllClose(dq, ref_rope(q.narrow(2, 0, 1), L - 1, interleaved), kF32));
    EXPECT_TRUE(AllClose(dk, ref_rope(k.narrow(2, 0, 1), L - 1, interleaved), kF32));
  }
}

TEST_F(RotaryModule, ForwardGradient) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  auto x = torch::randn({1, 2, 3, 16}, torch::kDouble).requires_grad_();
  const auto g = torch::randn({1, 2, 3, 16}, torch::kDouble);
  (rope->forward(x, 4) * g).sum().backward();
  EXPECT_TRUE(AllClose(x.grad(), ref_rope(g, 4, true, std::nullopt, true), {1e-6, 0.0}));
}

// BUG (csrc/rotary/module.h): forward is overloaded, so libtorch's
// forward is overloaded (x, or q and k); the holder's call operator must
// still return what forward returns.
TEST_F(RotaryModule, HolderCallOperatorReturnsForwardResult) {
  using OneResult = decltype(std::declval<RotaryEmbedding&>()(std::declval<const torch::Tensor&>()));
  using TwoResult = decltype(std::declval<RotaryEmbedding&>()(
      std::declval<const torch::Tensor&>(), std::declval<const torch::Tensor&>()));
  static_assert(std::is_same_v<OneResult, torch::Tensor>);
  static_assert(std::is_same_v<TwoResult, std::tuple<torch::Tensor, torch::Tensor>>);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(10));
  const auto x = torch::randn({1, 2, 3, 8});
  EXPECT_TRUE(torch::equal(rope(x, 2), rope->forward(x, 2)));
}

TEST_F(RotaryModule, PrettyPrint) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(16).theta(500.0).interleaved(false));
  std::ostringstream os;
  os << *rope;
  EXPECT_EQ(os.str(), "rotary::RotaryEmbedding(dim=8, max_seq_len=16, theta=500, interleaved=false)");
}

// ---- errors

TEST_F(RotaryModule, DimOddOrZeroIsRejected) {
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(7)); }, {"RotaryEmbedding", "dim must be even and > 0, got 7"});
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(0)); }, {"RotaryEmbedding", "dim must be even and > 0, got 0"});
  ExpectError<c10::ValueError>(
      [] { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(0)); },
      {"RotaryEmbedding", "max_seq_len must be > 0, got 0"});
}

// Past max_seq_len the module is no error: it passes its float64 inv_freq,
// so the rows past the cached table are computed exactly. (The op without
// inv_freq still raises; see RopeErrors.StartPosOutOfRange.)
TEST_F(RotaryModule, StartPosBeyondMaxSeqLen) {
  for (bool interleaved : {true, false}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(16).interleaved(interleaved));
    const auto x = torch::randn({1, 2, 8, 8});
    const auto k = torch::randn({1, 1, 8, 8});
    const auto x_before = x.clone(), k_before = k.clone();
    EXPECT_TRUE(AllClose(rope->forward(x, 10), ref_rope(x, 10, interleaved), kF32));  // 10 + 8 = 18 > 16
    const auto [yq, yk] = rope->forward(x, k, 9);                                       // 9 + 8 = 17 > 16
    EXPECT_TRUE(AllClose(yq, ref_rope(x, 9, interleaved), kF32));
    EXPECT_TRUE(AllClose(yk, ref_rope(k, 9, interleaved), kF32));
    EXPECT_TRUE(AllClose(rope->forward(x, 16), ref_rope(x, 16, interleaved), kF32));  // entirely past the table
    EXPECT_TRUE(AllClose(rope->forward(x, 100000), ref_rope(x, 100000, interleaved), kF32));
    const auto [fq, fk] = rope->forward(x.narrow(2, 0, 1), k.narrow(2, 0, 1), 1000);  // decode far past the table
    EXPECT_TRUE(AllClose(fq, ref_rope(x.narrow(2, 0, 1), 1000, interleaved), kF32));
    EXPECT_TRUE(AllClose(fk, ref_rope(k.narrow(2, 0, 1), 1000, interleaved), kF32));
    EXPECT_TRUE(torch::equal(x, x_before)) << "x was modified";
    EXPECT_TRUE(torch::equal(k, k_before)) << "k was modified";
    EXPECT_EQ(rope->freqs.sizes(), torch::IntArrayRef({16, 4})) << "the cached table is not grown";
    // The same call through the op, without inv_freq, is still out of range.
    ExpectError<c10::IndexError>(
        [&] { rotary::apply_rope(x, rope->freqs, 10, interleaved); },
        {"apply_rope", "start_pos + seq_len = 10 + 8 = 18", "exceeds the freqs table length (max_seq_len) 16"});
  }
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(16));
  const auto x = torch::randn({1, 2, 8, 8});
  ExpectError<c10::ValueError>([&] { rope->forward(x, -1); }, {"RotaryEmbedding", "start_pos must be >= 0, got -1"});
  ExpectError<c10::ValueError>(
      [&] { rope->forward(x, x, -3); }, {"RotaryEmbedding", "start_pos must be >= 0, got -3"});
  ExpectError<c10::IndexError>(
      [&] { rope->forward(x, int64_t{1} << 60); },
      {"RotaryEmbedding", "start_pos must be < 2^60, got 1152921504606846976"});
  ExpectError<c10::IndexError>(
      [&] { rope->forward(x, x, (int64_t{1} << 60) + 1); },
      {"RotaryEmbedding", "start_pos must be < 2^60, got 1152921504606846977"});
}

// Regression: RotaryEmbeddingImpl::check_range computed start_pos + seq_len
// in int64, which overflows for start_pos near INT64_MAX; at 437492f neither
// the module nor the op rejected it and the kernel read outside the table.
TEST_F(RotaryModule, HugeStartPosDoesNotOverflowRangeCheck) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(16));
  const auto x = torch::ones({1, 1, 2, 8});
  ExpectError<c10::IndexError>(
      [&] { rope->forward(x, std::numeric_limits<int64_t>::max()); },
      {"RotaryEmbedding", "start_pos must be < 2^60, got 9223372036854775807"});
  ExpectError<c10::IndexError>(
      [&] { rope->forward(x, x, std::numeric_limits<int64_t>::max() - 1); },
      {"RotaryEmbedding", "start_pos must be < 2^60, got 9223372036854775806"});
}

// dim > input head_dim: the module names its own dim, not the table's shape.
TEST_F(RotaryModule, InputHeadDimBelowDimIsRejected) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  ExpectError<c10::ValueError>(
      [&] { rope->forward(torch::randn({1, 2, 3, 8})); },
      {"RotaryEmbedding(dim=16): head_dim must be >= dim (the rotated width), got head_dim 8 (shape [1, 2, 3, 8])"});
  ExpectError<c10::ValueError>(
      [&] { rope->forward(torch::randn({1, 2, 3, 8}), torch::randn({1, 1, 3, 8})); },
      {"RotaryEmbedding(dim=16)", "head_dim must be >= dim", "got head_dim 8"});
  ExpectError<c10::ValueError>(
      [&] { rope->forward(torch::randn({2, 3, 16})); },
      {"apply_rope",
       "x must be 4-D [batch, heads, seq_len, head_dim], got shape [2, 3, 16] (layout BHSD); a 3-D [total_tokens, "
       "heads, head_dim] input needs cu_seqlens"});
}

// dim < input head_dim is partial rotary: dims [0, dim) rotate, the rest
// pass through unchanged.
TEST_F(RotaryModule, DimBelowInputHeadDimRotatesLeadingDims) {
  for (bool interleaved : {true, false}) {
    RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16).interleaved(interleaved));
    const auto q = torch::randn({2, 4, 5, 24});
    const auto k = torch::randn({2, 2, 5, 24});
    const auto q_before = q.clone(), k_before = k.clone();
    auto ref = [&](const torch::Tensor& t, int64_t start) {
      return torch::cat({ref_rope(t.narrow(3, 0, 16), start, interleaved), t.narrow(3, 16, 8).to(torch::kDouble)}, 3);
    };
    const auto y = rope->forward(q, 3);
    EXPECT_TRUE(AllClose(y, ref(q, 3), kF32));
    EXPECT_TRUE(torch::equal(y.narrow(3, 16, 8), q.narrow(3, 16, 8))) << "pass-through dims changed";
    const auto [yq, yk] = rope->forward(q, k, 14);  // 14 + 5 > max_seq_len as well
    EXPECT_TRUE(AllClose(yq, ref(q, 14), kF32));
    EXPECT_TRUE(AllClose(yk, ref(k, 14), kF32));
    EXPECT_TRUE(torch::equal(q, q_before) && torch::equal(k, k_before)) << "inputs were modified";
  }
}

}  // namespace
