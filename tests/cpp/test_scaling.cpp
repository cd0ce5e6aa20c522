// Frequency (scaling) rules: rotary::compute_frequencies against an
// independent float64 re-derivation of each published formula, the tables
// built from them, validation messages, and the module with scaling options
// (host-driven dynamic / longrope updates, clone, save / load, casts).
#include <rotary/rotary.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using rotary::RopeFrequencies;
using rotary::RopeScaling;
using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;

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

template <typename Fn>
void expect_value_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected c10::ValueError containing \"" << needle << "\"";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
        << "message: " << e.what_without_backtrace() << "\nexpected to contain: " << needle;
  }
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

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------
TEST(ScalingErrors, MessagesNameTheField) {
  auto compute = [](int64_t d, const RopeScaling& s) {
    return [=] { rotary::compute_frequencies(d, 10000.0, s); };
  };
  expect_value_error(compute(8, RopeScaling("ntk-by-parts")), "unknown type (rope_type) 'ntk-by-parts'");
  expect_value_error(compute(8, RopeScaling("linear")), "RopeScaling(type='linear'): factor is required");
  expect_value_error(compute(8, RopeScaling("linear").factor(0.0)), "factor must be finite and > 0, got 0");
  expect_value_error(compute(8, RopeScaling("ntk").factor(-1.0)), "factor must be finite and > 0");
  expect_value_error(compute(2, RopeScaling("ntk").factor(2.0)), "rotary_dim must be > 2, got 2");
  expect_value_error(
      compute(8, RopeScaling("dynamic").factor(2.0)), "RopeScaling(type='dynamic'): max_position_embeddings is required");
  for (const char* t : {"yarn", "llama3", "longrope"}) {
    expect_value_error(compute(8, RopeScaling(t).factor(2.0)), "original_max_position_embeddings is required");
  }
  expect_value_error(
      compute(8, RopeScaling("yarn").factor(4.0).original_max_position_embeddings(0)),
      "original_max_position_embeddings must be > 0, got 0");
  expect_value_error(
      compute(8, RopeScaling("yarn").original_max_position_embeddings(64)), "RopeScaling(type='yarn'): factor is required");
  expect_value_error(
      compute(8, RopeScaling("yarn").factor(4.0).original_max_position_embeddings(64).beta_fast(0.0)),
      "beta_fast must be finite and > 0");
  expect_value_error(
      compute(8, RopeScaling("yarn").factor(4.0).original_max_position_embeddings(64).attention_factor(-1.0)),
      "attention_factor must be finite and > 0");
  expect_value_error(
      compute(8, RopeScaling("llama3").factor(8.0).original_max_position_embeddings(64).low_freq_factor(4.0).high_freq_factor(4.0)),
      "high_freq_factor must be finite and > low_freq_factor");
  const auto longrope = RopeScaling("longrope").original_max_position_embeddings(64).factor(2.0);
  expect_value_error(
      compute(8, RopeScaling(longrope).short_factor({1, 1, 1}).long_factor({1, 1, 1, 1})),
      "short_factor must have rotary_dim / 2 = 4 entries (one per rotated pair), got 3");
  expect_value_error(
      compute(8, RopeScaling(longrope).short_factor({1, 1, 1, 1}).long_factor({1, 1, 1, 1, 1})),
      "long_factor must have rotary_dim / 2 = 4 entries");
  expect_value_error(
      compute(8, RopeScaling(longrope).short_factor({1, 1, 1, 1}).long_factor({1, 1, -2, 1})),
      "long_factor[2] must be finite and > 0");
  expect_value_error(compute(7, RopeScaling()), "rotary_dim must be even and > 0, got 7");
  expect_value_error([] { rotary::compute_frequencies(8, 0.0); }, "theta must be finite and > 0, got 0");
  expect_value_error(
      [] {
        RotaryEmbedding(RotaryEmbeddingOptions(8).scaling(RopeScaling("llama3").factor(8.0)));
      },
      "original_max_position_embeddings is required");
}

// ---------------------------------------------------------------------------
// The module with scaling options
// ---------------------------------------------------------------------------
RopeScaling yarn() {
  return RopeScaling("yarn").factor(4.0).original_max_position_embeddings(16);
}

std::vector<std::string> buffer_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& item : m.named_buffers()) names.push_back(item.key());
  return names;
}

