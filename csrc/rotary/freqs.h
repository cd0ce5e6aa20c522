// Frequency tables. Angles are computed in float64 and rounded once.
#pragma once

#include <ATen/core/Tensor.h>

namespace rotary {

// complex64 [max_seq_len, dim / 2] with entry (p, j) = exp(i * p * theta^(-2j/dim)).
at::Tensor rope_freqs(int64_t dim, int64_t max_seq_len, double theta = 10000.0);

}  // namespace rotary
