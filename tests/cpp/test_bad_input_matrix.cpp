// One table of bad inputs across every public entry point: each raises the
// right c10 exception type with a message naming the argument, and leaves
// its inputs bitwise unchanged; then the other side of the in-place ops'
// overlap check, disjoint views that interleave are rotated. A file of its
// own to be read in one sitting; each argument's own checks are in
// test_errors_tensors.cpp and test_errors_positions.cpp.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

// ==== Added with "Exact, hard to misuse": one table of bad inputs across
// every public entry point (apply_rope, apply_rope_qk, apply_rope_,
// apply_rope_qk_, rope_freqs / freqs_table / freqs_at, RotaryEmbedding and
// its torch::load). Each row: the exception type, substrings naming the
// argument, and the inputs, which must come out bitwise unchanged.
namespace {

using rotary_test::ExpectError;
using rotary_test::freqs8;
using rotary_test::randn;

enum class Err { Value, Type, Index };

struct BadInput {
  std::string name;
  Err err;
  std::vector<std::string> parts;
  std::vector<at::Tensor> inputs;                         // checked unchanged afterwards
  std::function<void(std::vector<at::Tensor>&)> call;     // gets the inputs
};

using rotary_test::longs;

std::vector<BadInput> bad_inputs() {
  const auto f = [] { return rotary::rope_freqs(8, 16); };
  const auto r = [](std::vector<int64_t> s) { return at::randn(s); };
  using T = std::vector<at::Tensor>;
  using rotary::RotaryEmbedding;
  using rotary::RotaryEmbeddingOptions;
  std::vector<BadInput> v = {
      // ---- apply_rope
      {"rank-3-without-cu_seqlens", Err::Value, {"apply_rope: x must be 4-D", "[2, 3, 8]"}, T{r({2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"odd-head-dim", Err::Value, {"apply_rope: x.size(-1) (head_dim) must be even and > 0, got 7"},
       T{r({1, 2, 3, 7}), rotary::rope_freqs(6, 16)}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"zero-head-dim", Err::Value, {"head_dim) must be even and > 0, got 0"}, T{at::empty({1, 2, 3, 0}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"rotary-dim-gt-head-dim", Err::Value, {"apply_rope: freqs must have shape", "rotary_dim <= head_dim = 6"},
       T{r({1, 2, 3, 6}), f()}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"freqs-float32", Err::Type, {"apply_rope: freqs must be complex64", "got Float"},
       T{r({1, 2, 3, 8}), at::view_as_real(f()).select(-1, 0).contiguous()},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"freqs-3d", Err::Value, {"freqs must have shape", "got [1, 16, 4]"}, T{r({1, 2, 3, 8}), f().unsqueeze(0)},
       [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"int-input", Err::Type, {"apply_rope: x must be float32, float64, float16 or bfloat16", "got Int"},
       T{at::ones({1, 2, 3, 8}, at::kInt), f()}, [](T& t) { rotary::apply_rope(t[0], t[1]); }},
      {"offsets-float", Err::Type, {"apply_rope: offsets must have an integer dtype", "got Float"},
       T{r({2, 2, 3, 8}), f(), at::ones({2})}, [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"offsets-wrong-shape", Err::Value, {"offsets must have shape [] or [batch]", "got [2, 4]"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 4}, at::kLong)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"position-ids-wrong-shape", Err::Value, {"position_ids must have shape [seq_len] or [batch, seq_len]", "got [2, 4]"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 4}, at::kLong)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, t[2]); }},
      {"position-ids-with-start-pos", Err::Value, {"start_pos must be 0 with position_ids"},
       T{r({2, 2, 3, 8}), f(), at::zeros({2, 3}, at::kInt)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 1, true, std::nullopt, t[2]); }},
      {"offsets-out-of-table", Err::Index, {"token (batch 1, seq 2) has position 16", "[0, 16)"},
       T{r({2, 2, 3, 8}), f(), longs({0, 14})}, [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, t[2]); }},
      {"start-pos-out-of-table", Err::Index, {"start_pos + seq_len = 14 + 3 = 17", "exceeds",
       "build the table with max_seq_len > 16 (the ops also take inv_freq)"},
       T{r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope(t[0], t[1], 14); }},
      {"negative-start-pos", Err::Value, {"apply_rope: start_pos must be >= 0, got -1"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope(t[0], t[1], -1); }},
      {"bad-layout", Err::Value, {"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'HBSD'"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) {
         rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "HBSD");
       }},
      {"inv-freq-float32", Err::Type, {"inv_freq must be float64, got Float"}, T{r({1, 2, 3, 8}), f(), at::ones({4})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, std::nullopt, t[2]); }},
      {"cu-seqlens-not-monotonic", Err::Value, {"cu_seqlens must start at 0, never decrease", "[0, 3, 2, 5]"},
       T{r({5, 2, 8}), f(), longs({0, 3, 2, 5})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-not-starting-at-0", Err::Value, {"cu_seqlens must start at 0", "[1, 3, 5]"},
       T{r({5, 2, 8}), f(), longs({1, 3, 5})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-not-ending-at-T", Err::Value, {"end at total_tokens = 5", "got [0, 3, 4]"},
       T{r({5, 2, 8}), f(), at::tensor(std::vector<int32_t>{0, 3, 4}, at::kInt)},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      {"cu-seqlens-float", Err::Type, {"cu_seqlens must be int32 or int64, got Float"},
       T{r({5, 2, 8}), f(), at::zeros({2})},
       [](T& t) { rotary::apply_rope(t[0], t[1], 0, true, std::nullopt, std::nullopt, false, t[2]); }},
      // ---- apply_rope_qk
      {"qk-batch-mismatch", Err::Value, {"apply_rope_qk: k must match q", "k has shape [1, 2, 3, 8]"},
       T{r({2, 2, 3, 8}), r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-seq-mismatch", Err::Value, {"apply_rope_qk: k must match q", "k has shape [2, 2, 4, 8]"},
       T{r({2, 2, 3, 8}), r({2, 2, 4, 8}), f()}, [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-dtype-mismatch", Err::Type, {"k has dtype Double but q has dtype Float"},
       T{r({2, 2, 3, 8}), r({2, 2, 3, 8}).to(at::kDouble), f()},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-k-int", Err::Type, {"apply_rope_qk: k must be float32"}, T{r({2, 2, 3, 8}), at::ones({2, 2, 3, 8}, at::kLong), f()},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2]); }},
      {"qk-offsets-double", Err::Type, {"apply_rope_qk: offsets must have an integer dtype", "got Double"},
       T{r({2, 2, 3, 8}), r({2, 1, 3, 8}), f(), at::zeros({2}, at::kDouble)},
       [](T& t) { rotary::apply_rope_qk(t[0], t[1], t[2], 0, true, t[3]); }},
      // ---- apply_rope_ / apply_rope_qk_
      {"inplace-leaf-requires-grad", Err::Value, {"apply_rope_: x requires grad", "not differentiable"},
       T{r({1, 2, 3, 8}).requires_grad_(), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"inplace-expanded", Err::Value, {"apply_rope_: x has elements sharing memory (an expanded view?)"},
       T{r({1, 1, 3, 8}), f()}, [](T& t) {
         auto e = t[0].expand({2, 2, 3, 8});
         rotary::apply_rope_(e, t[1]);
       }},
      {"inplace-odd-head-dim", Err::Value, {"apply_rope_: x.size(-1) (head_dim) must be even"},
       T{r({1, 2, 3, 7}), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"inplace-start-pos-out-of-table", Err::Index, {"apply_rope_: start_pos + seq_len = 15 + 3 = 18"},
       T{r({1, 2, 3, 8}), f()}, [](T& t) { rotary::apply_rope_(t[0], t[1], 15); }},
      {"qk-inplace-same-tensor", Err::Value, {"apply_rope_qk_: q and k overlap in memory"}, T{r({1, 2, 3, 8}), f()},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[0], t[1]); }},
      {"qk-inplace-overlapping-slices", Err::Value, {"apply_rope_qk_: q and k overlap in memory"},
       T{r({1, 3, 3, 8}), f()}, [](T& t) {
         auto q = t[0].slice(1, 0, 2);
         auto k = t[0].slice(1, 1, 3);
         rotary::apply_rope_qk_(q, k, t[1]);
       }},
      {"qk-inplace-partial-overlap-last-dim", Err::Value, {"apply_rope_qk_: q and k overlap in memory"},
       T{r({1, 2, 4, 12}), f()}, [](T& t) {
         auto q = t[0].slice(3, 0, 8);
         auto k = t[0].slice(3, 4, 12);
         rotary::apply_rope_qk_(q, k, t[1]);
       }},
      {"inplace-as-strided-self-overlap", Err::Value, {"apply_rope_: x has elements sharing memory"},
       T{r({64}), f()}, [](T& t) {
         auto x = t[0].as_strided({1, 1, 4, 8}, {32, 32, 4, 1});
         rotary::apply_rope_(x, t[1]);
       }},
      {"qk-inplace-k-self-overlap", Err::Value, {"apply_rope_qk_: k has elements sharing memory"},
       T{r({1, 2, 3, 8}), r({64}), f()}, [](T& t) {
         auto k = t[1].as_strided({1, 2, 3, 8}, {0, 8, 6, 1});
         rotary::apply_rope_qk_(t[0], k, t[2]);
       }},
      {"inplace-x-aliases-freqs", Err::Value, {"apply_rope_: x and freqs overlap in memory"},
       T{f().clone()}, [](T& t) {
         auto x = at::view_as_real(t[0]).view({1, 1, 16, 8});
         rotary::apply_rope_(x, t[0]);
       }},
      {"inplace-freqs-requires-grad", Err::Value, {"rotary: freqs requires grad"},
       T{r({1, 2, 3, 8}), f().clone().requires_grad_()}, [](T& t) { rotary::apply_rope_(t[0], t[1]); }},
      {"qk-inplace-k-requires-grad", Err::Value, {"apply_rope_qk_: k requires grad"},
       T{r({1, 2, 3, 8}), r({1, 2, 3, 8}).requires_grad_(), f()},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[1], t[2]); }},
      {"qk-inplace-cu-seqlens-past-T", Err::Value, {"apply_rope_qk_: cu_seqlens must start at 0", "[0, 3, 6]"},
       T{r({5, 2, 8}), r({5, 1, 8}), f(), longs({0, 3, 6})},
       [](T& t) { rotary::apply_rope_qk_(t[0], t[1], t[2], 0, true, std::nullopt, std::nullopt, false, t[3]); }},
      // ---- table builders
      {"rope-freqs-odd-dim", Err::Value, {"rope_freqs: dim must be even and > 0, got 7"}, T{},
       [](T&) { rotary::rope_freqs(7, 16); }},
      {"rope-freqs-angle-dtype", Err::Value, {"rope_freqs: angle_dtype must be float64", "got Half"}, T{},
       [](T&) { rotary::rope_freqs(8, 16, 1e4, rotary::RopeScaling(), 0, at::kHalf); }},
      {"freqs-table-negative-len", Err::Value, {"freqs_table: max_seq_len must be >= 0, got -1"}, T{},
       [](T&) { rotary::freqs_table(rotary::compute_frequencies(8, 1e4), -1); }},
      {"freqs-at-negative-position", Err::Value, {"freqs_at: positions must be >= 0, got -3 at index 1"},
       T{longs({0, -3})}, [](T& t) { rotary::freqs_at(rotary::compute_frequencies(8, 1e4), t[0]); }},
      {"freqs-at-int32-positions", Err::Type, {"freqs_at: positions must be int64, got Int"},
       T{at::zeros({2}, at::kInt)}, [](T& t) { rotary::freqs_at(rotary::compute_frequencies(8, 1e4), t[0]); }},
      {"scaling-unknown-type", Err::Value, {"unknown type (rope_type) 'ntk-by-parts'"}, T{},
       [](T&) { rotary::compute_frequencies(8, 1e4, rotary::RopeScaling("ntk-by-parts")); }},
      // ---- RotaryEmbedding
      {"module-odd-dim", Err::Value, {"RotaryEmbedding: dim must be even and > 0, got 7"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(7)); }},
      {"module-zero-len", Err::Value, {"RotaryEmbedding: max_seq_len must be > 0, got 0"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(0)); }},
      {"module-angle-dtype", Err::Value, {"RotaryEmbedding: angle_dtype must be float64", "got BFloat16"}, T{},
       [](T&) { RotaryEmbedding(RotaryEmbeddingOptions(8).angle_dtype(torch::kBFloat16)); }},
      {"module-negative-start", Err::Value, {"RotaryEmbedding: start_pos must be >= 0, got -2"}, T{r({1, 2, 3, 8})},
       [](T& t) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16))->forward(t[0], -2); }},
      {"module-qk-mismatch", Err::Value, {"apply_rope_qk: k must match q"}, T{r({1, 2, 3, 8}), r({1, 2, 4, 8})},
       [](T& t) { RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16))->forward(t[0], t[1]); }},
      {"module-fp32-angles-past-table", Err::Index, {"RotaryEmbedding(angle_dtype=float32)", "exceeds max_seq_len 16"},
       T{r({1, 2, 3, 8})}, [](T& t) {
         RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).angle_dtype(torch::kFloat32))->forward(t[0], 14);
       }},
      {"module-load-other-theta", Err::Value, {"RotaryEmbedding.load: the saved tables do not match", "theta=10000"},
       T{}, [](T&) {
         std::stringstream s;
         torch::save(RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).theta(500.0)), s);
         RotaryEmbedding m(RotaryEmbeddingOptions(8).max_seq_len(16));
         torch::load(m, s);
       }},
  };
  return v;
}

