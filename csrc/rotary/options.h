#pragma once

#include <rotary/scaling.h>

#include <torch/arg.h>

#include <cstdint>

namespace rotary {

struct RotaryEmbeddingOptions {
  /* implicit */ RotaryEmbeddingOptions(int64_t dim) : dim_(dim) {}

  // Rotated width of each head (the rotary dim); even and > 0. A head may be
  // wider: the op rotates its first 2 * freqs.size(1) dims (partial rotary).
  TORCH_ARG(int64_t, dim);
  // Rows in the cached table. Positions past it are computed exactly from
  // inv_freq on the fly: the table length limits speed, never correctness.
  TORCH_ARG(int64_t, max_seq_len) = 4096;
  // Frequency base: pair j turns by pos * theta^(-2j/dim).
  TORCH_ARG(double, theta) = 10000.0;
  // true: pairs (0,1), (2,3), ... (Meta Llama, GPT-J);
  // false: pairs (j, j + dim/2) (GPT-NeoX, Hugging Face rotate_half).
  TORCH_ARG(bool, interleaved) = true;
  // Frequency rule (rotary/scaling.h); the default is plain RoPE. "dynamic"
  // and "longrope" are host-driven: the module rebuilds its table when the
  // sequence length crosses their threshold (not CUDA-graph safe). An unset
  // max_position_embeddings of a "dynamic" rule is taken to be max_seq_len.
  TORCH_ARG(RopeScaling, scaling) = RopeScaling();
};

}  // namespace rotary
