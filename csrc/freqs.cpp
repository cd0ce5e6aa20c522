#include <rotary/freqs.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/complex.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace rotary {

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr const char* kTypes = "default, linear, ntk, dynamic, yarn, llama3, longrope";

bool is_known_type(const std::string& t) {
  return t == "default" || t == "linear" || t == "ntk" || t == "dynamic" || t == "yarn" || t == "llama3" ||
      t == "longrope";
}

bool positive(double v) {
  return std::isfinite(v) && v > 0.0;
}

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
std::optional<double> effective_factor(const RopeScaling& s) {
  if (s.factor()) return s.factor();
  if (s.max_position_embeddings() && s.original_max_position_embeddings()) {
    return static_cast<double>(*s.max_position_embeddings()) /
        static_cast<double>(*s.original_max_position_embeddings());
  }
  return std::nullopt;
}

// YaRN's attention temperature: 0.1 * m * ln(scale) + 1, or 1 without scaling.
double yarn_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
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

bool depends_on_seq_len(const RopeScaling& scaling) {
  return scaling.type() == "dynamic" || scaling.type() == "longrope";
}

void validate(const RopeScaling& s, int64_t rotary_dim) {
  const std::string& t = s.type();
  TORCH_CHECK_VALUE(is_known_type(t), "RopeScaling: unknown type (rope_type) '", t, "'; expected one of ", kTypes);
  if (t == "default") return;
#define ROTARY_SCALING_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "RopeScaling(type='", t, "'): ", __VA_ARGS__)

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

  if (t == "linear" || t == "ntk" || t == "dynamic" || t == "llama3") {
    ROTARY_SCALING_CHECK(s.factor().has_value(), "factor is required");
  }
  if (t == "ntk" || t == "dynamic") {
    // The base change has exponent d / (d - 2).
    ROTARY_SCALING_CHECK(rotary_dim > 2, "rotary_dim must be > 2, got ", rotary_dim);
  }
  if (t == "dynamic") {
    ROTARY_SCALING_CHECK(
        s.max_position_embeddings().has_value(),
        "max_position_embeddings is required (the length past which the base grows)");
  }
  if (t == "yarn" || t == "llama3" || t == "longrope") {
    ROTARY_SCALING_CHECK(
        s.original_max_position_embeddings().has_value(),
        "original_max_position_embeddings is required (the pre-training context length)");
  }
  if (t == "yarn") {
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
  if (t == "llama3") {
    ROTARY_SCALING_CHECK(
        positive(s.low_freq_factor()), "low_freq_factor must be finite and > 0, got ", s.low_freq_factor());
    ROTARY_SCALING_CHECK(
        std::isfinite(s.high_freq_factor()) && s.high_freq_factor() > s.low_freq_factor(),
        "high_freq_factor must be finite and > low_freq_factor = ", s.low_freq_factor(), ", got ",
        s.high_freq_factor());
  }
  if (t == "longrope") {
    check_factor_list(s, "short_factor", s.short_factor(), rotary_dim);
    check_factor_list(s, "long_factor", s.long_factor(), rotary_dim);
    ROTARY_SCALING_CHECK(
        s.factor() || s.max_position_embeddings() || s.attention_factor(),
        "factor is required to derive the attention scaling (or max_position_embeddings, or attention_factor)");
  }
#undef ROTARY_SCALING_CHECK
}

RopeFrequencies compute_frequencies(int64_t rotary_dim, double theta, const RopeScaling& s, int64_t seq_len) {
  TORCH_CHECK_VALUE(
      rotary_dim > 0 && rotary_dim % 2 == 0, "compute_frequencies: rotary_dim must be even and > 0, got ",
      rotary_dim);
  TORCH_CHECK_VALUE(
      std::isfinite(theta) && theta > 0.0, "compute_frequencies: theta must be finite and > 0, got ", theta);
  TORCH_CHECK_VALUE(seq_len >= 0, "compute_frequencies: seq_len must be >= 0, got ", seq_len);
  validate(s, rotary_dim);

  const std::string& t = s.type();
  const double d = static_cast<double>(rotary_dim);
  RopeFrequencies out;

  if (t == "default") {
    out.inv_freq = base_inv_freq(rotary_dim, theta);
  } else if (t == "linear") {
    out.inv_freq = base_inv_freq(rotary_dim, theta);
    for (double& f : out.inv_freq) f /= *s.factor();
  } else if (t == "ntk") {
    out.inv_freq = base_inv_freq(rotary_dim, theta * std::pow(*s.factor(), d / (d - 2.0)));
  } else if (t == "dynamic") {
    const double factor = *s.factor();
    const double max_pos = static_cast<double>(*s.max_position_embeddings());
    const double len = std::max(static_cast<double>(seq_len), max_pos);
    const double base = theta * std::pow(factor * len / max_pos - (factor - 1.0), d / (d - 2.0));
    out.inv_freq = base_inv_freq(rotary_dim, base);
  } else if (t == "yarn") {
    TORCH_CHECK_VALUE(theta != 1.0, "RopeScaling(type='yarn'): theta must not be 1 (its log is a divisor)");
    const double factor = *effective_factor(s);
    const double original = static_cast<double>(*s.original_max_position_embeddings());
    if (s.attention_factor()) {
      out.attention_scaling = *s.attention_factor();
    } else if (s.mscale() && s.mscale_all_dim() && *s.mscale() != 0.0 && *s.mscale_all_dim() != 0.0) {
      out.attention_scaling = yarn_mscale(factor, *s.mscale()) / yarn_mscale(factor, *s.mscale_all_dim());
    } else {
      out.attention_scaling = yarn_mscale(factor, 1.0);
    }
    // The (fractional) dim whose pair makes `turns` full turns over the
    // original context: d * ln(original / (turns * 2 pi)) / (2 ln theta).
    auto correction_dim = [&](double turns) {
      return d * std::log(original / (turns * 2.0 * kPi)) / (2.0 * std::log(theta));
    };
    double low = correction_dim(s.beta_fast());
    double high = correction_dim(s.beta_slow());
    if (s.truncate()) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, d - 1.0);
    if (low == high) high += 0.001;  // no zero-width ramp
    out.inv_freq = base_inv_freq(rotary_dim, theta);
    for (size_t j = 0; j < out.inv_freq.size(); ++j) {
      // ramp 0: keep the original frequency (extrapolate); 1: divide by factor (interpolate).
      const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
      const double extrapolated = out.inv_freq[j];
      const double interpolated = extrapolated / factor;
      out.inv_freq[j] = interpolated * ramp + extrapolated * (1.0 - ramp);
    }
  } else if (t == "llama3") {
    const double factor = *s.factor();
    const double original = static_cast<double>(*s.original_max_position_embeddings());
    const double lo = s.low_freq_factor();
    const double hi = s.high_freq_factor();
    const double low_freq_wavelen = original / lo;    // longer than this: divide by factor
    const double high_freq_wavelen = original / hi;   // shorter than this: keep
    out.inv_freq = base_inv_freq(rotary_dim, theta);
    for (double& f : out.inv_freq) {
      const double wavelen = 2.0 * kPi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (original / wavelen - lo) / (hi - lo);
        f = (1.0 - smooth) * f / factor + smooth * f;
      }
    }
  } else if (t == "longrope") {
    const double original = static_cast<double>(*s.original_max_position_embeddings());
    if (s.attention_factor()) {
      out.attention_scaling = *s.attention_factor();
    } else {
      const double factor = *effective_factor(s);
      out.attention_scaling = factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(original));
    }
    const auto& ext = static_cast<double>(seq_len) > original ? s.long_factor() : s.short_factor();
    out.inv_freq = base_inv_freq(rotary_dim, theta);
    for (size_t j = 0; j < out.inv_freq.size(); ++j) out.inv_freq[j] /= ext[j];
  }
  return out;
}

