// Frequency (scaling) rules: rotary::compute_frequencies against an
// independent float64 re-derivation of each published formula, and the
// tables built from them. Split by concern, to be read in one sitting:
// validation messages are in test_scaling_validation.cpp, the module with
// scaling options in test_scaling_module.cpp.
#include <rotary/rotary.h>

#include <gtest/gtest.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using rotary::RopeFrequencies;
using rotary::RopeScaling;

const double kPi = std::acos(-1.0);

// ---------------------------------------------------------------------------
// Independent reference: each rule written from its formula (HF
// modeling_rope_utils and the papers), sharing nothing with csrc/freqs/freqs.cpp.
// ---------------------------------------------------------------------------
struct Ref {
  std::vector<double> inv;
  double att = 1.0;
};

std::vector<double> plain(int64_t d, double base) {
  std::vector<double> w;
  for (int64_t j = 0; j < d / 2; ++j) w.push_back(1.0 / std::pow(base, 2.0 * static_cast<double>(j) / d));
  return w;
}

Ref reference(int64_t d, double theta, const RopeScaling& s, int64_t seq_len) {
  const std::string& t = s.type();
  Ref r;
  r.inv = plain(d, theta);
  if (t == "linear") {
    for (auto& w : r.inv) w = w / *s.factor();
  } else if (t == "ntk") {
    r.inv = plain(d, theta * std::pow(*s.factor(), d / (d - 2.0)));
  } else if (t == "dynamic") {
    const double m = static_cast<double>(*s.max_position_embeddings());
    const double n = std::max(static_cast<double>(seq_len), m);
    r.inv = plain(d, theta * std::pow(*s.factor() * n / m - *s.factor() + 1.0, d / (d - 2.0)));
  } else if (t == "yarn") {
    const double orig = static_cast<double>(*s.original_max_position_embeddings());
    const double f = s.factor() ? *s.factor() : *s.max_position_embeddings() / orig;
    auto temp = [&](double m) { return f <= 1.0 ? 1.0 : 1.0 + 0.1 * m * std::log(f); };
    if (s.attention_factor()) {
      r.att = *s.attention_factor();
    } else if (s.mscale().value_or(0.0) != 0.0 && s.mscale_all_dim().value_or(0.0) != 0.0) {
      r.att = temp(*s.mscale()) / temp(*s.mscale_all_dim());
    } else {
      r.att = temp(1.0);
    }
    // pair index i with orig * theta^(-2i/d) = 2 pi * turns
    auto pair_at = [&](double turns) { return std::log(orig / (2.0 * kPi * turns)) / std::log(theta) * d / 2.0; };
    double lo = pair_at(s.beta_fast()), hi = pair_at(s.beta_slow());
    if (s.truncate()) {
      lo = std::floor(lo);
      hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, d - 1.0);
    if (lo == hi) hi += 0.001;
    for (size_t j = 0; j < r.inv.size(); ++j) {
      const double a = std::min(1.0, std::max(0.0, (static_cast<double>(j) - lo) / (hi - lo)));
      r.inv[j] = (1.0 - a) * r.inv[j] + a * (r.inv[j] / f);
    }
  } else if (t == "llama3") {
    const double orig = static_cast<double>(*s.original_max_position_embeddings());
    const double lf = s.low_freq_factor(), hf = s.high_freq_factor();
    for (auto& w : r.inv) {
      const double wavelength = 2.0 * kPi / w;
      if (wavelength < orig / hf) continue;
      if (wavelength > orig / lf) {
        w = w / *s.factor();
      } else {
        const double a = (orig / wavelength - lf) / (hf - lf);
        w = a * w + (1.0 - a) * w / *s.factor();
      }
    }
  } else if (t == "longrope") {
    const double orig = static_cast<double>(*s.original_max_position_embeddings());
    if (s.attention_factor()) {
      r.att = *s.attention_factor();
    } else {
      const double f = s.factor() ? *s.factor() : *s.max_position_embeddings() / orig;
      r.att = f <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(f) / std::log(orig));
    }
    const auto& ext = static_cast<double>(seq_len) > orig ? s.long_factor() : s.short_factor();
    for (size_t j = 0; j < r.inv.size(); ++j) r.inv[j] = r.inv[j] / ext[j];
  }
  return r;
}

