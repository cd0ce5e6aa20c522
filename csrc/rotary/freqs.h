// Frequency tables. Angles are computed in float64 and rounded once.
#pragma once

#include <rotary/scaling.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
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

// complex64 [max_seq_len, inv_freq.size()] with entry (p, j) =
// attention_scaling * exp(i * p * inv_freq[j]); the angle, cosine, sine and
// product are float64, rounded to float once.
at::Tensor freqs_table(const RopeFrequencies& freqs, int64_t max_seq_len);

// float64 [inv_freq.size()] on the CPU.
at::Tensor inv_freq_tensor(const RopeFrequencies& freqs);

// complex64 [max_seq_len, dim / 2] with entry (p, j) = exp(i * p * theta^(-2j/dim)):
// freqs_table of the "default" rule.
at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta = 10000.0);

// The same table for any rule (see compute_frequencies for seq_len).
at::Tensor rope_freqs(
    int64_t dim,
    int64_t max_seq_len,
    double theta,
    const RopeScaling& scaling,
    int64_t seq_len = 0);

}  // namespace rotary