void check_angle_dtype(at::ScalarType angle_dtype, const char* who) {
  TORCH_CHECK_VALUE(
      angle_dtype == at::kDouble || angle_dtype == at::kFloat, who,
      ": angle_dtype must be float64 (exact angles, the default) or float32 (the fp32-angle tables of "
      "Hugging Face / Meta), got ",
      angle_dtype);
}

at::ScalarType angle_dtype_from_string(const std::string& name, const char* who) {
  if (name == "float64" || name == "torch.float64") return at::kDouble;
  if (name == "float32" || name == "torch.float32") return at::kFloat;
  TORCH_CHECK_VALUE(
      false, who, ": angle_dtype must be 'float64' (exact angles, the default) or 'float32' (the fp32-angle ",
      "tables of Hugging Face / Meta), got '", name, "'");
  return at::kDouble;
}

std::string angle_dtype_name(at::ScalarType angle_dtype) {
  return angle_dtype == at::kFloat ? "float32" : "float64";
}

namespace {

// One table entry; freqs_table and freqs_at share it, so a row is the same
// bits whichever builds it.
struct EntryMaker {
  const double* inv_freq;
  std::vector<float> inv_freq32;  // float(inv_freq[j]), fp32-angle mode only
  double scale;
  bool fp32_angle;