struct ScalingCase {
  int64_t d;
  double theta;
  RopeScaling s;
  int64_t seq_len;
  std::string describe() const {
    std::ostringstream os;
    os << s.type() << " d=" << d << " theta=" << theta << " seq_len=" << seq_len;
    return os.str();
  }
};

std::vector<ScalingCase> random_cases() {
  std::mt19937_64 rng(20240611);
  auto uni = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  auto pick = [&](std::vector<double> v) { return v[rng() % v.size()]; };
  std::vector<ScalingCase> cases;
  for (const char* type : {"default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"}) {
    for (int i = 0; i < 6; ++i) {
      ScalingCase c{static_cast<int64_t>(pick({4, 8, 16, 64, 128, 256})), pick({10000.0, 500000.0, uni(50.0, 2e6)}),
             RopeScaling(type), 0};
      const std::string t = type;
      if (t != "default" && t != "longrope") c.s.factor(pick({2.0, 8.0, uni(1.0, 40.0)}));
      if (t == "dynamic") {
        const int64_t m = static_cast<int64_t>(pick({64, 4096}));
        c.s.max_position_embeddings(m);
        c.seq_len = static_cast<int64_t>(pick({0.0, m / 2.0, 3.0 * m}));
      }
      if (t == "yarn" || t == "llama3" || t == "longrope") {
        c.s.original_max_position_embeddings(static_cast<int64_t>(pick({256, 4096, 8192})));
      }
      if (t == "yarn") {
        if (i % 4 == 1) c.s.beta_fast(uni(8, 64)).beta_slow(uni(0.5, 4));
        if (i % 4 == 2) c.s.mscale(uni(0.5, 1.5)).mscale_all_dim(uni(0.5, 1.5));
        if (i % 4 == 3) c.s.attention_factor(uni(0.8, 1.5)).truncate(false);
        if (i == 4) c.s.factor(std::nullopt).max_position_embeddings(*c.s.original_max_position_embeddings() * 4);
      }
      if (t == "llama3") {
        const double lf = pick({0.5, 1.0, 2.0});
        c.s.low_freq_factor(lf).high_freq_factor(lf * pick({2.0, 4.0, 8.0}));
      }
      if (t == "longrope") {
        std::vector<double> sf, lf;
        for (int64_t j = 0; j < c.d / 2; ++j) {
          sf.push_back(uni(0.9, 1.5));
          lf.push_back(uni(1.0, 40.0));
        }
        c.s.short_factor(sf).long_factor(lf);
        const int64_t orig = *c.s.original_max_position_embeddings();
        c.seq_len = static_cast<int64_t>(pick({0.0, double(orig), double(orig + 1), 4.0 * orig}));
        if (i % 3 == 0) c.s.factor(uni(1.0, 16.0));
        if (i % 3 == 1) c.s.max_position_embeddings(orig * 16);
        if (i % 3 == 2) c.s.attention_factor(uni(1.0, 1.3));
      }
      cases.push_back(c);
    }
  }
  return cases;
}

// ---------------------------------------------------------------------------
// compute_frequencies
// ---------------------------------------------------------------------------
TEST(ScalingFormula, EveryRuleMatchesIndependentFormula) {
  for (const ScalingCase& c : random_cases()) {
    const RopeFrequencies f = rotary::compute_frequencies(c.d, c.theta, c.s, c.seq_len);
    const Ref r = reference(c.d, c.theta, c.s, c.seq_len);
    ASSERT_EQ(f.inv_freq.size(), r.inv.size()) << c.describe();
    for (size_t j = 0; j < r.inv.size(); ++j) {
      EXPECT_NEAR(f.inv_freq[j], r.inv[j], 1e-12 * std::abs(r.inv[j])) << c.describe() << " pair " << j;
    }
    EXPECT_NEAR(f.attention_scaling, r.att, 1e-12 * r.att) << c.describe();
  }
}

