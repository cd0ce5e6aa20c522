// Functional API. Each function calls the dispatcher, so autograd,
// torch.compile and every backend see the same op as Python does.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace rotary {

// Rotates x [batch, heads, seq, head_dim] by the table freqs
// [max_seq_len, head_dim / 2] (complex64). Token s of batch b uses row
// start_pos + s, or start_pos + positions[...] when positions is given (see
// README "Positions"). inverse rotates by the negative angle.
at::Tensor apply_rope(
    const at::Tensor& x,
    const at::Tensor& freqs,
    c10::SymInt start_pos = 0,
    bool interleaved = true,
    const std::optional<at::Tensor>& positions = std::nullopt,
    bool inverse = false);

// q [batch, heads_q, seq, head_dim] and k [batch, heads_k, seq, head_dim] in
// one call; heads_q and heads_k may differ (GQA / MQA).
std::tuple<at::Tensor, at::Tensor> apply_rope_qk(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& freqs,
    c10::SymInt start_pos = 0,
    bool interleaved = true,
    const std::optional<at::Tensor>& positions = std::nullopt,
    bool inverse = false);

}  // namespace rotary
