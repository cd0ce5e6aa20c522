#include <rotary/bounds.h>
#include <rotary/freqs.h>

#include "freqs/host_tensor.h"
#include "params/rope_params.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/complex.h>

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace rotary {

void check_angle_dtype(at::ScalarType angle_dtype, const char* who) {
  TORCH_CHECK_VALUE(
      angle_dtype == at::kDouble || angle_dtype == at::kFloat, who,
      ": angle_dtype must be float64 (exact angles, the default) or float32 (the fp32-angle tables of "
      "Hugging Face / Meta), got ",
      angle_dtype);
}

at::ScalarType angle_dtype_from_string(const std::string& name, const char* who, bool quote) {
  if (name == "float64" || name == "torch.float64") return at::kDouble;
  if (name == "float32" || name == "torch.float32") return at::kFloat;
  const char* q = quote ? "'" : "";
  TORCH_CHECK_VALUE(
      false, who, ": angle_dtype must be 'float64' (exact angles, the default) or 'float32' (the fp32-angle ",
      "tables of Hugging Face / Meta), got ", q, name, q);
  return at::kDouble;
}

std::string number_text(double value) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), value);
  return std::string(buf, r.ptr);
}

std::string angle_dtype_name(at::ScalarType angle_dtype) {
  if (angle_dtype == at::kFloat) return "float32";
  if (angle_dtype == at::kDouble) return "float64";
  return c10::toString(angle_dtype);  // not an angle dtype: named as torch names it
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
    kernel::CosSin cs;
    if (fp32_angle) {
      // torch.outer(t.float(), inv_freq.float()): each factor rounded to
      // float, the product rounded to float (a plain float multiply; there
      // is no sum for the compiler to contract into an FMA).
      const double angle = static_cast<double>(static_cast<float>(pos) * inv_freq32[j]);
      cs = {std::cos(angle), std::sin(angle)};
    } else {
      cs = kernel::cos_sin_at(pos, inv_freq[j]);  // the on-the-fly path's own, so rows match it bit for bit
    }
    return c10::complex<float>(static_cast<float>(scale * cs.c), static_cast<float>(scale * cs.s));
  }
};

// Every entry up to position `last` is a complex64 number: the scaling a
// normal float32, every angle finite (float64 angles below 2^62 rad, where
// kernel::reduced_angle keeps the phase).
void check_entries(const RopeFrequencies& freqs, const EntryMaker& entry, double last, at::ScalarType angle_dtype,
                   const char* who) {
  TORCH_CHECK_VALUE(
      std::isfinite(static_cast<float>(freqs.attention_scaling)) &&
          static_cast<float>(freqs.attention_scaling) >= std::numeric_limits<float>::min(),
      who, ": the attention scaling ", freqs.attention_scaling,
      " does not fit a complex64 entry (a normal float32, [1.2e-38, 3.4e38])");
  for (size_t j = 0; j < freqs.inv_freq.size(); ++j) {
    const double angle = entry.fp32_angle ? static_cast<double>(static_cast<float>(last) * entry.inv_freq32[j])
                                          : last * freqs.inv_freq[j];
    TORCH_CHECK_VALUE(
        std::isfinite(angle) && std::isfinite(entry.fp32_angle ? entry.inv_freq32[j] : freqs.inv_freq[j]),
        who, ": inv_freq[", j, "] = ", freqs.inv_freq[j], " gives a non-finite angle at row ", last,
        " with angle_dtype=", angle_dtype_name(angle_dtype), " (theta or a factor of the rule out of range",
        entry.fp32_angle ? " for float32 angles; use angle_dtype float64)" : ")");
    TORCH_CHECK_VALUE(
        entry.fp32_angle || std::abs(angle) < 0x1p62, who, ": inv_freq[", j, "] = ", freqs.inv_freq[j],
        " gives the angle ", angle, " rad at row ", last, "; float64 angles keep their phase below 2^62 rad ",
        "(theta or a factor of the rule out of range)");
  }
}

}  // namespace

at::Tensor freqs_table(const RopeFrequencies& freqs, int64_t max_seq_len, at::ScalarType angle_dtype) {
  TORCH_CHECK_VALUE(max_seq_len >= 0, "freqs_table: max_seq_len must be >= 0, got ", max_seq_len);
  return detail::freqs_table_worded(freqs, max_seq_len, angle_dtype,
                                    "a table of max_seq_len=" + std::to_string(max_seq_len) + " rows x dim // 2 = " +
                                        std::to_string(freqs.inv_freq.size()) + " pairs",
                                    "pass a smaller max_seq_len");
}

at::Tensor detail::freqs_table_worded(const RopeFrequencies& freqs, int64_t max_seq_len, at::ScalarType angle_dtype,
                                      const std::string& what, const char* advice) {
  check_angle_dtype(angle_dtype, "freqs_table");
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  detail::check_host_bytes("freqs_table", {max_seq_len, pairs}, sizeof(c10::complex<float>), "complex64", what,
                           advice);
  const EntryMaker entry(freqs, angle_dtype);
  check_entries(freqs, entry, static_cast<double>(std::max<int64_t>(max_seq_len - 1, 0)), angle_dtype, "freqs_table");
  auto table = detail::host_tensor({max_seq_len, pairs}, at::kComplexFloat);
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
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0, "freqs_at: positions must be >= 0, got ", p[i], " at index ", i);
    last = std::max(last, p[i]);
  }
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  const EntryMaker entry(freqs, angle_dtype);
  check_entries(freqs, entry, static_cast<double>(last), angle_dtype, "freqs_at");
  auto table = detail::host_tensor({n, pairs}, at::kComplexFloat);
  auto* out = table.data_ptr<c10::complex<float>>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < pairs; ++j) out[i * pairs + j] = entry(p[i], j);
    }
  });
  return table;
}

namespace detail {

void check_host_bytes(const char* who, std::initializer_list<int64_t> dims, uint64_t entry_bytes, const char* entry,
                      const std::string& what, const char* advice) {
  static const uint64_t memory = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : UINT64_MAX;
  }();
  uint64_t bytes = entry_bytes;  // saturates at UINT64_MAX
  for (const int64_t d : dims) {
    const auto n = static_cast<uint64_t>(std::max<int64_t>(d, 0));
    if (n == 0) return;
    bytes = bytes <= UINT64_MAX / n ? bytes * n : UINT64_MAX;
  }
  TORCH_CHECK_VALUE(bytes <= memory, who, ": ", what, " needs ",
                    bytes == UINT64_MAX ? std::string("more than 2^64") : std::to_string(bytes), " bytes (", entry,
                    "), more than this machine's memory (", memory, " bytes); ", advice);
}

}  // namespace detail

at::Tensor inv_freq_tensor(const RopeFrequencies& freqs) {
  const int64_t pairs = static_cast<int64_t>(freqs.inv_freq.size());
  auto t = detail::host_tensor({pairs}, at::kDouble);
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
  check_table_args("rope_freqs", "dim", dim, theta, seq_len, max_seq_len);
  check_angle_dtype(angle_dtype, "rope_freqs");
  return freqs_table(compute_frequencies(dim, theta, scaling, seq_len), max_seq_len, angle_dtype);
}

at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta) {
  return rope_freqs(dim, max_seq_len, theta, RopeScaling());
}

}  // namespace rotary
