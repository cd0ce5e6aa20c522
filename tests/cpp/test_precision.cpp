// Precision of the tables and the outputs against exact values, and the
// fp32-angle compatibility mode against an independent float32 formula.
//
// "Exact": the angle is the product pos * inv_freq[j] (inv_freq from the
// independent reference, std::pow in double) in long double (x86: 64-bit
// mantissa), reduced mod 2*pi there, as are its cos/sin: within 1e-12 rad of
// exact at 2^22, far below float32's rounding.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/module.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

namespace {

using rotary_test::ref_inv_freq;

constexpr int64_t kTwo22 = int64_t{1} << 22;
const double kHalfUlp1 = std::ldexp(1.0, -25);  // one rounding of a cos/sin to float

std::vector<int64_t> sample_positions(int n, uint32_t seed, int64_t top = kTwo22) {
  std::set<int64_t> s = {0, 1, 2, 3, 4095, 4096, 131071, 131072, (1 << 20) - 1, 1 << 20, top - 1, top};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, top);
  for (int i = 0; i < n; ++i) s.insert(d(rng));
  return {s.begin(), s.end()};
}

at::Tensor positions_tensor(const std::vector<int64_t>& p) {
  return at::tensor(p, at::kLong);
}

rotary::RopeFrequencies reference_frequencies(int64_t dim, double theta) {
  rotary::RopeFrequencies f;
  for (int64_t j = 0; j < dim / 2; ++j) f.inv_freq.push_back(ref_inv_freq(j, dim, theta));
  return f;
}

// max |entry - exact| over cos and sin; rows[i] is position p[i].
double max_entry_error(const at::Tensor& rows, const std::vector<int64_t>& p, const std::vector<double>& inv,
                       double scale = 1.0) {
  const auto r = at::view_as_real(rows.contiguous()).to(at::kDouble).contiguous();
  const double* v = r.data_ptr<double>();
  const int64_t pairs = static_cast<int64_t>(inv.size());
  double worst = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    for (int64_t j = 0; j < pairs; ++j) {
      const long double angle = rotary_test::ref_angle(p[i], inv[j]);
      const double c = static_cast<double>(scale * cosl(angle));
      const double s = static_cast<double>(scale * sinl(angle));
      const double* e = v + 2 * (static_cast<int64_t>(i) * pairs + j);
      worst = std::max({worst, std::abs(e[0] - c), std::abs(e[1] - s)});
    }
  }
  return worst;
}

TEST(Precision, TableRowsExactUpTo2e22) {
  for (const auto& [dim, theta] : std::vector<std::pair<int64_t, double>>{{128, 1e4}, {64, 5e5}, {6, 1e4}}) {
    const auto p = sample_positions(48, static_cast<uint32_t>(dim));
    const auto f = reference_frequencies(dim, theta);
    const auto rows = rotary::freqs_at(rotary::compute_frequencies(dim, theta), positions_tensor(p));
    ASSERT_EQ(rows.scalar_type(), at::kComplexFloat);
    ASSERT_EQ(rows.sizes(), at::IntArrayRef({static_cast<int64_t>(p.size()), dim / 2}));
    const double err = max_entry_error(rows, p, f.inv_freq);
    EXPECT_LE(err, 1e-7) << "dim " << dim;
    EXPECT_LE(err, kHalfUlp1 * (1 + 1e-6)) << "dim " << dim << ": not one correct rounding";
  }
}

// A real table through 2^22 (two pairs: 64 MB), its last rows and samples,
// and freqs_at equal to it bit for bit.
TEST(Precision, RealTableThrough2e22) {
  rotary::RopeFrequencies f;
  f.inv_freq = {1.0, 0.01};
  const auto table = rotary::freqs_table(f, kTwo22 + 1);
  const auto p = sample_positions(64, 11);
  const auto picked = table.index_select(0, positions_tensor(p));
  EXPECT_LE(max_entry_error(picked, p, f.inv_freq), kHalfUlp1 * (1 + 1e-6));
  EXPECT_TRUE(at::equal(rotary::freqs_at(f, positions_tensor(p)), picked));
}

