// apply_rope_cos_sin from C++ (rotary/ops.h): Hugging Face's cos/sin pair and
// vLLM's cos_sin_cache with ids, against the float64 rotation of the same
// positions, on every device; a table that is not RoPE's is refused.
#include "helpers.h"
#include "reference.h"

#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

namespace {

using rotary_test::AllClose;
using rotary_test::tolerance_for;

// float64 angles [rows, D / 2] of positions `pos` with base 10000.
at::Tensor angles(const at::Tensor& pos, int64_t D) {
  const at::Tensor j = at::arange(D / 2, at::kDouble);
  return pos.to(at::kDouble).unsqueeze(-1) * at::pow(10000.0, -2.0 * j / D);
}

// The call raises a c10::Error whose text holds `message`.
template <typename F>
void expect_error(F&& call, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "no error for: " << message;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

class CosSin : public rotary_test::OnDevice {};

TEST_P(CosSin, HfTablesAndCosSinCacheMatchReference) {
  const int64_t B = 2, Hq = 4, Hk = 2, S = 5, D = 16, start = 3;
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const auto q = at::randn({B, Hq, S, D}, on(dtype)), k = at::randn({B, Hk, S, D}, on(dtype));
    const at::Tensor a = angles(at::arange(start, start + S, at::kLong), D);  // [S, D / 2]
    const at::Tensor cos = at::cat({a.cos(), a.cos()}, -1).to(on(at::kFloat));
    const at::Tensor sin = at::cat({a.sin(), a.sin()}, -1).to(on(at::kFloat));
    auto tol = tolerance_for(dtype);
    if (dtype == at::kDouble) tol = {1e-6, 1e-6};  // the tables are read in float32
    const auto [oq, ok] = rotary::apply_rope_cos_sin(q, k, cos, sin);
    EXPECT_TRUE(AllClose(oq, rotary_test::ref_rope(q, start, false), tol));
    EXPECT_TRUE(AllClose(ok, rotary_test::ref_rope(k, start, false), tol));

    // The cache [max_pos, D] (D / 2 cos then D / 2 sin), rows start.. by id.
    const at::Tensor all = angles(at::arange(0, 32, at::kLong), D);
    const at::Tensor cache = at::cat({all.cos(), all.sin()}, -1).to(on(at::kFloat));
    const at::Tensor ids = at::arange(start, start + S, on(at::kLong));
    const auto [cq, ck] = rotary::apply_rope_cos_sin(q, k, cache, std::nullopt, ids);
    EXPECT_TRUE(AllClose(cq, rotary_test::ref_rope(q, start, false), tol));
    EXPECT_TRUE(AllClose(ck, rotary_test::ref_rope(k, start, false), tol));
  }
}

TEST_P(CosSin, RefusesWhatIsNotARopeTable) {
  const auto q = at::randn({1, 2, 4, 8}, on()), k = at::randn({1, 2, 4, 8}, on());
  const at::Tensor a = angles(at::arange(0, 4, at::kLong), 8).to(on(at::kFloat));
  const at::Tensor cos = a.cos().repeat_interleave(2, -1), sin = a.sin().repeat_interleave(2, -1);
  if (GetParam() == c10::kCPU) {  // on a device the check is an asynchronous device assert
    expect_error([&] { rotary::apply_rope_cos_sin(q, k, cos, sin); }, "must be rotate_half tables");
  }
  const auto [oq, ok] = rotary::apply_rope_cos_sin(q, k, cos, sin, std::nullopt, /*interleaved=*/true);
  EXPECT_TRUE(AllClose(oq, rotary_test::ref_rope(q, 0, true), {1e-5, 1e-5}));
  EXPECT_TRUE(AllClose(ok, rotary_test::ref_rope(k, 0, true), {1e-5, 1e-5}));
  expect_error([&] { rotary::apply_rope_cos_sin(q, k, cos, std::nullopt); }, "sin=None reads cos as a cos_sin_cache");
}

ROTARY_ON_DEVICES(CosSin);

}  // namespace