TEST(ScalingModule, RegistersTableAndInvFreq) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64).theta(5000.0).scaling(yarn()));
  EXPECT_EQ(buffer_names(*rope), (std::vector<std::string>{"freqs", "inv_freq"}));
  const auto f = rotary::compute_frequencies(16, 5000.0, yarn());
  EXPECT_GT(f.attention_scaling, 1.0);
  EXPECT_EQ(rope->attention_scaling, f.attention_scaling);
  EXPECT_TRUE(torch::equal(rope->freqs, rotary::freqs_table(f, 64)));
  EXPECT_TRUE(torch::equal(rope->inv_freq, rotary::inv_freq_tensor(f)));
  EXPECT_TRUE(rope->named_buffers()["inv_freq"].is_same(rope->inv_freq));

  const auto x = torch::randn({2, 3, 5, 16});
  const auto k = torch::randn({2, 1, 5, 16});
  EXPECT_TRUE(torch::equal(rope->forward(x, 7), rotary::apply_rope(x, rope->freqs, 7, true)));
  const auto [q2, k2] = rope->forward(x, k, 3);
  const auto [q3, k3] = rotary::apply_rope_qk(x, k, rope->freqs, 3, true);
  EXPECT_TRUE(torch::equal(q2, q3));
  EXPECT_TRUE(torch::equal(k2, k3));
  const auto ids = torch::tensor({9, 3, 0, 63, 20, 1, 2, 3, 4, 5}, torch::kLong).view({2, 5});
  EXPECT_TRUE(torch::equal(
      rope->forward(x, 0, std::nullopt, ids), rotary::apply_rope(x, rope->freqs, 0, true, std::nullopt, ids)));

  std::ostringstream os;
  os << *rope;
  EXPECT_NE(os.str().find("scaling=yarn(factor=4)"), std::string::npos) << os.str();
  // Numbers print whole: six significant digits would show 1000000.5 as 1e+06.
  std::ostringstream exact;
  exact << *RotaryEmbedding(RotaryEmbeddingOptions(8).max_seq_len(16).theta(1000000.5).scaling(
      RopeScaling("linear").factor(2.25)));
  EXPECT_NE(exact.str().find("theta=1000000.5, interleaved=true, scaling=linear(factor=2.25)"), std::string::npos)
      << exact.str();
}

TEST(ScalingModule, DynamicGrowsAndResets) {
  const auto dyn = RopeScaling("dynamic").factor(2.0).max_position_embeddings(32);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(48).scaling(dyn));
  auto expect_state = [&](int64_t seq_len, int64_t rows, int line) {
    const auto f = rotary::compute_frequencies(8, 10000.0, dyn, seq_len);
    EXPECT_TRUE(torch::equal(rope->inv_freq, rotary::inv_freq_tensor(f))) << "line " << line;
    EXPECT_TRUE(torch::equal(rope->freqs, rotary::freqs_table(f, rows))) << "line " << line;
    EXPECT_TRUE(rope->named_buffers()["freqs"].is_same(rope->freqs)) << "line " << line;
  };
  const auto x = torch::randn({1, 1, 4, 8});
  expect_state(0, 48, __LINE__);
  rope->forward(x, 20);  // reach 24
  expect_state(0, 48, __LINE__);
  rope->forward(x, 36);  // reach 40 > 32: grow (float64 angles: row 0 alone, the rest on the fly)
  expect_state(40, 1, __LINE__);
  rope->forward(x, 60);  // reach 64: grow
  expect_state(64, 1, __LINE__);
  rope->forward(x, 40);  // reach 44: kept
  expect_state(64, 1, __LINE__);
  rope->forward(x, 10);  // reach 14 < 32: reset
  expect_state(0, 48, __LINE__);
  rope->forward(x, 0, std::nullopt, torch::tensor({0, 1, 2, 99}, torch::kLong).view({1, 4}));  // ids: reach 100
  expect_state(100, 1, __LINE__);

  // An unset max_position_embeddings is the module's max_seq_len.
  RotaryEmbedding implicit(RotaryEmbeddingOptions(8).max_seq_len(32).scaling(RopeScaling("dynamic").factor(2.0)));
  implicit->forward(x, 36);
  EXPECT_TRUE(torch::equal(implicit->inv_freq, rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, dyn, 40))));
}

TEST(ScalingModule, LongropeSwitchesFactors) {
  const auto lr = RopeScaling("longrope")
                      .short_factor({1.0, 1.5, 2.0, 2.5})
                      .long_factor({3.0, 5.0, 7.0, 9.0})
                      .original_max_position_embeddings(16)
                      .factor(4.0);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(64).interleaved(false).scaling(lr));
  const auto short_inv = rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, lr, 0));
  const auto long_inv = rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, lr, 17));
  EXPECT_DOUBLE_EQ(rope->attention_scaling, std::sqrt(1.0 + std::log(4.0) / std::log(16.0)));
  const auto x = torch::randn({2, 2, 4, 8});
  const std::vector<std::pair<int64_t, bool>> steps = {{0, false}, {12, false}, {13, true}, {40, true}, {11, false}};
  for (const auto& [start, is_long] : steps) {
    rope->forward(x, start);
    EXPECT_TRUE(torch::equal(rope->inv_freq, is_long ? long_inv : short_inv)) << "start " << start;
  }
  rope->forward(x, 0, torch::tensor({0, 13}, torch::kLong));  // offsets: 13 + 4 > 16
  EXPECT_TRUE(torch::equal(rope->inv_freq, long_inv));
}

