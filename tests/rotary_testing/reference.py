"""Independent references for RoPE, written from the seed formulas.

Nothing here imports or calls ``rotary``. Three references:

* :func:`rope_reference` -- the exact float64 rotation (numpy), from the
  seeds' ``rotate_pairs`` / ``rope_half``:
  ``theta_j = base ** (-2j / d)``, ``angle = pos * theta_j``, pairs
  ``(2j, 2j + 1)`` (interleaved) or ``(j, j + d/2)`` (half split),
  ``inverse`` rotates by ``-angle``. Positions follow the documented
  semantics (see :func:`positions_grid`).
* :func:`seed_apply_rope` -- the seed ``rope.py`` eager complex multiply
  (``view_as_complex``), plain torch, interleaved pairing only.
* :func:`hf_apply_rope` -- Hugging Face style ``rotate_half``, plain torch,
  half-split pairing.

Plus the vector helpers of the seeds (``rotate_pairs``, ``rope_vec``,
``rope_half_vec``, ``sinusoidal_pe``) for the relative-position property.
"""

from __future__ import annotations

from typing import Optional

import math

import numpy as np
import torch

DEFAULT_BASE = 10000.0


# ---------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------
def inv_freq(d: int, base: float = DEFAULT_BASE) -> np.ndarray:
    """theta_j = base ** (-2j / d), j = 0 .. d/2 - 1, float64: libm's pow per
    entry (numpy's SIMD pow, on AVX-512 machines, is an ulp off in places,
    and an ulp of theta_j moves the angle at 2^22 by 4e-10 rad)."""
    return np.array([math.pow(base, -2.0 * j / d) for j in range(d // 2)], dtype=np.float64)


def freqs_reference(dim: int, max_seq_len: int, base: float = DEFAULT_BASE) -> np.ndarray:
    """complex128 [max_seq_len, dim // 2]: exp(i * pos * theta_j) in float64."""
    pos = np.arange(max_seq_len, dtype=np.float64)
    angle = np.outer(pos, inv_freq(dim, base))
    return np.cos(angle) + 1j * np.sin(angle)


def _to_numpy_int(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy().astype(np.int64)
    return np.asarray(t, dtype=np.int64)


def exact_angle(pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """float64 ``pos[..., None] * inv``, the exact product of the integer
    position and the float64 frequency. Past 2^24 rad the float64 product errs
    by more than 1e-9 rad (and rounds pos itself past 2^53): those entries are
    reduced mod 2*pi in 200-bit arithmetic (mpmath)."""
    pos = np.asarray(pos, dtype=np.int64)
    angle = pos[..., None].astype(np.float64) * inv
    far = np.argwhere(np.abs(angle) >= 2.0**24)
    if len(far):
        import mpmath

        with mpmath.workprec(200):
            turn = 2 * mpmath.pi
            for idx in far:
                p, j = int(pos[tuple(idx[:-1])]), int(idx[-1])
                exact = mpmath.mpf(p) * mpmath.mpf(float(inv[j]))
                angle[tuple(idx)] = float(exact - turn * mpmath.nint(exact / turn))
    return angle


def positions_grid(
    batch: int, seq: int, start_pos: int = 0, positions: Optional[torch.Tensor] = None
) -> np.ndarray:
    """int64 [batch, seq]: the table row of token (b, s).

    * no positions:          start_pos + s
    * positions [] / [B]/[1]: start_pos + offsets[b] + s  (per-batch offsets)
    * positions [B, S] (any dim may be 1, broadcast): start_pos + ids[b, s]
    """
    s = np.arange(seq, dtype=np.int64)[None, :]
    if positions is None:
        return np.broadcast_to(start_pos + s, (batch, seq)).copy()
    p = _to_numpy_int(positions)
    if p.ndim == 0:
        return np.broadcast_to(start_pos + p + s, (batch, seq)).copy()
    if p.ndim == 1:
        return np.broadcast_to(start_pos + p[:, None] + s, (batch, seq)).copy()
    if p.ndim == 2:
        return np.broadcast_to(start_pos + p, (batch, seq)).copy()
    raise ValueError(f"reference: bad positions rank {p.ndim}")


def rotate_pairs_nd(x: np.ndarray, angle: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate the last dim of float64 ``x`` pair by pair; ``angle`` broadcasts
    against ``x[..., : d // 2]``."""
    d = x.shape[-1]
    c, s = np.cos(angle), np.sin(angle)
    out = np.empty(np.broadcast_shapes(x.shape), dtype=np.float64)
    if interleaved:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., : d // 2], x[..., d // 2 :]
        out[..., : d // 2] = x0 * c - x1 * s
        out[..., d // 2 :] = x0 * s + x1 * c
    return out


def rope_reference(
    x: torch.Tensor,
    start_pos: int = 0,
    interleaved: bool = True,
    positions: Optional[torch.Tensor] = None,
    inverse: bool = False,
    base: float = DEFAULT_BASE,
) -> torch.Tensor:
    """Exact float64 RoPE of ``x`` [B, H, S, D] (any dtype/device/strides).
    Returns a float64 CPU tensor."""
    X = x.detach().to("cpu", torch.float64).numpy()
    B, H, S, D = X.shape
    assert D % 2 == 0
    angle = exact_angle(positions_grid(B, S, start_pos, positions), inv_freq(D, base))[:, None]  # [B, 1, S, D/2]
    if inverse:
        angle = -angle
    return torch.from_numpy(rotate_pairs_nd(X, angle, interleaved))


# ---------------------------------------------------------------------------
# seed rope.py: eager complex multiply (plain torch)
# ---------------------------------------------------------------------------
def seed_precompute_freqs(dim: int, max_seq_len: int, theta: float = DEFAULT_BASE) -> torch.Tensor:
    """The seed's table: float32 angles, torch.polar (complex64)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    positions = torch.arange(max_seq_len)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def seed_apply_rope(x: torch.Tensor, freqs: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """The seed's apply_rope: interleaved pairs as complex numbers, times the
    table rows start_pos .. start_pos + S - 1, in complex64."""
    batch, n_head, seq_len, head_dim = x.shape
    seq_freqs = freqs[start_pos : start_pos + seq_len]
    x_pairs = x.float().reshape(batch, n_head, seq_len, -1, 2)
    x_complex = torch.view_as_complex(x_pairs)
    x_rotated = x_complex * seq_freqs.unsqueeze(0).unsqueeze(0)
    x_out = torch.view_as_real(x_rotated).reshape(batch, n_head, seq_len, head_dim)
    return x_out.type_as(x)


# ---------------------------------------------------------------------------
# Hugging Face style rotate_half (plain torch)
# ---------------------------------------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_cos_sin(seq_len: int, dim: int, start_pos: int = 0, base: float = DEFAULT_BASE):
    """cos/sin [seq, dim] as HF builds them (``emb = cat((freqs, freqs), -1)``),
    here from float64 angles: no table from rotary involved."""
    inv = torch.from_numpy(inv_freq(dim, base))
    pos = torch.arange(start_pos, start_pos + seq_len, dtype=torch.float64)
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def hf_apply_rope(x: torch.Tensor, start_pos: int = 0, base: float = DEFAULT_BASE) -> torch.Tensor:
    """HF ``apply_rotary_pos_emb`` for one tensor ([B, H, S, D]), computed in
    float64 and rounded once to x's dtype."""
    cos, sin = hf_cos_sin(x.shape[2], x.shape[3], start_pos, base)
    xf = x.double()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


# ---------------------------------------------------------------------------
# Vector helpers from the seeds (numpy, float64)
# ---------------------------------------------------------------------------
def rotate_pairs(x: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """x: (d,), angles: (d/2,). Pair i = dims (2i, 2i+1), turned by angles[i]."""
    c, s = np.cos(angles), np.sin(angles)
    x1, x2 = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = x1 * c - x2 * s
    out[1::2] = x1 * s + x2 * c
    return out


def rope_vec(x: np.ndarray, pos: int, base: float = DEFAULT_BASE) -> np.ndarray:
    return rotate_pairs(x, pos * inv_freq(x.shape[-1], base))


def rope_half_vec(x: np.ndarray, pos: int, base: float = DEFAULT_BASE) -> np.ndarray:
    d = x.shape[-1]
    angles = pos * inv_freq(d, base)
    c, s = np.cos(angles), np.sin(angles)
    x1, x2 = x[: d // 2], x[d // 2 :]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c])


def sinusoidal_pe(pos: int, d: int, base: float = DEFAULT_BASE) -> np.ndarray:
    angles = pos * inv_freq(d, base)
    pe = np.empty(d)
    pe[0::2] = np.sin(angles)
    pe[1::2] = np.cos(angles)
    return pe


# ---------------------------------------------------------------------------
# N-D positions and an offset rotated span (float64)
# ---------------------------------------------------------------------------
def rope_reference_nd(
    x: torch.Tensor,
    pos: np.ndarray,
    pair_axes,
    rotary_dim: int,
    offset: int = 0,
    interleaved: bool = True,
    inverse: bool = False,
    inv: Optional[np.ndarray] = None,
) -> torch.Tensor:
    """Exact float64 RoPE of ``x`` [B, H, S, D] whose pair ``j`` turns by
    ``pos[pair_axes[j], b, s] * inv[j]`` (``pos`` int [n_axes, B, S];
    ``inv`` defaults to the plain frequencies of ``rotary_dim``); dims
    ``[offset, offset + rotary_dim)`` rotate, the rest are copied."""
    X = x.detach().to("cpu", torch.float64).numpy().copy()
    inv = inv_freq(rotary_dim) if inv is None else inv
    P = np.asarray(pos, dtype=np.int64)
    axes = np.asarray(pair_axes, dtype=np.int64)
    every = exact_angle(P, inv)  # [n_axes, B, S, pairs]: each pair reads its own axis
    angle = np.stack([every[axes[j], ..., j] for j in range(len(axes))], axis=-1)[:, None]  # [B, 1, S, pairs]
    if inverse:
        angle = -angle
    span = X[..., offset : offset + rotary_dim]
    X[..., offset : offset + rotary_dim] = rotate_pairs_nd(span, angle, interleaved)
    return torch.from_numpy(X)
