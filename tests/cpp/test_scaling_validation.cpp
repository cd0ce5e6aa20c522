// Frequency (scaling) rules, validation: the c10::ValueError messages that
// name the field, the rule names, fields of other rules and non-finite
// tables refused, and Gemma 4's proportional rule with its range check.
// A file of its own to be read in one sitting (the formulas:
// test_scaling_formula.cpp).
#include <rotary/rotary.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <cmath>
#include <string>

namespace {

using rotary::RopeScaling;
using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;

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
      "RopeScaling(type='dynamic'): theta = 10000 and factor = 4.61169e+18 grow the base to theta * 0^(d / (d - 2)) "
      "= 0");
  // A base past a double's range would give inv_freq = 1, 0, 0, ...: finite, and wrong.
  expect_value_error(
      build(RotaryEmbeddingOptions(128).theta(1.5e308).scaling(RopeScaling("ntk").factor(2.0))),
      "RopeScaling(type='ntk'): theta = 1.5e+308 and factor = 2 grow the base to theta * 2^(d / (d - 2)) = inf");
  expect_value_error(
      build(RotaryEmbeddingOptions(128).scaling(RopeScaling("ntk").factor(1e300))), "= inf (rotary_dim d = 128)");
  {
    // Built at its original length, a grown dynamic base past the range is refused when a call reaches it,
    // and the module keeps its tables.
    RotaryEmbedding grows(RotaryEmbeddingOptions(128).max_seq_len(16).theta(1.5e308).scaling(
        RopeScaling("dynamic").factor(2.0).max_position_embeddings(4096)));
    const auto before = grows->inv_freq.clone();
    expect_value_error([&] { grows->update_for_reach(8192); }, "at seq_len 8192 grow the base");
    EXPECT_TRUE(torch::equal(grows->inv_freq, before));
    EXPECT_EQ(grows->tables().state(), 0);
    expect_value_error([&] { grows->update_for_reach((int64_t{1} << 60) + 1); },
                       "update_for_reach: reach (one past the largest position of a call) must be in [0, 2^60], got "
                       "1152921504606846977");
    expect_value_error([&] { grows->update_for_reach(-1); }, "must be in [0, 2^60], got -1");
  }
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