  EntryMaker(const RopeFrequencies& f, at::ScalarType angle_dtype)
      : inv_freq(f.inv_freq.data()), scale(f.attention_scaling), fp32_angle(angle_dtype == at::kFloat) {
    if (fp32_angle) inv_freq32.assign(f.inv_freq.begin(), f.inv_freq.end());
  }

  c10::complex<float> operator()(int64_t pos, int64_t j) const {
    double angle;
    if (fp32_angle) {
      // torch.outer(t.float(), inv_freq.float()): each factor rounded to
      // float, the product rounded to float (a plain float multiply; there
      // is no sum for the compiler to contract into an FMA).
      const float a = static_cast<float>(pos) * inv_freq32[j];
      angle = static_cast<double>(a);
    } else {
      angle = static_cast<double>(pos) * inv_freq[j];
    }
    return c10::complex<float>(
        static_cast<float>(scale * std::cos(angle)), static_cast<float>(scale * std::sin(angle)));
  }
};

}  // namespace

at::Tensor freqs_table(const RopeFrequencies& freqs, int64_t max_seq_len, at::ScalarType angle_dtype) {
  TORCH_CHECK_VALUE(max_seq_len >= 0, "freqs_table: max_seq_len must be >= 0, got ", max_seq_len);
  check_angle_dtype(angle_dtype, "freqs_table");
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  const EntryMaker entry(freqs, angle_dtype);
  auto table = at::empty({max_seq_len, pairs}, at::TensorOptions().dtype(at::kComplexFloat));
  auto* out = table.data_ptr<c10::complex<float>>();
  // Angle, cos, sin and the scaling all in float64; one rounding to float at
  // the end keeps the table within ~3e-8 of exact even at millions of positions.
  at::parallel_for(0, max_seq_len, 256, [&](int64_t begin, int64_t end) {
    for (int64_t pos = begin; pos < end; ++pos) {
      for (int64_t j = 0; j < pairs; ++j) out[pos * pairs + j] = entry(pos, j);
    }
  });
  return table;
}

at::Tensor freqs_at(const RopeFrequencies& freqs, const at::Tensor& positions, at::ScalarType angle_dtype) {
  check_angle_dtype(angle_dtype, "freqs_at");
  TORCH_CHECK_TYPE(
      positions.scalar_type() == at::kLong, "freqs_at: positions must be int64, got ", positions.scalar_type());
  TORCH_CHECK_VALUE(positions.dim() == 1, "freqs_at: positions must be 1-D, got shape ", positions.sizes());
  const at::Tensor pos = positions.to(at::kCPU).contiguous();
  const int64_t n = pos.numel();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0, "freqs_at: positions must be >= 0, got ", p[i], " at index ", i);
  }
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  const EntryMaker entry(freqs, angle_dtype);
  auto table = at::empty({n, pairs}, at::TensorOptions().dtype(at::kComplexFloat));
  auto* out = table.data_ptr<c10::complex<float>>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < pairs; ++j) out[i * pairs + j] = entry(p[i], j);
    }
  });
  return table;
}

at::Tensor inv_freq_tensor(const RopeFrequencies& freqs) {
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  auto t = at::empty({pairs}, at::TensorOptions().dtype(at::kDouble));
  std::copy(freqs.inv_freq.begin(), freqs.inv_freq.end(), t.data_ptr<double>());
  return t;
}

at::Tensor rope_freqs(
    int64_t dim,
    int64_t max_seq_len,
    double theta,
    const RopeScaling& scaling,
    int64_t seq_len,
    at::ScalarType angle_dtype) {
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, "rope_freqs: dim must be even and > 0, got ", dim);
  TORCH_CHECK_VALUE(max_seq_len >= 0, "rope_freqs: max_seq_len must be >= 0, got ", max_seq_len);
  TORCH_CHECK_VALUE(
      std::isfinite(theta) && theta > 0.0, "rope_freqs: theta must be finite and > 0, got ", theta);
  check_angle_dtype(angle_dtype, "rope_freqs");
  return freqs_table(compute_frequencies(dim, theta, scaling, seq_len), max_seq_len, angle_dtype);
}

at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta) {
  return rope_freqs(dim, max_seq_len, theta, RopeScaling());
}

}  // namespace rotary
