// One function per frequency rule (rotary/scaling.h), (scaling, theta,
// rotary_dim, seq_len) -> frequencies; rules.cpp holds their table, fields and
// checks.
#pragma once

#include <rotary/freqs.h>
#include <rotary/scaling.h>

#include <cmath>
#include <cstdint>

namespace rotary {
namespace detail {

// Finite and > 0 (NaN is not).
inline bool positive(double v) {
  return std::isfinite(v) && v > 0;
}

RopeFrequencies default_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies linear_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies ntk_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies dynamic_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies yarn_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies llama3_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies longrope_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);
RopeFrequencies proportional_rule(const RopeScaling& s, double theta, int64_t d, int64_t seq_len);

}  // namespace detail
}  // namespace rotary
