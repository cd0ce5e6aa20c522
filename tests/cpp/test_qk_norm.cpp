// The prologue ops from C++ (rotary/ops.h): apply_qk_norm_rope out of place
// and in place, the KV-cache form, gradients, and the error matrix, against
// a float64 norm-then-rope reference, on every device.
#include "helpers.h"
#include "reference.h"

#include <rotary/ops.h>
#include <rotary/freqs.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <limits>
#include <string>

namespace {

using rotary_test::AllClose;
using rotary_test::tolerance_for;

// The float64 prologue over head_dim, rotating dims [0, r).
at::Tensor ref_prologue(const at::Tensor& x, const at::Tensor& w, double eps, double offset, int64_t r, int64_t start,
                        bool interleaved) {
  return rotary_test::ref_norm_rope(x, w, false, eps, offset, start, interleaved, 0, r);
}

class QkNorm : public rotary_test::OnDevice {};

TEST_P(QkNorm, OutOfPlaceAndInPlaceMatchReference) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const bool interleaved : {true, false}) {
      const int64_t B = 2, Hq = 4, Hk = 2, S = 5, D = 32, r = 16, start = 3;
      const auto q = at::randn({B, Hq, S, D}, on(dtype)), k = at::randn({B, Hk, S, D}, on(dtype));
      const auto qw = 1 + 0.5 * at::randn({D}, on()), kw = 1 + 0.5 * at::randn({D}, on());
      const auto freqs = rotary::rope_freqs(r, 64).to(GetParam());
      const auto [oq, ok] = rotary::apply_qk_norm_rope(
          q, k, freqs, start, interleaved, {}, {}, false, {}, {}, "BHSD", 0, {}, qw, kw, 1e-5, "head", 1.0);
      const std::string what = rotary_test::dtype_name(dtype) + (interleaved ? " interleaved" : " half");
      EXPECT_TRUE(AllClose(oq, ref_prologue(q, qw, 1e-5, 1.0, r, start, interleaved), tolerance_for(dtype))) << what;
      EXPECT_TRUE(AllClose(ok, ref_prologue(k, kw, 1e-5, 1.0, r, start, interleaved), tolerance_for(dtype))) << what;
      auto iq = q.clone(), ik = k.clone();
      rotary::apply_qk_norm_rope_(
          iq, ik, freqs, start, interleaved, {}, {}, false, {}, {}, "BHSD", 0, {}, qw, kw, 1e-5, "head", 1.0);
      EXPECT_TRUE(at::equal(iq, oq) && at::equal(ik, ok)) << what << ": in place differs from out of place";
    }
  }
}

TEST_P(QkNorm, KvCacheHoldsTheResult) {
  const int64_t B = 1, Hq = 2, Hk = 2, S = 3, D = 16;
  auto q = at::randn({B, Hq, S, D}, on()), k = at::randn({B, Hk, S, D}, on()), v = at::randn({B, Hk, S, D}, on());
  auto kc = at::full({B, Hk, 8, D}, std::numeric_limits<float>::quiet_NaN(), on()), vc = kc.clone();
  const auto freqs = rotary::rope_freqs(D, 64).to(GetParam());
  const auto kw = at::rand({D}, on()) + 0.5;
  const auto k0 = k.clone();
  rotary::apply_qk_norm_rope_with_kv_cache_(
      q, k, v, kc, vc, freqs, 4, true, {}, {}, {}, {}, "BHSD", {}, {}, "BHSD", {}, {}, false, 0, {}, {}, kw);
  EXPECT_TRUE(AllClose(k, ref_prologue(k0, kw, 1e-6, 0.0, D, 4, true), tolerance_for(at::kFloat)));
  EXPECT_TRUE(at::equal(kc.narrow(2, 4, S), k));
  EXPECT_TRUE(at::equal(vc.narrow(2, 4, S), v));
  EXPECT_TRUE(at::isnan(kc.narrow(2, 0, 4)).all().item<bool>());
}

TEST_P(QkNorm, GradientsMatchTheUnfusedOps) {
  const auto opts = on(at::kDouble);
  const auto q = at::randn({1, 2, 3, 8}, opts).requires_grad_(), k = at::randn({1, 1, 3, 8}, opts).requires_grad_();
  const auto qw = at::randn({8}, opts).requires_grad_(), kw = at::randn({8}, opts).requires_grad_();
  const auto freqs = rotary::rope_freqs(8, 16).to(GetParam());
  const auto gq = at::randn({1, 2, 3, 8}, opts), gk = at::randn({1, 1, 3, 8}, opts);
  const auto [oq, ok] = rotary::apply_qk_norm_rope(
      q, k, freqs, 2, true, {}, {}, false, {}, {}, "BHSD", 0, {}, qw, kw, 1e-4);
  const auto fused = torch::autograd::grad({(oq * gq).sum() + (ok * gk).sum()}, {q, k, qw, kw});
  const auto norm = [](const at::Tensor& x, const at::Tensor& w) {
    return x * at::rsqrt(x.pow(2).mean({-1}, true) + 1e-4) * w;
  };
  const auto [rq, rk] = rotary::apply_rope_qk(norm(q, qw), norm(k, kw), freqs, 2, true);
  const auto unfused = torch::autograd::grad({(rq * gq).sum() + (rk * gk).sum()}, {q, k, qw, kw});
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_TRUE(AllClose(fused[i], unfused[i], {1e-9, 1e-9})) << "gradient " << i;
  }
}

TEST_P(QkNorm, ErrorsNameTheArgument) {
  const auto q = at::randn({1, 2, 3, 8}, on()), k = at::randn({1, 1, 3, 8}, on());
  const auto freqs = rotary::rope_freqs(8, 16).to(GetParam());
  const auto call = [&](const std::optional<at::Tensor>& qw, double eps, const char* norm) {
    rotary::apply_qk_norm_rope(q, k, freqs, 0, true, {}, {}, false, {}, {}, "BHSD", 0, {}, qw, {}, eps, norm);
  };
  const struct {
    std::optional<at::Tensor> qw;
    double eps;
    const char* norm;
    const char* message;
  } cases[] = {
      {at::ones({4}, on()), 1e-6, "head", "q_weight must be 1-D [head_dim] = [8] for norm 'head' (q has 2 heads"},
      {at::ones({8}, on()), 1e-6, "heads", "q_weight must be 1-D [heads * head_dim] = [16] for norm 'heads'"},
      {at::ones({8}, on(at::kInt)), 1e-6, "head", "q_weight must be float32, float64, float16 or bfloat16, got Int"},
      {std::nullopt, -1.0, "head", "eps must be finite and >= 0, got -1"},
      {std::nullopt, 1e-46, "head", "eps is 0 in float32 (the norm's accumulation type for Float q), got 1e-46"},
      {std::nullopt, 1e-6, "layer", "norm must be 'head' (each head over its head_dim) or 'heads'"},
  };
  for (const auto& c : cases) {
    try {
      call(c.qw, c.eps, c.norm);
      ADD_FAILURE() << "no error for: " << c.message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("apply_qk_norm_rope: ") + c.message), std::string::npos)
          << e.what();
    }
  }
}

ROTARY_ON_DEVICES(QkNorm);

}  // namespace