TEST(Precision, ScaledRuleRowsExact) {
  const auto yarn = rotary::RopeScaling("yarn").factor(4.0).original_max_position_embeddings(4096);
  const auto f = rotary::compute_frequencies(32, 1e4, yarn);
  ASSERT_NE(f.attention_scaling, 1.0);
  const auto p = sample_positions(16, 5);
  const double err = max_entry_error(rotary::freqs_at(f, positions_tensor(p)), p, f.inv_freq, f.attention_scaling);
  EXPECT_LE(err, 1e-7);
}

// The op's on-the-fly path (past a 1-row table, with inv_freq) stores the
// same bits as the table: x = (1, 0) per pair in float64 reads them out.
TEST(Precision, PastTablePathEqualsTableBitForBit) {
  const int64_t dim = 16;
  const auto p = sample_positions(40, 3);
  const int64_t n = static_cast<int64_t>(p.size());
  const auto f = rotary::compute_frequencies(dim, 1e4);
  for (const bool interleaved : {true, false}) {
    auto x = at::zeros({1, 1, n, dim}, at::kDouble);
    if (interleaved) {
      x.slice(3, 0, dim, 2).fill_(1.0);
    } else {
      x.slice(3, 0, dim / 2).fill_(1.0);
    }
    const auto out = rotary::apply_rope(
        x, rotary::freqs_table(f, 1), 0, interleaved, std::nullopt, positions_tensor(p).unsqueeze(0), false, std::nullopt,
        rotary::inv_freq_tensor(f))[0][0];
    const auto c = interleaved ? out.slice(1, 0, dim, 2) : out.slice(1, 0, dim / 2);
    const auto s = interleaved ? out.slice(1, 1, dim, 2) : out.slice(1, dim / 2, dim);
    const auto rows = rotary::freqs_at(f, positions_tensor(p));
    EXPECT_TRUE(at::equal(c, at::real(rows).to(at::kDouble))) << interleaved;
    EXPECT_TRUE(at::equal(s, at::imag(rows).to(at::kDouble))) << interleaved;
  }
}

// Outputs of a module call reaching 2^22 (table rows and the on-the-fly
// path) against the float64 reference. fp32: per pair, ||out - exact|| <=
// 1e-6 ||x||. fp16 / bf16: |out - exact| <= half an ulp of exact + 1e-6 ||x
// pair|| (one rounding, plus the fp32 table and math before it).
TEST(Precision, OutputsAgainstReference) {
  const int64_t B = 2, H = 3, S = 32, D = 64;
  auto ids = at::randint(0, kTwo22 + 1, {B, S}, at::kLong);
  ids[0].slice(0, 0, 4).copy_(at::tensor(std::vector<int64_t>{0, 4095, kTwo22 - 1, kTwo22}, at::kLong));
  for (const bool interleaved : {true, false}) {
    rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(D).max_seq_len(4096).interleaved(interleaved));
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
      const auto x = at::randn({B, H, S, D}).to(dtype);
      const auto out = rope->forward(x, 0, std::nullopt, ids).to(at::kDouble);
      const auto exact = rotary_test::ref_rope(x, 0, interleaved, ids);
      const auto xd = x.to(at::kDouble);
      auto pairs = [&](const at::Tensor& t) {
        return interleaved ? t.reshape({B, H, S, D / 2, 2})
                           : at::stack({t.slice(3, 0, D / 2), t.slice(3, D / 2, D)}, -1);
      };
      const auto pair_norm = pairs(xd).norm(2, -1);  // [B, H, S, D/2]
      if (dtype == at::kFloat) {
        const double rel = (pairs(out - exact).norm(2, -1) / pair_norm).max().item<double>();
        EXPECT_LE(rel, 1e-6) << "fp32, interleaved " << interleaved;
        continue;
      }
      const int mant = dtype == at::kHalf ? 10 : 7;
      const double tiny = dtype == at::kHalf ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126);
      const auto ulp = at::exp2(at::floor(at::log2(at::clamp_min(exact.abs(), tiny))) - mant);
      const auto norm = interleaved ? pair_norm.repeat_interleave(2, -1) : at::cat({pair_norm, pair_norm}, -1);
      const auto excess = ((out - exact).abs() - 0.5 * ulp) / norm;
      EXPECT_LE(excess.max().item<double>(), 1e-6) << rotary_test::dtype_name(dtype) << " interleaved " << interleaved;
    }
  }
}

