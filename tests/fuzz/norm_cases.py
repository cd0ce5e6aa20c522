"""Fuzz cases for the prologue ops (apply_qk_norm_rope and its in-place
form): random layouts, strides, dtypes, positions, partial rotary at an
offset, both norms, weights of any float dtype or none, eps and Gemma's
offset; valid and invalid. The expected outcome comes from how the inputs
were built, the expected values from a float64 norm then the op fuzzer's
rotation reference, never from rotary itself."""

from __future__ import annotations

import random

import numpy as np
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq

from .common import (DEVICE, DOCUMENTED, FLOATS, Finding, bits, check_close, check_tangents, check_vmap, judge_refusal,
                     same_bits, set_kind)
from .op_inputs import Builder, _positions, _reference, _rows, canonical, heads_axis, logical_shape, share_elements

OPS = ["apply_qk_norm_rope", "apply_qk_norm_rope_"]
LAYOUTS = ["BHSD", "BSHD", "SBHD", "THD"]
MODES = ["dense", "permuted", "gapped", "offset"]


def _normalized(x, layout, w, eps, norm, offset):
    """float64 RMSNorm of x as passed, times (w + offset): over head_dim, or
    over the heads axis and head_dim."""
    return _norm64(x.detach().to("cpu", torch.float64), layout, w, eps, norm, offset)


def _norm64(X, layout, w, eps, norm, offset):
    """_normalized of a float64 CPU tensor, differentiable in X (for jvp)."""
    dims = (-1,) if norm == "head" else (heads_axis(layout), -1)
    y = X / torch.sqrt((X * X).mean(dim=dims, keepdim=True) + eps)
    weff = 1.0 + offset if w is None else w.detach().to("cpu", torch.float32).double() + offset
    if w is not None and norm == "heads":
        shape = [1] * X.dim()
        shape[heads_axis(layout)], shape[-1] = X.shape[heads_axis(layout)], X.shape[-1]
        weff = weff.view(shape)
    return y * weff


