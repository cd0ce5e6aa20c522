"""The inputs of the op fuzz cases and what the documented semantics say of
them: the logical shape of each layout, random layouts, strides and views
over fresh buffers (element offsets are enumerated to decide overlap, never
asked of rotary), random positions, the table row of each token and the
float64 reference. Split from op_cases.py, whose random op call builds on
it, as the argument, KV-cache, norm and cos/sin cases do."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from rotary_testing.reference import exact_angle, positions_grid, rotate_pairs_nd

from .common import DEVICE

# The RoPE ops the op and argument cases call.
OPS = ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_"]

MODES = ["dense", "permuted", "gapped", "offset", "as_strided", "expanded"]


def logical_shape(layout, B, H, S, D):
    return {"BHSD": (B, H, S, D), "BSHD": (B, S, H, D), "SBHD": (S, B, H, D), "THD": (S, H, D)}[layout]


def heads_axis(layout):
    return {"BHSD": 1, "BSHD": 2, "SBHD": 2, "THD": 1}[layout]


def canonical(t, layout):
    """The [B, H, S, D] view the documented semantics index."""
    if layout == "BSHD":
        return t.transpose(1, 2)
    if layout == "SBHD":
        return t.permute(1, 2, 0, 3)
    if layout == "THD":
        return t.unsqueeze(0).transpose(1, 2)
    return t


def element_offsets(t: torch.Tensor) -> np.ndarray:
    off = np.array([t.storage_offset()], dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = (off[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return off


def self_overlaps(t) -> bool:
    o = element_offsets(t)
    return len(np.unique(o)) < len(o)


def share_elements(a, b) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    return len(np.intersect1d(element_offsets(a), element_offsets(b))) > 0


class Builder:
    def __init__(self, rng: random.Random, gen: torch.Generator):
        self.rng, self.gen, self.buffers = rng, gen, []

    def buffer(self, n, dtype):
        buf = torch.randn(max(n, 1), generator=self.gen).to(dtype).to(DEVICE)
        self.buffers.append(buf)
        return buf

    def tensor(self, shape, dtype, mode):
        r, n = self.rng, math.prod(shape)
        dims = len(shape)
        if mode == "permuted":
            perm = list(range(dims))
            r.shuffle(perm)
            phys = self.buffer(n, dtype)[:n].view([shape[p] for p in perm])
            return phys.permute([perm.index(d) for d in range(dims)])
        if mode == "gapped":
            padded = [s + r.choice([0, 0, 1, 2]) for s in shape]
            step = r.randrange(dims) if r.random() < 0.4 else -1
            if step >= 0:
                padded[step] = 2 * shape[step]
            base = self.buffer(math.prod(padded), dtype)[: math.prod(padded)].view(padded)
            idx = tuple(slice(0, 2 * s, 2) if d == step else slice(0, s) for d, s in enumerate(shape))
            return base[idx]
        if mode == "offset":
            off = r.randrange(1, 7)
            return self.buffer(n + off, dtype)[off : off + n].view(shape)
        if mode == "as_strided":
            strides = [r.choice([0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48]) for _ in shape]
            off = r.randrange(0, 5)
            span = off + sum((s - 1) * st for s, st in zip(shape, strides)) + 1 if n else 1
            return self.buffer(span, dtype).as_strided(shape, strides, off)
        if mode == "expanded":
            small = [1 if (s > 1 and r.random() < 0.5) else s for s in shape]
            return self.buffer(math.prod(small), dtype)[: math.prod(small)].view(small).expand(shape)
        return self.buffer(n, dtype)[:n].view(shape)


def _positions(rng, layout, B, S, L, past):
    """(positions tensor or None, kind)."""
    hi = L + 6 if past else L
    varlen = layout == "THD"
    kinds = ["none", "scalar", "ids"] if varlen else ["none", "scalar", "batch", "batch1", "ids", "ids_b1", "ids_s1", "ids_t"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None, kind
    if kind == "scalar":
        return torch.tensor(rng.randrange(0, max(1, hi - S + 1))), kind
    if varlen:
        return torch.tensor([rng.randrange(0, hi) for _ in range(S)], dtype=torch.int64), kind
    if kind in ("batch", "batch1"):
        n = B if kind == "batch" else 1
        return torch.tensor([rng.randrange(0, max(1, hi - S + 1)) for _ in range(n)], dtype=torch.int64), kind
    rows = {"ids": B, "ids_b1": 1, "ids_s1": B, "ids_t": S}[kind]
    cols = {"ids": S, "ids_b1": S, "ids_s1": 1, "ids_t": B}[kind]
    p = torch.tensor([rng.randrange(0, hi) for _ in range(rows * cols)], dtype=torch.int64).reshape(rows, cols)
    return (p.t() if kind == "ids_t" else p), kind


def _rows(layout, B, S, start_pos, positions, cu):
    """int64 [B, S]: the table row of each token (docs/api.md "Positions")."""
    if layout != "THD":
        return positions_grid(B, S, start_pos, positions)
    bounds = cu.tolist()
    local = np.zeros(S, dtype=np.int64)
    for n in range(len(bounds) - 1):
        local[bounds[n] : bounds[n + 1]] = np.arange(bounds[n + 1] - bounds[n])
    if positions is None:
        rows = start_pos + local
    elif positions.dim() == 0:
        rows = start_pos + int(positions) + local
    else:
        rows = start_pos + positions.cpu().numpy().astype(np.int64)
    return rows[None, :]


def _reference(x, layout, rows, inv, scale, sign, rd, interleaved, offset=0):
    X = canonical(x, layout).detach().to("cpu", torch.float64).numpy()
    out = X.copy()
    angle = sign * exact_angle(rows, inv)[:, None]
    out[..., offset : offset + rd] = scale * rotate_pairs_nd(X[..., offset : offset + rd], angle, interleaved)
    return torch.from_numpy(out)
