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
    *,
    angle_dtype: Any = "float64",
) -> torch.Tensor:
    """complex64 table ``[max_seq_len, dim // 2]`` with entry ``(p, j) =
    exp(i * p * theta ** (-2j / dim))``; angles, cos and sin computed in float64.

    With ``scaling`` (a dict like Hugging Face's ``rope_parameters``, see
    :class:`RotaryEmbedding`) the entry is ``attention_scaling * exp(i * p *
    inv_freq[j])`` for that rule; ``seq_len`` matters only for ``dynamic`` and
    ``longrope`` (0: the frequencies a model starts with).

    ``angle_dtype="float32"`` (or ``torch.float32``) reproduces the fp32-angle
    tables of Hugging Face / Meta: ``float32(p) * float32(inv_freq[j])``
    rounded to float32, then cos/sin of that angle (in float64, rounded once).
    Its phase error grows with ``p`` (README "Precision")."""
    if scaling is None and seq_len == 0 and str(angle_dtype) in ("float64", "torch.float64"):
        return _C.rope_freqs(dim, max_seq_len, theta)
    return _C.rope_freqs(dim, max_seq_len, theta, scaling, seq_len, angle_dtype=angle_dtype)


def rope_frequencies(
    dim: int,
    theta: float = 10000.0,
    scaling: Optional[Mapping[str, Any]] = None,
    seq_len: int = 0,
) -> Tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a frequency rule: float64
    ``[dim // 2]`` and the factor folded into every table entry."""
    return _C.rope_frequencies(dim, theta, scaling, seq_len)


_ARGS_DOC = """
    ``freqs`` is the complex64 table ``[max_seq_len, rotary_dim // 2]``; dims
    past ``rotary_dim`` (<= head_dim) pass through unchanged.
    Inputs are ``[batch, heads, seq, head_dim]`` in ``layout`` (``"BHSD"``,
    ``"BSHD"`` or ``"SBHD"``; any strides, no copies), or packed
    ``[total_tokens, heads, head_dim]`` with ``cu_seqlens`` (int32/int64
    ``[num_seqs + 1]``). dtypes: fp32, fp64, fp16, bf16 (16-bit math in fp32,
    rounded once).

    Token ``s`` uses table row ``start_pos + s`` (``s`` counted within its own
    sequence when packed). ``positions`` (int64) gives offsets (``[]`` or
    ``[batch]``, added to ``start_pos + s``) or absolute ids (``[batch, seq]``,
    or ``[total_tokens]`` when packed; added to ``start_pos``).
    ``interleaved=True`` pairs dims (0,1), (2,3), ...; ``False`` pairs
    (j, j + rotary_dim/2) as Hugging Face ``rotate_half`` does.
    ``inverse=True`` rotates by the negative angle. With ``inv_freq``
    (float64 ``[rotary_dim // 2]``), positions past the table are computed
    exactly instead of raising.
"""


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    *,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    layout: str = "BHSD",
) -> torch.Tensor:
    """Rotate ``x`` and return a new tensor."""
    return torch.ops.rotary.apply_rope(
        x, freqs, start_pos, interleaved, positions=positions, inverse=inverse,
        cu_seqlens=cu_seqlens, inv_freq=inv_freq, layout=layout,
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
    cu_seqlens: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    layout: str = "BHSD",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in one kernel call (head counts may differ; batch, seq
    and head_dim must match). Returns ``(q_rotated, k_rotated)``."""
    return torch.ops.rotary.apply_rope_qk(
        q, k, freqs, start_pos, interleaved, positions=positions, inverse=inverse,
        cu_seqlens=cu_seqlens, inv_freq=inv_freq, layout=layout,
    )


def apply_rope_(
    x: torch.Tensor,
    freqs: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    *,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    layout: str = "BHSD",
) -> torch.Tensor:
    """Rotate ``x`` in place and return it. Every input is validated before
    anything is written. Not differentiable: a tensor that requires grad (with
    grad mode on) is refused."""
    torch.ops.rotary.apply_rope_(
        x, freqs, start_pos, interleaved, positions=positions, inverse=inverse,
        cu_seqlens=cu_seqlens, inv_freq=inv_freq, layout=layout,
    )
    return x


def apply_rope_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    *,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    layout: str = "BHSD",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (they may be views into one packed qkv tensor)
    and return them. Not differentiable, like :func:`apply_rope_`."""
    torch.ops.rotary.apply_rope_qk_(
        q, k, freqs, start_pos, interleaved, positions=positions, inverse=inverse,
        cu_seqlens=cu_seqlens, inv_freq=inv_freq, layout=layout,
    )
    return q, k


for _fn in (apply_rope, apply_rope_qk, apply_rope_, apply_rope_qk_):
    _fn.__doc__ += _ARGS_DOC
