// Frequency tables. Angles are computed in float64 and rounded once, unless
// the fp32-angle compatibility mode is asked for (angle_dtype, below).
#pragma once

#include <rotary/scaling.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace rotary {

// The outcome of a frequency rule: pair j of a rotary dim d turns by
// pos * inv_freq[j] (d / 2 entries), and every cos/sin is multiplied by
// attention_scaling (YaRN's and LongRoPE's "mscale"; 1 for the others).
struct RopeFrequencies {
  std::vector<double> inv_freq;
  double attention_scaling = 1.0;
};

// The one implementation of every rule in RopeScaling, in float64.
// rotary_dim: the rotated width (even, > 0); theta: the base (finite, > 0).
// seq_len matters only for "dynamic" (it uses max(seq_len,
// max_position_embeddings)) and "longrope" (long_factor iff seq_len >
// original_max_position_embeddings); 0 means "no sequence yet", which gives
// the frequencies a model starts with. Throws c10::ValueError naming the
// offending field.
RopeFrequencies compute_frequencies(
    int64_t rotary_dim,
    double theta,
    const RopeScaling& scaling = RopeScaling(),
    int64_t seq_len = 0);

// The checks of a table's arguments (the width `dim_name` even, > 0 and <=
// 2^20; theta finite, > 0; seq_len and max_seq_len >= 0), c10::ValueError in
// the words of `who`: compute_frequencies and rope_freqs, or a wrapper that
// names its own arguments (Python's freqs_table).
void check_table_args(const char* who, const char* dim_name, int64_t dim, double theta, int64_t seq_len,
                      int64_t max_seq_len = 0);

// How the angle of a table entry is formed (`angle_dtype`):
//
//   at::kDouble (default, "float64"): angle = the exact product
//     pos * inv_freq[j] reduced by whole turns (kernel::reduced_angle,
//     within 1e-13 rad up to position 2^60); cosine, sine and the attention
//     scaling in float64; one rounding to float. "Exact" in this library
//     means this: each of cos and sin within 2^-25 (~3e-8) of the exact
//     value, times attention_scaling. Angles past 2^62 rad are refused.
//   at::kFloat ("float32"): compatibility with the tables most models were
//     trained with (Hugging Face `inv_freq.float() @ position_ids.float()`,
//     Meta `torch.outer(t.float(), freqs)`): angle = float(pos) *
//     float(inv_freq[j]) computed in float32, i.e. both factors and the
//     product rounded to float; then cos/sin of that float angle in float64,
//     times attention_scaling, rounded to float once. The angle is
//     bit-identical to torch's whenever the float32 inv_freq is; cos/sin are
//     the correctly rounded values, so within an ulp of torch's float32
//     cos/sin. (HF computes inv_freq itself in float32 pow/div, which can
//     differ from float(inv_freq[j]) by an ulp.) Its phase error grows with
//     the position: ~7e-3 rad at 128K, ~6e-2 rad at 1M (README "Precision").
//
// Throws c10::ValueError unless angle_dtype is kDouble or kFloat; `who` names
// the caller in the message.
void check_angle_dtype(at::ScalarType angle_dtype, const char* who);
// "float64" -> at::kDouble, "float32" -> at::kFloat (also "torch.float64" /
// "torch.float32"); anything else is a c10::ValueError naming angle_dtype
// (the name in quotes unless `quote` is false, for a name that is a repr).
at::ScalarType angle_dtype_from_string(const std::string& name, const char* who, bool quote = true);
// The inverse: "float64" or "float32".
std::string angle_dtype_name(at::ScalarType angle_dtype);
// A double as the modules print it: the shortest text that reads back as the
// same value (theta=1000000.5, not 1e+06).
std::string number_text(double value);

// complex64 [max_seq_len, inv_freq.size()] with entry (p, j) =
// attention_scaling * exp(i * angle(p, j)), the angle formed as angle_dtype
// says (float64 by default); the cosine, sine and product are float64,
// rounded to float once.
at::Tensor freqs_table(
    const RopeFrequencies& freqs,
    int64_t max_seq_len,
    at::ScalarType angle_dtype = at::kDouble);

// The rows of that table at the given positions (int64, 1-D, each >= 0, any
// device): complex64 [positions.numel(), inv_freq.size()] on the CPU, equal
// bit for bit to freqs_table(freqs, n, angle_dtype).index_select(0,
// positions) for any n past the largest position, without building the rows
// in between. For checking or sampling entries far out (2^22 and beyond).
at::Tensor freqs_at(
    const RopeFrequencies& freqs,
    const at::Tensor& positions,
    at::ScalarType angle_dtype = at::kDouble);

// float64 [inv_freq.size()] on the CPU.
at::Tensor inv_freq_tensor(const RopeFrequencies& freqs);

// complex64 [max_seq_len, dim / 2] with entry (p, j) = exp(i * p * theta^(-2j/dim)):
// freqs_table of the "default" rule.
at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta = 10000.0);

// The same table for any rule (see compute_frequencies for seq_len), with
// angles formed as angle_dtype says (see freqs_table).
at::Tensor rope_freqs(
    int64_t dim,
    int64_t max_seq_len,
    double theta,
    const RopeScaling& scaling,
    int64_t seq_len = 0,
    at::ScalarType angle_dtype = at::kDouble);

}  // namespace rotary
