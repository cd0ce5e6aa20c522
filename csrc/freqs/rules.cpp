// The frequency rules (rotary/scaling.h): their names, the fields each one
// reads and their checks; rule_math.cpp computes each one's frequencies.
#include "rule_math.h"

#include <rotary/bounds.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

namespace rotary {

using detail::positive;
using detail::default_rule;
using detail::linear_rule;
using detail::ntk_rule;
using detail::dynamic_rule;
using detail::yarn_rule;
using detail::llama3_rule;
using detail::longrope_rule;
using detail::proportional_rule;

namespace {

// ---- the fields, and which rule reads which

struct Field {
  const char* name;
  bool (*is_set)(const RopeScaling&);
};

const RopeScaling kDefaults;
const std::array<Field, 14> kFields = {{
    {"factor", [](const RopeScaling& s) { return s.factor().has_value(); }},
    {"original_max_position_embeddings",
     [](const RopeScaling& s) { return s.original_max_position_embeddings().has_value(); }},
    {"max_position_embeddings", [](const RopeScaling& s) { return s.max_position_embeddings().has_value(); }},
    // NaN differs from every default, so it counts as set.
    {"beta_fast", [](const RopeScaling& s) { return !(s.beta_fast() == kDefaults.beta_fast()); }},
    {"beta_slow", [](const RopeScaling& s) { return !(s.beta_slow() == kDefaults.beta_slow()); }},
    {"mscale", [](const RopeScaling& s) { return s.mscale().has_value(); }},
    {"mscale_all_dim", [](const RopeScaling& s) { return s.mscale_all_dim().has_value(); }},
    {"attention_factor", [](const RopeScaling& s) { return s.attention_factor().has_value(); }},
    {"truncate", [](const RopeScaling& s) { return s.truncate() != kDefaults.truncate(); }},
    {"low_freq_factor", [](const RopeScaling& s) { return !(s.low_freq_factor() == kDefaults.low_freq_factor()); }},
    {"high_freq_factor",
     [](const RopeScaling& s) { return !(s.high_freq_factor() == kDefaults.high_freq_factor()); }},
    {"short_factor", [](const RopeScaling& s) { return !s.short_factor().empty(); }},
    {"long_factor", [](const RopeScaling& s) { return !s.long_factor().empty(); }},
    {"partial_rotary_factor",
     [](const RopeScaling& s) { return !(s.partial_rotary_factor() == kDefaults.partial_rotary_factor()); }},
}};

struct Rule {
  RopeType type;
  const char* name;
  std::vector<std::string> fields;  // the fields it reads
  RopeFrequencies (*compute)(const RopeScaling&, double, int64_t, int64_t);
};

const std::array<Rule, 8>& rules() {
  static const std::array<Rule, 8> table = {{
      {RopeType::Default, "default", {}, &default_rule},
      {RopeType::Linear, "linear", {"factor"}, &linear_rule},
      {RopeType::Ntk, "ntk", {"factor"}, &ntk_rule},
      {RopeType::Dynamic, "dynamic", {"factor", "max_position_embeddings"}, &dynamic_rule},
      {RopeType::Yarn,
       "yarn",
       {"factor", "original_max_position_embeddings", "max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attention_factor", "truncate"},
       &yarn_rule},
      {RopeType::Llama3,
       "llama3",
       {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
       &llama3_rule},
      {RopeType::LongRope,
       "longrope",
       {"factor", "original_max_position_embeddings", "max_position_embeddings", "attention_factor", "short_factor",
        "long_factor"},
       &longrope_rule},
      {RopeType::Proportional, "proportional", {"factor", "partial_rotary_factor"}, &proportional_rule},
  }};
  return table;
}

const Rule& rule_of(RopeType type) {
  const auto i = static_cast<size_t>(type);
  TORCH_CHECK_VALUE(i < rules().size(), "rotary: RopeType ", i, " is not a rule; the rules: ", rope_type_names());
  return rules()[i];
}

std::string fields_of(RopeType type) {
  std::string out;
  for (const auto& name : rule_of(type).fields) out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? "none" : out;
}

void check_factor_list(const RopeScaling& s, const char* name, const std::vector<double>& v, int64_t rotary_dim) {
  TORCH_CHECK_VALUE(
      static_cast<int64_t>(v.size()) == rotary_dim / 2, "RopeScaling(type='", s.type(), "'): ", name,
      " must have rotary_dim / 2 = ", rotary_dim / 2, " entries (one per rotated pair), got ", v.size());
  for (size_t j = 0; j < v.size(); ++j) {
    TORCH_CHECK_VALUE(
        positive(v[j]), "RopeScaling(type='", s.type(), "'): ", name, "[", j, "] must be finite and > 0, got ",
        v[j]);
  }
}

}  // namespace

std::optional<RopeType> rope_type_from_string(const std::string& name) {
  for (const Rule& r : rules()) {
    if (name == r.name) return r.type;
  }
  return std::nullopt;
}

const char* to_string(RopeType type) {
  return rule_of(type).name;
}

const std::string& rope_type_names() {
  static const std::string names = [] {
    std::string out;
    for (const Rule& r : rules()) out += (out.empty() ? "" : ", ") + std::string(r.name);
    return out;
  }();
  return names;
}

RopeType rope_type_of(const RopeScaling& s) {
  const auto t = rope_type_from_string(s.type());
  TORCH_CHECK_VALUE(
      t.has_value(), "RopeScaling: unknown type (rope_type) '", s.type(), "'; expected one of ", rope_type_names());
  return *t;
}

bool rule_uses_field(RopeType type, const std::string& field) {
  const auto& fields = rule_of(type).fields;
  return std::find(fields.begin(), fields.end(), field) != fields.end();
}

bool depends_on_seq_len(const RopeScaling& scaling) {
  const auto t = rope_type_from_string(scaling.type());
  return t == RopeType::Dynamic || t == RopeType::LongRope;
}

void validate(const RopeScaling& s, int64_t rotary_dim) {
  const RopeType type = rope_type_of(s);
  const std::string& t = s.type();
#define ROTARY_SCALING_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "RopeScaling(type='", t, "'): ", __VA_ARGS__)
  ROTARY_SCALING_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rotary_dim must be even and > 0, got ", rotary_dim);
  for (const Field& f : kFields) {
    ROTARY_SCALING_CHECK(
        !f.is_set(s) || rule_uses_field(type, f.name), f.name, " is not a field of this rule (it would be ignored); ",
        "its fields: ", fields_of(type));
  }
  if (type == RopeType::Default) return;

  if (s.factor()) {
    ROTARY_SCALING_CHECK(positive(*s.factor()), "factor must be finite and > 0, got ", *s.factor());
  }
  if (s.max_position_embeddings()) {
    ROTARY_SCALING_CHECK(
        *s.max_position_embeddings() > 0, "max_position_embeddings must be > 0, got ",
        *s.max_position_embeddings());
  }
  if (s.original_max_position_embeddings()) {
    ROTARY_SCALING_CHECK(
        *s.original_max_position_embeddings() > 0, "original_max_position_embeddings must be > 0, got ",
        *s.original_max_position_embeddings());
  }
  if (s.attention_factor()) {
    ROTARY_SCALING_CHECK(
        positive(*s.attention_factor()), "attention_factor must be finite and > 0, got ", *s.attention_factor());
  }

  if (type == RopeType::Linear || type == RopeType::Ntk || type == RopeType::Dynamic || type == RopeType::Llama3) {
    ROTARY_SCALING_CHECK(s.factor().has_value(), "factor is required");
  }
  if (type == RopeType::Ntk || type == RopeType::Dynamic) {
    // The base change has exponent d / (d - 2).
    ROTARY_SCALING_CHECK(rotary_dim > 2, "rotary_dim must be > 2, got ", rotary_dim);
  }
  if (type == RopeType::Dynamic) {
    ROTARY_SCALING_CHECK(
        s.max_position_embeddings().has_value(),
        "max_position_embeddings is required (the length past which the base grows)");
  }
  if (type == RopeType::Yarn || type == RopeType::Llama3 || type == RopeType::LongRope) {
    ROTARY_SCALING_CHECK(
        s.original_max_position_embeddings().has_value(),
        "original_max_position_embeddings is required (the pre-training context length)");
  }
  if (type == RopeType::Yarn) {
    ROTARY_SCALING_CHECK(
        s.factor() || s.max_position_embeddings(),
        "factor is required (or max_position_embeddings, to derive it as max_position_embeddings / "
        "original_max_position_embeddings)");
    ROTARY_SCALING_CHECK(positive(s.beta_fast()), "beta_fast must be finite and > 0, got ", s.beta_fast());
    ROTARY_SCALING_CHECK(positive(s.beta_slow()), "beta_slow must be finite and > 0, got ", s.beta_slow());
    if (s.mscale()) ROTARY_SCALING_CHECK(std::isfinite(*s.mscale()), "mscale must be finite, got ", *s.mscale());
    if (s.mscale_all_dim()) {
      ROTARY_SCALING_CHECK(
          std::isfinite(*s.mscale_all_dim()), "mscale_all_dim must be finite, got ", *s.mscale_all_dim());
    }
  }
  if (type == RopeType::Llama3) {
    ROTARY_SCALING_CHECK(
        positive(s.low_freq_factor()), "low_freq_factor must be finite and > 0, got ", s.low_freq_factor());
    ROTARY_SCALING_CHECK(
        std::isfinite(s.high_freq_factor()) && s.high_freq_factor() > s.low_freq_factor(),
        "high_freq_factor must be finite and > low_freq_factor = ", s.low_freq_factor(), ", got ",
        s.high_freq_factor());
  }
  if (type == RopeType::Proportional) {
    ROTARY_SCALING_CHECK(
        s.partial_rotary_factor() > 0.0 && s.partial_rotary_factor() <= 1.0,
        "partial_rotary_factor must lie in (0, 1] (the share of the pairs that turn), got ",
        s.partial_rotary_factor());
  }
  if (type == RopeType::LongRope) {
    check_factor_list(s, "short_factor", s.short_factor(), rotary_dim);
    check_factor_list(s, "long_factor", s.long_factor(), rotary_dim);
    ROTARY_SCALING_CHECK(
        s.factor() || s.max_position_embeddings() || s.attention_factor(),
        "factor is required to derive the attention scaling (or max_position_embeddings, or attention_factor)");
  }
#undef ROTARY_SCALING_CHECK
}

void check_table_args(const char* who, const char* dim_name, int64_t dim, double theta, int64_t seq_len,
                      int64_t max_seq_len) {
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, who, ": ", dim_name, " must be even and > 0, got ", dim);
  TORCH_CHECK_VALUE(dim <= kMaxRotaryDim, who, ": ", dim_name, " must be <= 2^20 (the rotated width of a head), got ",
                    dim);
  TORCH_CHECK_VALUE(max_seq_len >= 0, who, ": max_seq_len must be >= 0, got ", max_seq_len);
  TORCH_CHECK_VALUE(std::isfinite(theta) && theta > 0.0, who, ": theta must be finite and > 0, got ", theta);
  TORCH_CHECK_VALUE(seq_len >= 0, who, ": seq_len must be >= 0, got ", seq_len);
}

RopeFrequencies compute_frequencies(int64_t rotary_dim, double theta, const RopeScaling& s, int64_t seq_len) {
  check_table_args("compute_frequencies", "rotary_dim", rotary_dim, theta, seq_len);
  validate(s, rotary_dim);
  const Rule& rule = rule_of(rope_type_of(s));
  RopeFrequencies out = rule.compute(s, theta, rotary_dim, seq_len);
  // Every table is built from these: a non-finite one would give NaN rows.
  for (size_t j = 0; j < out.inv_freq.size(); ++j) {
    if (std::isfinite(out.inv_freq[j])) continue;
    std::ostringstream with;
    if (s.factor()) with << " and factor = " << *s.factor();
    if (seq_len > 0) with << " at seq_len " << seq_len;
    TORCH_CHECK_VALUE(
        false, "RopeScaling(type='", s.type(), "'): theta = ", theta, with.str(), " give inv_freq[", j,
        "] = ", out.inv_freq[j], "; every frequency must be finite (a factor or theta out of range)");
  }
  TORCH_CHECK_VALUE(
      positive(out.attention_scaling), "RopeScaling(type='", s.type(), "'): the attention scaling is ",
      out.attention_scaling, "; it must be finite and > 0");
  return out;
}

}  // namespace rotary
