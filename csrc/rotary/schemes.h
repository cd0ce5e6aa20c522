// The older positional schemes RoPE is compared against (sinusoidal, ALiBi;
// "Positional encoding — sinusoidal, RoPE, ALiBi"). Values are computed in
// float64 with their published formulas and rounded once to float32, on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace rotary {

// The 2017 additive table: float32 [n, d] with
//   pe[pos][2i]     = sin(pos / base^(2i / d))
//   pe[pos][2i + 1] = cos(pos / base^(2i / d))      i = 0 .. d/2 - 1.
// n >= 0, d even and > 0, base finite and > 0 (c10::ValueError otherwise).
at::Tensor sinusoidal_table(int64_t n, int64_t d, double base = 10000.0);

// ALiBi head slopes: float32 [n_heads], slope[h] = 2^(-8 (h + 1) / n_heads).
// n_heads > 0.
at::Tensor alibi_slopes(int64_t n_heads);

// ALiBi attention bias: float32 [n_heads, seq_len, seq_len] with
// bias[h][i][j] = -slope[h] * |i - j|, and -inf where j > i when causal.
// n_heads > 0, seq_len >= 0.
at::Tensor alibi_bias(int64_t n_heads, int64_t seq_len, bool causal = true);

}  // namespace rotary