TEST(ScalingFormula, HandPickedValues) {
  // linear: every frequency divided by the factor
  auto f = rotary::compute_frequencies(4, 100.0, RopeScaling("linear").factor(4.0));
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 0.25);
  EXPECT_DOUBLE_EQ(f.inv_freq[1], 0.1 / 4.0);
  // ntk with d = 4: base * factor^2
  f = rotary::compute_frequencies(4, 100.0, RopeScaling("ntk").factor(3.0));
  EXPECT_DOUBLE_EQ(f.inv_freq[1], 1.0 / std::sqrt(900.0));
  // dynamic at or under max_position_embeddings is plain RoPE
  const auto dyn = RopeScaling("dynamic").factor(2.0).max_position_embeddings(64);
  EXPECT_EQ(rotary::compute_frequencies(8, 1e4, dyn, 64).inv_freq, rotary::compute_frequencies(8, 1e4).inv_freq);
  EXPECT_NE(rotary::compute_frequencies(8, 1e4, dyn, 65).inv_freq, rotary::compute_frequencies(8, 1e4).inv_freq);
  // yarn's default temperature
  f = rotary::compute_frequencies(
      8, 1e4, RopeScaling("yarn").factor(std::exp(1.0)).original_max_position_embeddings(4096));
  EXPECT_DOUBLE_EQ(f.attention_scaling, 1.1);
}

TEST(ScalingFormula, DefaultRuleIsRopeFreqs) {
  const auto plain_table = rotary::rope_freqs(64, 513, 5000.0);
  const auto f = rotary::compute_frequencies(64, 5000.0);
  EXPECT_EQ(f.attention_scaling, 1.0);
  EXPECT_TRUE(torch::equal(rotary::freqs_table(f, 513), plain_table));
  EXPECT_TRUE(torch::equal(rotary::rope_freqs(64, 513, 5000.0, RopeScaling("default")), plain_table));
  const auto inv = rotary::inv_freq_tensor(f);
  ASSERT_EQ(inv.scalar_type(), torch::kDouble);
  ASSERT_EQ(inv.sizes(), torch::IntArrayRef({32}));
  for (int64_t j = 0; j < 32; ++j) EXPECT_EQ(inv[j].item<double>(), f.inv_freq[j]);
}

TEST(ScalingTable, EntriesAreScaledExponentials) {
  const auto cases = random_cases();
  for (size_t n = 0; n < cases.size(); n += 5) {
    const ScalingCase& c = cases[n];
    const int64_t rows = c.d <= 16 ? 65536 : 2048;
    const auto table = rotary::rope_freqs(c.d, rows, c.theta, c.s, c.seq_len);
    ASSERT_EQ(table.scalar_type(), torch::kComplexFloat);
    ASSERT_EQ(table.sizes(), torch::IntArrayRef({rows, c.d / 2}));
    const Ref r = reference(c.d, c.theta, c.s, c.seq_len);
    const auto re = torch::real(table).to(torch::kDouble).contiguous();
    const auto im = torch::imag(table).to(torch::kDouble).contiguous();
    const double* pre = re.data_ptr<double>();
    const double* pim = im.data_ptr<double>();
    std::mt19937_64 rng(n);
    std::vector<int64_t> positions = {0, 1, rows - 1};
    for (int i = 0; i < 40; ++i) positions.push_back(static_cast<int64_t>(rng() % rows));
    double worst = 0.0;
    for (int64_t p : positions) {
      for (int64_t j = 0; j < c.d / 2; ++j) {
        const double angle = static_cast<double>(p) * r.inv[j];
        worst = std::max(worst, std::abs(pre[p * (c.d / 2) + j] - r.att * std::cos(angle)));
        worst = std::max(worst, std::abs(pim[p * (c.d / 2) + j] - r.att * std::sin(angle)));
      }
    }
    EXPECT_LE(worst, 1e-7) << c.describe();
  }
}

}  // namespace
