// Functional API. Each function calls the dispatcher, so autograd,
// torch.compile and every backend see the same op as Python does.
#pragma once

#include <rotary/op_args.h>

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace rotary {

// Rotates x by the complex64 table freqs [max_seq_len, rotary_dim / 2]; dims
// past rotary_dim (<= head_dim) pass through unchanged.
//   x            [batch, heads, seq, head_dim] in `layout` ("BHSD", "BSHD",
//                "SBHD"), or [total_tokens, heads, head_dim] with cu_seqlens.
//   start_pos    first position (the KV-cache offset), added to s and offsets.
//   interleaved  pairs (2j, 2j+1) if true, (j, j + rotary_dim/2) if false.
//   offsets      per-sequence starts, [] or [batch] (with cu_seqlens: [] or
//                [num_seqs]): token s of batch (or sequence) b is at
//                start_pos + offsets[b] + s.
//   position_ids absolute positions as in Hugging Face, [seq] or [batch, seq]
//                (with cu_seqlens: [total_tokens]); start_pos must then be 0.
//                offsets and position_ids: any integer dtype (int32 / int64
//                are read in place, others widened once); pass one or neither.
//   inverse      rotate by the negative angle.
//   cu_seqlens   int32/int64 [num_seqs + 1] boundaries of a packed batch.
//   inv_freq     float64 [rotary_dim / 2]: positions past the table are then
//                computed exactly instead of being an error.
//   rotary_offset  dims [rotary_offset, rotary_offset + rotary_dim) rotate,
//                the rest pass through (DeepSeek's [nope | rope] split).
//   pair_axes    N-D positions (M-RoPE, axial): rotary_dim / 2 axis indices;
//                pair j turns by position_ids[pair_axes[j], ...], and
//                position_ids gains a leading axis dim: [n_axes, seq],
//                [n_axes, batch, seq] or, packed, [n_axes, total_tokens].
at::Tensor apply_rope(
    const at::Tensor& x,
    const at::Tensor& freqs ROTARY_ROPE_DECLS);

// q and k in one kernel launch; their head counts may differ (GQA / MQA).
std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs ROTARY_ROPE_DECLS);

// In place: every input is validated before anything is written. q and k may
// be views into one packed qkv tensor. Not differentiable.
at::Tensor& apply_rope_(
    at::Tensor& x,
    const at::Tensor& freqs ROTARY_ROPE_DECLS);

void apply_rope_qk_(
    at::Tensor& q,
    at::Tensor& k,
    const at::Tensor& freqs ROTARY_ROPE_DECLS);

// Rotates q and k in place (as apply_rope_qk_) and writes the rotated k and
// the raw v of every token into the caches, in one call. Positions and the
// layout of q/k/v follow apply_rope. The caches:
//   kv_layout        "BHSD" [batch, kv_heads, max_seq_len, head_dim] or "BSHD"
//                    [batch, max_seq_len, kv_heads, head_dim] (with cu_seqlens
//                    one row per sequence); paged "NHD" [num_blocks,
//                    block_size, kv_heads, head_dim] or "HND" [num_blocks,
//                    kv_heads, block_size, head_dim].
//   cache_positions  contiguous caches: the row of each token, int32/int64
//                    [batch, seq] or [batch * seq]; default: its position.
//   slot_mapping     paged caches (required): flat slot block * block_size +
//                    offset of each token, same shapes; -1 skips the token.
//   k_scale/v_scale  float8_e4m3fn caches: float32 [] / [1] / [kv_heads];
//                    the cache gets (x / scale) clamped to +-448, rounded to
//                    nearest even (default scale 1).
//   inverse, rotary_offset, pair_axes  as apply_rope; the cache gets k as
//                    rotated, whole head vectors. With pair_axes (N-D
//                    position_ids) a contiguous cache needs cache_positions:
//                    a token's rotary position is not its row.
// Slots and positions known on the host are range-checked before anything is
// written; out-of-range ones on the device are skipped, never written.
void apply_rope_with_kv_cache_(
    at::Tensor& q,
    at::Tensor& k,
    const at::Tensor& v,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const at::Tensor& freqs ROTARY_KV_DECLS);

// The attention prologue in one pass: q and k RMS-normalized in fp32, scaled
// by their weights, then rotated as apply_rope_qk does, with one rounding to
// the storage type. Returns (q_out, k_out). The rotation arguments are those
// of apply_rope; the norm's:
//   q_weight, k_weight  [head_dim] (norm "head") or [heads * head_dim] of
//                 that tensor (norm "heads"); None: a weight of ones.
//   eps           added to the mean square.
//   norm          "head": each head over its head_dim (Qwen3, Gemma 3);
//                 "heads": all heads of a token together (OLMo2).
//   weight_offset added to the weight in fp32: 1.0 gives Gemma's (1 + w).
//   q_fp8_scale   float32 [] / [1] / [heads] (out of place only): q comes
//                 back as float8_e4m3fn, (result / scale) clamped to +-448,
//                 rounded once. Not differentiable.
// The norm covers the whole head: dims outside the rotated span are
// normalized and scaled but not rotated. Differentiable in q, k and both
// weights.
std::tuple<at::Tensor, at::Tensor> apply_qk_norm_rope(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs ROTARY_ROPE_DECLS ROTARY_NORM_DECLS);

// In place (every input validated first; q and k may be views of one packed
// qkv tensor). Not differentiable.
void apply_qk_norm_rope_(
    at::Tensor& q,
    at::Tensor& k,
    const at::Tensor& freqs ROTARY_ROPE_DECLS ROTARY_NORM_DECLS);

// The prologue with the KV-cache write: q and k normalized and rotated in
// place as apply_qk_norm_rope_ does, then written into the caches as
// apply_rope_with_kv_cache_ writes them (k as normalized and rotated, v raw),
// in one call. Not differentiable.
void apply_qk_norm_rope_with_kv_cache_(
    at::Tensor& q,
    at::Tensor& k,
    const at::Tensor& v,
    at::Tensor& k_cache,
    at::Tensor& v_cache,
    const at::Tensor& freqs ROTARY_KV_DECLS ROTARY_NORM_DECLS);

// Rotates q and k by cos/sin tables as callers hand them (a composite over
// apply_rope_qk: one pass turns the rows it needs into its table, in float32).
//   cos, sin     Hugging Face's per-token tables [seq, R] or [batch | 1, seq,
//                R], R = rotary_dim, in any float dtype: rotate_half tables
//                repeat their first R/2 values (interleaved: each value
//                twice), which is checked (an error otherwise). With
//                position_ids they are [max_pos, R] tables indexed by it.
//   sin = None   cos is vLLM's / FlashInfer's cos_sin_cache [max_pos, R]:
//                R/2 cos then R/2 sin per row; position_ids required.
//   position_ids [seq] or [batch, seq] (3-D q: [tokens]), any integer dtype.
//   q, k         4-D in `layout` as apply_rope, or [tokens, heads, head_dim]
//                (vLLM); dims past rotary_offset + R pass through.
//   interleaved  pairs (2j, 2j+1); default false: rotate_half (j, j + R/2).
//   inverse      rotates by the negative angle.
std::tuple<at::Tensor, at::Tensor> apply_rope_cos_sin(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& cos,
    const std::optional<at::Tensor>& sin ROTARY_COS_SIN_DECLS);

}  // namespace rotary
