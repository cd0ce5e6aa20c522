// Frequency (scaling) rules: which inverse frequency each rotated pair gets,
// and the factor every cos/sin entry is multiplied by.
//
// The rules and their field names follow Hugging Face `rope_parameters`
// (transformers' modeling_rope_utils), so a config's dict maps one to one.
// Every rule is computed once, in float64, by compute_frequencies() in
// csrc/freqs/freqs.cpp; the modules and the Python package only call it.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rotary {

// The frequency rules, one name each. The names are listed once
// (rope_type_names) and parsed / printed only by the functions below.
enum class RopeType { Default, Linear, Ntk, Dynamic, Yarn, Llama3, LongRope, Proportional };

// "default" -> RopeType::Default, ...; std::nullopt for an unknown name.
std::optional<RopeType> rope_type_from_string(const std::string& name);
const char* to_string(RopeType type);
// "default, linear, ntk, dynamic, yarn, llama3, longrope, proportional", for messages.
const std::string& rope_type_names();

// Which rule and its parameters. Setting a field the rule does not use (an
// optional one, or another to a value other than its default) is an error,
// as an unknown key is: it would otherwise be silently ignored.
//
//   "default"   inv_freq_j = theta^(-2j/d)                 (d = rotary dim)
//   "linear"    default / factor                  (position interpolation)
//   "ntk"       default with base theta * factor^(d/(d-2)) (static NTK-aware)
//   "dynamic"   default with base theta * (factor*L/M - (factor-1))^(d/(d-2)),
//               L = max(seq_len, M), M = max_position_embeddings (HF dynamic NTK)
//   "yarn"      per-pair blend of default and default/factor by a linear
//               ramp between the dims whose wavelength fits beta_fast and
//               beta_slow turns into original_max_position_embeddings;
//               attention scaling 0.1*ln(factor)+1 (or from mscale,
//               mscale_all_dim, or attention_factor when given)
//   "llama3"    Llama 3.1: wavelengths above original/low_freq_factor divided
//               by factor, below original/high_freq_factor kept, smooth between
//   "longrope"  default / short_factor[j], or / long_factor[j] once seq_len
//               exceeds original_max_position_embeddings; attention scaling
//               sqrt(1 + ln(factor)/ln(original)) (or attention_factor)
//   "proportional" Gemma 4: the first floor(partial_rotary_factor * d / 2)
//               pairs turn at theta^(-2j/d) / factor (d the whole head), the
//               others not at all (inv_freq 0): rotate_half over the head
//               with a rotated share, unlike a partial rotary span
//
// "dynamic" and "longrope" depend on the sequence length, so the modules
// recompute their tables on the host when it crosses a threshold; see
// RotaryEmbeddingImpl. The others are fixed at construction.
struct RopeScaling {
  RopeScaling() = default;
  /* implicit */ RopeScaling(std::string type) : type_(std::move(type)) {}
  /* implicit */ RopeScaling(const char* type) : type_(type) {}

  // One of default, linear, ntk, dynamic, yarn, llama3, longrope, proportional.
  TORCH_ARG(std::string, type) = "default";
  // Context-extension factor (> 0). Required by linear, ntk, dynamic and
  // llama3; proportional divides by it when set. yarn and longrope derive it, when unset, as
  // max_position_embeddings / original_max_position_embeddings (as HF does).
  TORCH_ARG(std::optional<double>, factor) = std::nullopt;
  // Pre-training context length; required by yarn, llama3 and longrope.
  TORCH_ARG(std::optional<int64_t>, original_max_position_embeddings) = std::nullopt;
  // Current context length of the model; required by dynamic (its M), and
  // used by yarn / longrope only to derive an unset factor.
  TORCH_ARG(std::optional<int64_t>, max_position_embeddings) = std::nullopt;
  // yarn: the ramp runs between the dims making beta_fast and beta_slow turns
  // over original_max_position_embeddings positions.
  TORCH_ARG(double, beta_fast) = 32.0;
  TORCH_ARG(double, beta_slow) = 1.0;
  // yarn: when both are set (and non-zero) the attention scaling is
  // (0.1*mscale*ln(factor)+1) / (0.1*mscale_all_dim*ln(factor)+1).
  TORCH_ARG(std::optional<double>, mscale) = std::nullopt;
  TORCH_ARG(std::optional<double>, mscale_all_dim) = std::nullopt;
  // yarn, longrope: overrides the derived attention scaling.
  TORCH_ARG(std::optional<double>, attention_factor) = std::nullopt;
  // yarn: round the ramp ends outwards to whole dims (floor / ceil).
  TORCH_ARG(bool, truncate) = true;
  // llama3: wavelength band edges are original / low_freq_factor and
  // original / high_freq_factor (high > low).
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  // longrope: one divisor per rotated pair (rotary_dim / 2 each).
  TORCH_ARG(std::vector<double>, short_factor);
  TORCH_ARG(std::vector<double>, long_factor);
  // proportional: the share of the pairs that turn, in (0, 1].
  TORCH_ARG(double, partial_rotary_factor) = 1.0;
};

// Throws c10::ValueError naming the offending field when `scaling` cannot be
// applied to a rotary dim of `rotary_dim` (an unknown type, a missing or
// invalid field, or a field the rule does not use).
void validate(const RopeScaling& scaling, int64_t rotary_dim);

// The rule of `scaling` (c10::ValueError for an unknown type).
RopeType rope_type_of(const RopeScaling& scaling);

// Whether `type` reads the RopeScaling field named `field` (the dict key,
// e.g. "beta_fast"); Python's from_dict(strict=False) drops the others.
bool rule_uses_field(RopeType type, const std::string& field);

// True for the rules whose frequencies depend on the sequence length.
bool depends_on_seq_len(const RopeScaling& scaling);

}  // namespace rotary
