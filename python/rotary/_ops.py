"""Typed wrappers over ``torch.ops.rotary``. They add no logic: every check
and every kernel lives in C++ behind the dispatcher."""

from typing import Any, Mapping, Optional, Tuple

import torch

from . import _C


def rope_freqs(
    dim: int,
    max_seq_len: int,
    theta: float = 10000.0,
    scaling: Optional[Mapping[str, Any]] = None,
    seq_len: int = 0,
) -> torch.Tensor:
    """complex64 table ``[max_seq_len, dim // 2]`` with entry ``(p, j) =
    exp(i * p * theta ** (-2j / dim))``; angles, cos and sin computed in float64.

    With ``scaling`` (a dict like Hugging Face's ``rope_parameters``, see
    :class:`RotaryEmbedding`) the entry is ``attention_scaling * exp(i * p *
    inv_freq[j])`` for that rule; ``seq_len`` matters only for ``dynamic`` and
    ``longrope`` (0: the frequencies a model starts with)."""
    if scaling is None and seq_len == 0:
        return _C.rope_freqs(dim, max_seq_len, theta)
    return _C.rope_freqs(dim, max_seq_len, theta, scaling, seq_len)


def rope_frequencies(
    dim: int,
    theta: float = 10000.0,
    scaling: Optional[Mapping[str, Any]] = None,
    seq_len: int = 0,
) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a frequency rule: float64
    ``[dim // 2]`` and the factor folded into every table entry."""
    return _C.rope_frequencies(dim, theta, scaling, seq_len)


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    *,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` (any strides; fp32, fp64,
    fp16 or bf16) by the complex64 table ``freqs`` ``[max_seq_len, head_dim // 2]``.

    Token ``s`` uses table row ``start_pos + s``. ``positions`` (int64) may
    give per-batch offsets (``[]`` or ``[batch]``, added to ``start_pos + s``)
    or absolute ids (``[batch, seq]``, added to ``start_pos``).
    ``interleaved=True`` pairs dims (0,1), (2,3), ...; ``False`` pairs
    (j, j + head_dim/2) as Hugging Face ``rotate_half`` does.
    ``inverse=True`` rotates by the negative angle. Returns a new tensor.
    """
    return torch.ops.rotary.apply_rope(
        x, freqs, start_pos, interleaved, positions=positions, inverse=inverse
    )


def apply_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    *,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[batch, heads_q, seq, head_dim]`` and k ``[batch, heads_k,
    seq, head_dim]`` in one kernel call; ``heads_q`` and ``heads_k`` may differ.
    Arguments as in :func:`apply_rope`. Returns ``(q_rotated, k_rotated)``."""
    return torch.ops.rotary.apply_rope_qk(
        q, k, freqs, start_pos, interleaved, positions=positions, inverse=inverse
    )
