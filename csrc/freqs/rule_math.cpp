// The frequencies of each rule (rule_math.h), in float64.
#include "rule_math.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace rotary {
namespace detail {
namespace {

constexpr double kPi = 3.14159265358979323846;


// theta^(-2j/d) for j = 0 .. d/2 - 1: the frequencies every rule starts from.
std::vector<double> base_inv_freq(int64_t rotary_dim, double base) {
  const int64_t pairs = rotary_dim / 2;
  std::vector<double> inv(pairs);
  for (int64_t j = 0; j < pairs; ++j) {
    inv[j] = std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(rotary_dim));
  }
  return inv;
}

// yarn and longrope: factor as given, else max_position_embeddings / original.
double effective_factor(const RopeScaling& s) {
  if (s.factor()) return *s.factor();
  return static_cast<double>(*s.max_position_embeddings()) / static_cast<double>(*s.original_max_position_embeddings());
}

// YaRN's attention temperature: 0.1 * m * ln(scale) + 1, or 1 without scaling.
double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

}  // namespace

// ---- one function per rule: (scaling, theta, rotary_dim, seq_len) -> frequencies

RopeFrequencies default_rule(const RopeScaling&, double theta, int64_t d, int64_t) {
  return {base_inv_freq(d, theta), 1.0};
}

RopeFrequencies linear_rule(const RopeScaling& s, double theta, int64_t d, int64_t) {
  RopeFrequencies out{base_inv_freq(d, theta), 1.0};
  for (double& f : out.inv_freq) f /= *s.factor();
  return out;
}

// ntk and dynamic: theta grown to theta * growth^(d / (d - 2)). Past a
// double's range the base would give inv_freq = 1, 0, 0, ... (inf^0, inf^-x),
// finite and wrong: refused (validate() keeps d > 2).
namespace {
std::vector<double> grown_inv_freq(const RopeScaling& s, double theta, int64_t d, double growth, int64_t seq_len) {
  const double dd = static_cast<double>(d);
  const double base = theta * std::pow(growth, dd / (dd - 2.0));
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0.0, "RopeScaling(type='", s.type(), "'): theta = ", theta,
                    " and factor = ", *s.factor(), seq_len > 0 ? " at seq_len " + std::to_string(seq_len) : "",
                    " grow the base to theta * ", growth, "^(d / (d - 2)) = ", base,
                    " (rotary_dim d = ", d, "); it must be finite and > 0 (a factor or theta out of range)");
  return base_inv_freq(d, base);
}
}  // namespace

RopeFrequencies ntk_rule(const RopeScaling& s, double theta, int64_t d, int64_t) {
  return {grown_inv_freq(s, theta, d, *s.factor(), 0), 1.0};
}

RopeFrequencies dynamic_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len) {
  const double factor = *s.factor();
  const double max_pos = static_cast<double>(*s.max_position_embeddings());
  const double len = std::max(static_cast<double>(seq_len), max_pos);
  return {grown_inv_freq(s, theta, d, factor * len / max_pos - (factor - 1.0), seq_len), 1.0};
}

RopeFrequencies yarn_rule(const RopeScaling& s, double theta, int64_t d, int64_t) {
  TORCH_CHECK_VALUE(theta != 1.0, "RopeScaling(type='yarn'): theta must not be 1 (its log is a divisor)");
  const double dd = static_cast<double>(d);
  const double factor = effective_factor(s);
  const double original = static_cast<double>(*s.original_max_position_embeddings());
  RopeFrequencies out;
  if (s.attention_factor()) {
    out.attention_scaling = *s.attention_factor();
  } else if (s.mscale() && s.mscale_all_dim() && *s.mscale() != 0.0 && *s.mscale_all_dim() != 0.0) {
    out.attention_scaling = yarn_mscale(factor, *s.mscale()) / yarn_mscale(factor, *s.mscale_all_dim());
    TORCH_CHECK_VALUE(
        positive(out.attention_scaling), "RopeScaling(type='yarn'): mscale = ", *s.mscale(),
        " and mscale_all_dim = ", *s.mscale_all_dim(), " give the attention scaling ", out.attention_scaling,
        " (with factor ", factor, "); it must be finite and > 0");
  } else {
    out.attention_scaling = yarn_mscale(factor, 1.0);
  }
  // The (fractional) dim whose pair makes `turns` full turns over the
  // original context: d * ln(original / (turns * 2 pi)) / (2 ln theta).
  auto correction_dim = [&](double turns) {
    return dd * std::log(original / (turns * 2.0 * kPi)) / (2.0 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast());
  double high = correction_dim(s.beta_slow());
  if (s.truncate()) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dd - 1.0);
  if (low == high) high += 0.001;  // no zero-width ramp
  out.inv_freq = base_inv_freq(d, theta);
  for (size_t j = 0; j < out.inv_freq.size(); ++j) {
    // ramp 0: keep the original frequency (extrapolate); 1: divide by factor (interpolate).
    const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
    const double extrapolated = out.inv_freq[j];
    out.inv_freq[j] = extrapolated / factor * ramp + extrapolated * (1.0 - ramp);
  }
  return out;
}

RopeFrequencies llama3_rule(const RopeScaling& s, double theta, int64_t d, int64_t) {
  const double factor = *s.factor();
  const double original = static_cast<double>(*s.original_max_position_embeddings());
  const double lo = s.low_freq_factor();
  const double hi = s.high_freq_factor();
  const double low_freq_wavelen = original / lo;   // longer than this: divide by factor
  const double high_freq_wavelen = original / hi;  // shorter than this: keep
  RopeFrequencies out{base_inv_freq(d, theta), 1.0};
  for (double& f : out.inv_freq) {
    const double wavelen = 2.0 * kPi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (original / wavelen - lo) / (hi - lo);
      f = (1.0 - smooth) * f / factor + smooth * f;
    }
  }
  return out;
}

RopeFrequencies longrope_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len) {
  const double original = static_cast<double>(*s.original_max_position_embeddings());
  RopeFrequencies out{base_inv_freq(d, theta), 1.0};
  if (s.attention_factor()) {
    out.attention_scaling = *s.attention_factor();
  } else {
    const double factor = effective_factor(s);
    out.attention_scaling = factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(original));
  }
  const auto& ext = static_cast<double>(seq_len) > original ? s.long_factor() : s.short_factor();
  for (size_t j = 0; j < out.inv_freq.size(); ++j) out.inv_freq[j] /= ext[j];
  return out;
}

RopeFrequencies proportional_rule(const RopeScaling& s, double theta, int64_t d, int64_t) {
  RopeFrequencies out{base_inv_freq(d, theta), 1.0};
  const auto turning = static_cast<size_t>(std::floor(s.partial_rotary_factor() * static_cast<double>(d) / 2.0));
  const double factor = s.factor().value_or(1.0);
  for (size_t j = 0; j < out.inv_freq.size(); ++j) out.inv_freq[j] = j < turning ? out.inv_freq[j] / factor : 0.0;
  return out;
}

}  // namespace detail
}  // namespace rotary
