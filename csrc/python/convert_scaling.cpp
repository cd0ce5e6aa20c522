// RopeScaling <-> the dict form of Hugging Face's rope_parameters (convert.h).
#include "convert.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace rotary {
namespace python {

using rotary::RopeScaling;

namespace {

double as_double(const std::string& key, py::handle v) {
  const auto d = number_of(v, "rope scaling", "'" + key + "'");
  TORCH_CHECK_VALUE(d, "rope scaling: '", key, "' must be a number, got ", repr_of(v));
  return *d;
}

int64_t as_int(const std::string& key, py::handle v) {
  const double d = as_double(key, v);
  TORCH_CHECK_VALUE(
      std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.0e15, "rope scaling: '", key,
      "' must be an integer of magnitude below 9e15, got ", repr_of(v));
  return static_cast<int64_t>(d);
}

bool as_bool(const std::string& key, py::handle v) {
  TORCH_CHECK_VALUE(
      py::isinstance<py::bool_>(v) || py::isinstance<py::int_>(v), "rope scaling: '", key,
      "' must be a bool, got ", repr_of(v));
  return v.cast<bool>();
}

std::vector<double> as_list(const std::string& key, py::handle v) {
  TORCH_CHECK_VALUE(
      py::isinstance<py::sequence>(v) && !py::isinstance<py::str>(v), "rope scaling: '", key,
      "' must be a list of numbers, got ", repr_of(v));
  std::vector<double> out;
  for (auto item : v.cast<py::sequence>()) out.push_back(as_double(key, item));
  return out;
}

constexpr const char* kKnownKeys =
    "rope_type (or type), factor, original_max_position_embeddings, max_position_embeddings, beta_fast, "
    "beta_slow, mscale, mscale_all_dim, attention_factor, truncate, low_freq_factor, high_freq_factor, "
    "short_factor, long_factor, partial_rotary_factor (proportional)";

}  // namespace

// A RopeScaling from a dict shaped like Hugging Face's rope_parameters.
// A key set to None counts as absent, except yarn's truncate: transformers
// reads .get("truncate", True), so None does not truncate. strict: an unknown key is an error
// (a typo would otherwise be silently ignored); from_hf_config passes
// strict=False because configs carry model keys such as rope_theta.
RopeScaling scaling_from_dict(const py::dict& d, bool strict) {
  RopeScaling s;
  std::optional<std::string> type;
  std::string type_key;
  for (auto item : d) {
    TORCH_CHECK_VALUE(
        py::isinstance<py::str>(item.first), "rope scaling: keys must be strings, got ", repr_of(item.first));
    const std::string key = item.first.cast<std::string>();
    const py::handle v = item.second;
    if (v.is_none() || (key != "rope_type" && key != "type")) continue;
    TORCH_CHECK_VALUE(py::isinstance<py::str>(v), "rope scaling: '", key, "' must be a string, got ", repr_of(v));
    const std::string t = v.cast<std::string>();
    TORCH_CHECK_VALUE(
        !type || *type == t, "rope scaling: '", type_key, "' = '", *type, "' and '", key, "' = '", t,
        "' disagree ('type' is an alias of 'rope_type')");
    type = t;
    type_key = key;
  }
  if (type) s.type(*type);
  // Catch an unknown type here, where the caller still sees their dict.
  const auto rule = rotary::rope_type_from_string(s.type());
  TORCH_CHECK_VALUE(
      rule.has_value(), "rope scaling: unknown rope_type '", s.type(), "'; expected one of ",
      rotary::rope_type_names());
  for (auto item : d) {
    const std::string key = item.first.cast<std::string>();
    const py::handle v = item.second;
    if (key == "truncate" && v.is_none() && *rule == rotary::RopeType::Yarn) s.truncate(false);
    if (v.is_none() || key == "rope_type" || key == "type") continue;
    // Not strict (a model config): fields of other rules are dropped, as
    // transformers ignores them. Strict: RopeScaling validation refuses them.
    if (!strict && !rotary::rule_uses_field(*rule, key)) continue;
    if (key == "factor") {
      s.factor(as_double(key, v));
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings(as_int(key, v));
    } else if (key == "max_position_embeddings") {
      s.max_position_embeddings(as_int(key, v));
    } else if (key == "beta_fast") {
      s.beta_fast(as_double(key, v));
    } else if (key == "beta_slow") {
      s.beta_slow(as_double(key, v));
    } else if (key == "mscale") {
      s.mscale(as_double(key, v));
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim(as_double(key, v));
    } else if (key == "attention_factor") {
      s.attention_factor(as_double(key, v));
    } else if (key == "truncate") {
      s.truncate(as_bool(key, v));
    } else if (key == "low_freq_factor") {
      s.low_freq_factor(as_double(key, v));
    } else if (key == "high_freq_factor") {
      s.high_freq_factor(as_double(key, v));
    } else if (key == "short_factor") {
      s.short_factor(as_list(key, v));
    } else if (key == "long_factor") {
      s.long_factor(as_list(key, v));
    } else if (key == "partial_rotary_factor" && *rule == rotary::RopeType::Proportional) {
      s.partial_rotary_factor(as_double(key, v));  // the rule's rotated share; elsewhere the model's span
    } else {
      TORCH_CHECK_VALUE(
          key != "rope_theta" && key != "partial_rotary_factor", "rope scaling: '", key,
          "' describes the model, not the frequency rule: pass theta= / dim= to RotaryEmbedding, or build "
          "it with RotaryEmbedding.from_hf_config(config)");
      TORCH_CHECK_VALUE(false, "rope scaling: unknown key '", key, "'; expected ", kKnownKeys);
    }
  }
  return s;
}

// The dict form back: rope_type, every optional field that is set, and the
// other fields where they differ from their defaults.
py::dict scaling_to_dict(const RopeScaling& s) {
  const RopeScaling defaults;
  py::dict d;
  d["rope_type"] = s.type();
  if (s.factor()) d["factor"] = *s.factor();
  if (s.original_max_position_embeddings()) {
    d["original_max_position_embeddings"] = *s.original_max_position_embeddings();
  }
  if (s.max_position_embeddings()) d["max_position_embeddings"] = *s.max_position_embeddings();
  if (s.beta_fast() != defaults.beta_fast()) d["beta_fast"] = s.beta_fast();
  if (s.beta_slow() != defaults.beta_slow()) d["beta_slow"] = s.beta_slow();
  if (s.mscale()) d["mscale"] = *s.mscale();
  if (s.mscale_all_dim()) d["mscale_all_dim"] = *s.mscale_all_dim();
  if (s.attention_factor()) d["attention_factor"] = *s.attention_factor();
  if (s.truncate() != defaults.truncate()) d["truncate"] = s.truncate();
  if (s.low_freq_factor() != defaults.low_freq_factor()) d["low_freq_factor"] = s.low_freq_factor();
  if (s.high_freq_factor() != defaults.high_freq_factor()) d["high_freq_factor"] = s.high_freq_factor();
  if (!s.short_factor().empty()) d["short_factor"] = s.short_factor();
  if (!s.long_factor().empty()) d["long_factor"] = s.long_factor();
  if (s.partial_rotary_factor() != defaults.partial_rotary_factor()) {
    d["partial_rotary_factor"] = s.partial_rotary_factor();
  }
  return d;
}

}  // namespace python
}  // namespace rotary
