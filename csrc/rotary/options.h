#pragma once

#include <rotary/scaling.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

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
  // How the table's angles are formed (rotary/freqs.h): torch::kFloat64
  // (default) computes pos * inv_freq in float64, exact to ~3e-8 at any
  // position; torch::kFloat32 reproduces the fp32-angle tables of Hugging
  // Face / Meta (float(pos) * float(inv_freq) in float32), whose phase error
  // grows with the position, for parity with models trained on them. With
  // float32 the module does not compute positions past its table on the fly
  // (that path is float64 only): such a position is an IndexError on the
  // host, NaN for device-side positions on CUDA, unless the rule grows the
  // table ("dynamic"). Give it max_seq_len >= the longest context.
  TORCH_ARG(torch::Dtype, angle_dtype) = torch::kFloat64;
  // Dims [rotary_offset, rotary_offset + dim) of each head rotate; the rest
  // pass through (DeepSeek's [nope | rope] heads: offset = nope dim).
  TORCH_ARG(int64_t, rotary_offset) = 0;
  // Multimodal RoPE (rotary/axes.h): pairs per position axis, summing to
  // dim / 2, e.g. {16, 24, 24} (Qwen2-VL t, h, w). Empty: one position per
  // token. forward() then reads 3-D position_ids as [n_axes, batch, seq];
  // 2-D ones are one position per token ([batch, seq], the text tokens'
  // rotation), never [n_axes, seq]. mrope_interleaved: Qwen3-VL's layout.
  TORCH_ARG(std::vector<int64_t>, mrope_section) = {};
  TORCH_ARG(bool, mrope_interleaved) = false;
  // Axial RoPE (rotary/axes.h, rotary::axial_rope): dims per position axis,
  // summing to dim (FLUX {16, 56, 56}); each axis turns at its own theta from
  // axes_theta (one per axis, or empty: theta for all). Replaces the
  // frequency rule (which must be the default). axes_shared_spectrum: one
  // spectrum dealt out to equal axes (Pixtral 2-D). forward() takes
  // position_ids [n_axes, batch, seq].
  TORCH_ARG(std::vector<int64_t>, axes_dim) = {};
  TORCH_ARG(std::vector<double>, axes_theta) = {};
  TORCH_ARG(bool, axes_shared_spectrum) = false;
  // An explicit pair -> axis map, one entry per pair (dim / 2): pair j turns
  // by position_ids[pair_axes[j]], for a layout mrope_section does not name
  // (ERNIE-4.5-VL: h and w alternate over the first pairs, t takes the rest).
  // Read as mrope_section is: 3-D position_ids are [n_axes, batch, seq], and
  // other positions turn every pair by one position (a text token).
  TORCH_ARG(std::vector<int64_t>, pair_axes) = {};
};

}  // namespace rotary