def run_norm(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    op = rng.choice(OPS)
    set_kind(f"norm:{op}")
    in_place = op.endswith("_")
    dtype = rng.choice(FLOATS)
    layout = rng.choice(LAYOUTS)
    B = 1 if layout == "THD" else rng.randrange(1, 4)
    Hq, Hk = rng.randrange(1, 4), rng.randrange(1, 3)
    if rng.random() < 0.08:  # no heads on one side: a rank of an uneven head split
        Hq, Hk = (0, Hk) if rng.random() < 0.5 else (Hq, 0)
    S = rng.choice([0, 1, 2, 3, 5, 9])
    D = rng.choice([2, 4, 8, 12, 16, 32, 48])
    rd = rng.choice([D, D] + [d for d in range(2, D, 2)])
    off = rng.randrange(0, D - rd + 1) if rd < D and rng.random() < 0.5 else 0
    L = rng.randrange(1, 24)
    interleaved = rng.random() < 0.5
    norm = rng.choice(["head", "heads"])
    eps = rng.choice([1e-6, 1e-5, 0.0, 0.1])
    offset = rng.choice([0.0, 0.0, 1.0])
    start_pos = rng.choice([0, 0, 1, 3])
    reasons = []

    b = Builder(rng, gen)
    q = b.tensor(logical_shape(layout, B, Hq, S, D), dtype, rng.choice(MODES))
    k = b.tensor(logical_shape(layout, B, Hk, S, D), dtype, rng.choice(MODES))
    n_q, n_k = (D, D) if norm == "head" else (Hq * D, Hk * D)
    wdt = rng.choice(FLOATS)
    qw = (1 + 0.3 * torch.randn(n_q, generator=gen)).to(wdt) if rng.random() < 0.8 else None
    kw = (1 + 0.3 * torch.randn(n_k, generator=gen)).to(wdt) if rng.random() < 0.8 else None
    positions, _ = _positions(rng, layout, B, S, L, False)
    cu = None
    if layout == "THD":
        cuts = sorted(rng.randrange(0, S + 1) for _ in range(rng.randrange(0, 3)))
        cu = torch.tensor([0] + cuts + [S], dtype=torch.int64)
    freqs = rotary.rope_freqs(rd, L)

    mutation = rng.choice(["q_weight_len", "k_weight_rank", "weight_int", "eps_neg", "eps_nan", "norm_name",
                           "offset_inf", "weight_in_q", "eps_tiny"]) if rng.random() < 0.3 else None
    if mutation == "q_weight_len":
        qw = torch.ones(n_q + rng.choice([-1, 1, D]))
        reasons.append("q_weight length")
    elif mutation == "k_weight_rank":
        kw = torch.ones(1, n_k)
        reasons.append("k_weight 2-D")
    elif mutation == "weight_int":
        qw = torch.ones(n_q, dtype=torch.int64)
        reasons.append("integer weight")
    elif mutation == "eps_neg":
        eps = -rng.choice([1e-6, 1.0])
        reasons.append("negative eps")
    elif mutation == "eps_nan":
        eps = rng.choice([float("nan"), float("inf")])
        reasons.append("eps not finite")
    elif mutation == "eps_tiny" and dtype != torch.float64:
        eps = rng.choice([1e-46, 5e-324])  # 0 in float32, where the norm adds it
        reasons.append("eps rounds to 0 in float32")
    elif mutation == "norm_name":
        norm = rng.choice(["rms", "Head", "", "layer"])
        reasons.append("unknown norm")
    elif mutation == "offset_inf":
        offset = float("inf")
        reasons.append("weight_offset not finite")
    elif mutation == "weight_in_q" and in_place and q.numel() >= n_q and q.is_contiguous():
        qw = q.reshape(-1)[:n_q]  # read while q is written
        reasons.append("q_weight overlaps q")
    else:
        mutation = None

    if not reasons and in_place and share_elements(q, k):
        reasons.append("q and k share elements")
    pos_kw = {}
    if positions is not None:
        is_ids = positions.dim() == 1 if layout == "THD" else positions.dim() >= 2
        if is_ids:
            pos_kw["position_ids"], start_pos = positions + start_pos, 0
            positions = pos_kw["position_ids"]
        else:
            pos_kw["offsets"] = positions
    rows = _rows(layout, B, S, start_pos, positions, cu)
    if not reasons and rows.size and (rows >= L).any():
        reasons.append("position past the table")
    if DEVICE != "cpu":
        freqs = freqs.to(DEVICE)
        qw = qw.to(DEVICE) if qw is not None and qw.device.type == "cpu" else qw
        kw = kw.to(DEVICE) if kw is not None else None

    kw_args = dict(layout=layout, cu_seqlens=cu, rotary_offset=off, q_weight=qw, k_weight=kw, eps=eps, norm=norm,
                   weight_offset=offset, **pos_kw)
    fn = getattr(rotary, op)
    saved = [bits(t) for t in b.buffers]
    before = [bits(t).view(t.dtype) for t in (q, k)]

    def call():
        return fn(q, k, freqs, start_pos, interleaved, **kw_args)

    kind = f"norm:{op}"
    try:
        out = call()
    except DOCUMENTED as e:
        return kind, "refused: " + judge_refusal(op, e, b.buffers, saved, reasons)
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{op}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if reasons:
        raise Finding(f"{op}: accepted bad input ({', '.join(reasons)})")
    outs = (q, k) if in_place else out
    inv = ref_inv_freq(rd)
    for name, o, x, w in zip(("q", "k"), outs, before, (qw, kw)):
        if o.dtype != x.dtype or o.shape != x.shape:
            raise Finding(f"{op}: output {name} is {o.dtype} {tuple(o.shape)}, input {x.dtype} {tuple(x.shape)}")
        y = _normalized(x, layout, w, eps, norm, offset)
        if eps == 0.0 and not torch.isfinite(y).all():
            continue  # a zero-norm vector with eps 0: 0/0 by definition
        expected = _reference(y, layout, rows, inv, 1.0, 1.0, rd, interleaved, off)
        check_close(canonical(o, layout), expected, dtype, f"{op} {name} ({layout}, norm {norm})",
                    atol_extra=float(np.abs(expected.numpy()).max(initial=0.0)) * 1e-6)
    if not in_place:
        for buf, s in zip(b.buffers, saved):
            if not same_bits(buf, s):
                raise Finding(f"{op}: out of place, but an input changed")
    if dtype in (torch.float32, torch.float64) and eps > 0.0 and rng.random() < 0.2:
        # Forward mode: each output's tangent is R of the norm's derivative along its input's.
        check_tangents(gen, fn, [q, k], (freqs, start_pos, interleaved), kw_args, in_place,
                       lambda name, x, t: _reference(
                           torch.func.jvp(lambda a: _norm64(a, layout, qw if name == "q" else kw, eps, norm, offset),
                                          (x,), (t,))[1], layout, rows, inv, 1.0, 1.0, rd, interleaved, off),
                       lambda o, want, what: check_close(
                           canonical(o, layout), want, dtype, f"{op} {what} ({layout}, norm {norm})",
                           atol_extra=float(np.abs(want.numpy()).max(initial=0.0)) * 1e-6))
    if eps > 0.0 and rng.random() < 0.2:
        check_vmap(rng, gen, fn, [q, k], (freqs, start_pos, interleaved), kw_args, in_place,
                   lambda name, x: _reference(_normalized(x, layout, qw if name == "q" else kw, eps, norm, offset),
                                              layout, rows, inv, 1.0, 1.0, rd, interleaved, off),
                   lambda o, want, what: check_close(
                       canonical(o, layout), want, dtype, f"{op} vmap {what} ({layout}, norm {norm})",
                       atol_extra=float(np.abs(want.numpy()).max(initial=0.0)) * 1e-6))
    return kind, "accepted"