TEST(ScalingModule, CloneKeepsBothBuffersAndTheState) {
  const auto dyn = RopeScaling("dynamic").factor(2.0).max_position_embeddings(32);
  RotaryEmbedding rope(RotaryEmbeddingOptions(8).max_seq_len(32).scaling(dyn));
  rope->forward(torch::randn({1, 1, 8, 8}), 40);  // grown to 48 (row 0 alone)
  auto cloned = std::dynamic_pointer_cast<rotary::RotaryEmbeddingImpl>(rope->clone());
  ASSERT_TRUE(cloned);
  EXPECT_EQ(buffer_names(*cloned), (std::vector<std::string>{"freqs", "inv_freq"}));
  EXPECT_TRUE(torch::equal(cloned->freqs, rope->freqs));
  EXPECT_TRUE(torch::equal(cloned->inv_freq, rope->inv_freq));
  EXPECT_NE(cloned->freqs.data_ptr(), rope->freqs.data_ptr());
  EXPECT_NE(cloned->inv_freq.data_ptr(), rope->inv_freq.data_ptr());
  EXPECT_EQ(cloned->named_buffers()["inv_freq"].data_ptr(), cloned->inv_freq.data_ptr());
  EXPECT_EQ(cloned->freqs.size(0), 1);
  // the clone knows it was grown: going under max_position_embeddings resets it
  cloned->forward(torch::randn({1, 1, 2, 8}), 0);
  EXPECT_TRUE(torch::equal(cloned->inv_freq, rotary::inv_freq_tensor(rotary::compute_frequencies(8, 1e4, dyn))));
  EXPECT_EQ(cloned->freqs.size(0), 32);
  EXPECT_EQ(rope->freqs.size(0), 1);  // the original is untouched
}

TEST(ScalingModule, SaveLoadKeepsBothBuffers) {
  const auto options = RotaryEmbeddingOptions(16).max_seq_len(32).theta(777.0).scaling(yarn());
  RotaryEmbedding a(options);
  std::stringstream stream;
  torch::save(a, stream);
  RotaryEmbedding b(options);
  torch::NoGradGuard no_grad;
  b->inv_freq.mul_(2.0);  // loading must restore both buffers
  b->freqs.zero_();
  torch::load(b, stream);
  EXPECT_TRUE(torch::equal(b->freqs, a->freqs));
  EXPECT_TRUE(torch::equal(b->inv_freq, a->inv_freq));
  EXPECT_EQ(b->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(b->named_buffers()["inv_freq"].is_same(b->inv_freq));
  const auto x = torch::randn({1, 2, 4, 16});
  EXPECT_TRUE(torch::equal(a->forward(x, 3), b->forward(x, 3)));

  // Tables saved with other options are refused, never silently installed.
  std::stringstream again;
  torch::save(a, again);
  RotaryEmbedding other(RotaryEmbeddingOptions(16).max_seq_len(32));
  EXPECT_THROW(torch::load(other, again), c10::ValueError);
}

TEST(ScalingModule, DtypeCastsLeaveBothBuffers) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(32).scaling(yarn()));
  const auto freqs = rope->freqs.clone();
  const auto inv = rope->inv_freq.clone();
  rope->to(torch::kHalf);
  rope->to(torch::kBFloat16);
  rope->to(torch::kCPU, torch::kFloat);
  EXPECT_EQ(rope->freqs.scalar_type(), torch::kComplexFloat);
  EXPECT_EQ(rope->inv_freq.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(rope->freqs, freqs));
  EXPECT_TRUE(torch::equal(rope->inv_freq, inv));
}


TEST(ScalingErrors, RopeTypeNamesParseAndPrint) {
  for (const auto t : {rotary::RopeType::Default, rotary::RopeType::Linear, rotary::RopeType::Ntk,
                       rotary::RopeType::Dynamic, rotary::RopeType::Yarn, rotary::RopeType::Llama3,
                       rotary::RopeType::LongRope, rotary::RopeType::Proportional}) {
    EXPECT_EQ(rotary::rope_type_from_string(rotary::to_string(t)), t);
    EXPECT_NE(rotary::rope_type_names().find(rotary::to_string(t)), std::string::npos);
  }
  EXPECT_FALSE(rotary::rope_type_from_string("su").has_value());
  EXPECT_EQ(rotary::rope_type_names(), "default, linear, ntk, dynamic, yarn, llama3, longrope, proportional");
}