// ---- angle_dtype = float32: the fp32-angle tables of Hugging Face / Meta.
// Independent formula: float(pos) * float(inv_freq) in float32, then
// cos/sin of that float angle in long double, rounded to float.
TEST(Precision, Fp32AngleTableMatchesFloat32Formula) {
  const int64_t dim = 128;
  const auto p = sample_positions(64, 9);
  const auto f = reference_frequencies(dim, 1e4);
  const auto rows = rotary::freqs_at(rotary::compute_frequencies(dim, 1e4), positions_tensor(p), at::kFloat);
  const auto r = at::view_as_real(rows).contiguous();
  const float* v = r.data_ptr<float>();
  double worst = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    for (int64_t j = 0; j < dim / 2; ++j) {
      volatile float a = static_cast<float>(p[i]) * static_cast<float>(f.inv_freq[j]);
      const float c = static_cast<float>(cosl(static_cast<long double>(a)));
      const float s = static_cast<float>(sinl(static_cast<long double>(a)));
      const float* e = v + 2 * (static_cast<int64_t>(i) * (dim / 2) + j);
      worst = std::max({worst, std::abs(double(e[0]) - c), std::abs(double(e[1]) - s)});
    }
  }
  // Same angle bits; a cos/sin may differ in the last float bit where the
  // float64 value straddles a rounding boundary.
  EXPECT_LE(worst, std::ldexp(1.0, -24));
  // And it is not the exact table: 2^22 * inv_freq in float32 is visibly off.
  const auto exact = rotary::freqs_at(rotary::compute_frequencies(dim, 1e4), positions_tensor(p));
  EXPECT_GT((rows - exact).abs().max().item<double>(), 1e-2);
}

TEST(Precision, Fp32AngleTableEqualsTorchOuterFormula) {
  // torch.outer(t.float(), inv_freq.float()) then polar, as Meta's Llama builds it.
  const int64_t dim = 64, n = 4096;
  const auto inv = rotary::inv_freq_tensor(rotary::compute_frequencies(dim, 1e4)).to(at::kFloat);
  const auto angles = at::outer(at::arange(n, at::kFloat), inv);
  const auto meta = at::polar(at::ones_like(angles), angles);
  const auto ours = rotary::rope_freqs(dim, n, 1e4, rotary::RopeScaling(), 0, at::kFloat);
  EXPECT_LE((ours - meta).abs().max().item<double>(), 3e-7);
  EXPECT_GT((rotary::rope_freqs(dim, n) - meta).abs().max().item<double>(), 1e-5);
}

TEST(Precision, Fp32AngleModule) {
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(32).max_seq_len(512).angle_dtype(torch::kFloat32));
  EXPECT_TRUE(at::equal(rope->freqs, rotary::rope_freqs(32, 512, 1e4, rotary::RopeScaling(), 0, at::kFloat)));
  EXPECT_EQ(rope->inv_freq.scalar_type(), at::kDouble);
  const auto x = at::randn({1, 2, 8, 32});
  EXPECT_TRUE(at::equal(rope->forward(x, 504), rotary::apply_rope(x, rope->freqs, 504)));
  rotary_test::ExpectError<c10::IndexError>(
      [&] { rope->forward(x, 505); }, {"angle_dtype=float32", "505 + 8 = 513 exceeds max_seq_len 512"});
  rotary_test::ExpectError<c10::IndexError>(
      [&] { rope->forward(x, 0, std::nullopt, at::full({1, 8}, 600, at::kLong)); }, {"outside the freqs table"});
  std::ostringstream os;
  rope->pretty_print(os);
  EXPECT_NE(os.str().find("angle_dtype=float32"), std::string::npos);
  // The clone keeps the mode.
  auto copy = std::dynamic_pointer_cast<rotary::RotaryEmbeddingImpl>(rope->clone());
  EXPECT_EQ(copy->options.angle_dtype(), torch::kFloat32);
  EXPECT_TRUE(at::equal(copy->freqs, rope->freqs));
}

}  // namespace