TEST(BadInputMatrix, EveryEntryPointRejectsAndLeavesInputsAlone) {
  const auto cases = bad_inputs();
  ASSERT_GE(cases.size(), 30u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto inputs = c.inputs;
    std::vector<at::Tensor> saved;
    for (const auto& t : inputs) saved.push_back(t.detach().clone());
    auto run = [&] { c.call(inputs); };
    switch (c.err) {
      case Err::Value: ExpectError<c10::ValueError>(run, c.parts); break;
      case Err::Type: ExpectError<c10::TypeError>(run, c.parts); break;
      case Err::Index: ExpectError<c10::IndexError>(run, c.parts); break;
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_TRUE(at::equal(inputs[i].detach(), saved[i])) << "input " << i << " was modified";
    }
  }
}

// In place, any strides are decided exactly: disjoint views run, however
// their elements interleave; views that share an element are refused above.
TEST(InPlaceOverlap, DisjointInterleavedViewsAreRotated) {
  const at::Tensor buf = randn({1, 2, 3, 16}, at::kDouble);
  at::Tensor q = buf.slice(3, 0, 16, 2), k = buf.slice(3, 1, 16, 2);  // even and odd elements
  const at::Tensor eq = rotary_test::ref_rope(q, 2), ek = rotary_test::ref_rope(k, 2);
  rotary::apply_rope_qk_(q, k, freqs8(), 2);
  EXPECT_TRUE(rotary_test::AllClose(q, eq, rotary_test::tolerance_for(at::kDouble)));
  EXPECT_TRUE(rotary_test::AllClose(k, ek, rotary_test::tolerance_for(at::kDouble)));
}

TEST(InPlaceOverlap, IrregularDistinctStridesAreRotated) {
  // Offsets {0, 2, 4} + {0, 3}: six distinct elements, though stride 2
  // times size 3 passes the other stride (torch calls this TooHard).
  const at::Tensor base = randn({8}, at::kDouble);
  at::Tensor x = base.as_strided({1, 1, 3, 2}, {8, 8, 2, 3});
  const at::Tensor expected = rotary_test::ref_rope(x, 1);
  rotary::apply_rope_(x, rotary::rope_freqs(2, 8), 1);
  EXPECT_TRUE(rotary_test::AllClose(x, expected, rotary_test::tolerance_for(at::kDouble)));
}

}  // namespace