// Gemma 4's proportional rule: floor(p * d / 2) pairs turn at the whole
// head's theta^(-2j/d) / factor, the others not at all.
TEST(Scaling, ProportionalTurnsAShareOfThePairs) {
  const auto f = rotary::compute_frequencies(
      12, 10000.0, RopeScaling("proportional").partial_rotary_factor(0.4).factor(2.0));
  ASSERT_EQ(f.inv_freq.size(), 6u);
  for (size_t j = 0; j < 6; ++j) {
    const double want = j < 2 ? std::pow(10000.0, -2.0 * static_cast<double>(j) / 12.0) / 2.0 : 0.0;
    EXPECT_DOUBLE_EQ(f.inv_freq[j], want) << "pair " << j;
  }
  EXPECT_EQ(f.attention_scaling, 1.0);
  expect_value_error(
      [] { rotary::compute_frequencies(8, 10000.0, RopeScaling("proportional").partial_rotary_factor(1.5)); },
      "partial_rotary_factor must lie in (0, 1]");
}

// A field the rule does not read would be silently ignored: refused, as
// an unknown key is.
TEST(ScalingErrors, FieldsOfOtherRulesAreRefused) {
  auto compute = [](const RopeScaling& s) {
    return [=] { rotary::compute_frequencies(8, 10000.0, s); };
  };
  expect_value_error(
      compute(RopeScaling("default").factor(-1.0)), "RopeScaling(type='default'): factor is not a field of this rule");
  expect_value_error(
      compute(RopeScaling("linear").factor(2.0).beta_fast(NAN)),
      "RopeScaling(type='linear'): beta_fast is not a field of this rule (it would be ignored); its fields: factor");
  expect_value_error(
      compute(RopeScaling("ntk").factor(2.0).truncate(false)), "truncate is not a field of this rule");
  expect_value_error(
      compute(RopeScaling("llama3").factor(8.0).original_max_position_embeddings(64).mscale(1.0)),
      "mscale is not a field of this rule");
  // The rule's own fields, and untouched defaults, are fine.
  rotary::compute_frequencies(8, 1e4, RopeScaling("yarn").factor(4.0).original_max_position_embeddings(64).beta_fast(16));
  rotary::compute_frequencies(8, 1e4, RopeScaling("linear").factor(2.0).beta_fast(32.0));
}

// Every table and inv_freq a module builds is finite, or construction raises
// a c10::ValueError naming the field.
TEST(ScalingErrors, NonFiniteTablesAreRefused) {
  auto build = [](const RotaryEmbeddingOptions& o) {
    return [=] { RotaryEmbedding m(o); };
  };
  const auto yarn64 = RopeScaling("yarn").factor(4.0).original_max_position_embeddings(64);
  // The attention scaling (0.1 m ln(f) + 1) / (0.1 m_all ln(f) + 1): negative, past float, or a zero divisor.
  expect_value_error(
      build(RotaryEmbeddingOptions(8).scaling(RopeScaling(yarn64).mscale(-20.0).mscale_all_dim(1.0))),
      "mscale = -20 and mscale_all_dim = 1 give the attention scaling");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).scaling(RopeScaling(yarn64).mscale(1e308).mscale_all_dim(1.0))),
      "attention scaling");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).scaling(
          RopeScaling("yarn").factor(std::exp(1.0)).original_max_position_embeddings(64).mscale(1.0).mscale_all_dim(-10.0))),
      "attention scaling");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).scaling(RopeScaling("linear").factor(1e-320))), "give inv_freq[0] = inf");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).scaling(RopeScaling("dynamic").factor(std::ldexp(1.0, 62)))),
      "RopeScaling(type='dynamic'): theta = 10000 and factor = 4.61169e+18 give inv_freq[");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).theta(1e-300).angle_dtype(torch::kFloat32)), "theta=1e-300");
  expect_value_error(
      build(RotaryEmbeddingOptions(8).theta(1e-300).angle_dtype(torch::kFloat32)), "for float32 angles");
  expect_value_error([] { rotary::sinusoidal_table(64, 64, 5e-324); }, "sinusoidal_table: base = 4.94066e-324");
  // Finite, but past 2^62 rad no float64 angle keeps its phase.
  expect_value_error(build(RotaryEmbeddingOptions(8).theta(1e-300)), "float64 angles keep their phase below 2^62 rad");
  // Finite at the edges that are fine.
  RotaryEmbedding ok(RotaryEmbeddingOptions(8).theta(1e-10));
  EXPECT_TRUE(at::isfinite(at::view_as_real(ok->freqs)).all().item<bool>());
}

}  // namespace
