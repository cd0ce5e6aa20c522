"""Fuzz cases for the four ops: random layouts, strides, views, dtypes,
positions, cu_seqlens, inv_freq, partial rotary, conjugate tables and
inverse, valid and invalid. The expected outcome is derived from how the
inputs were built (element offsets are enumerated to decide overlap), never
from rotary itself (the builders and the reference: op_inputs.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq

from .common import (DEVICE, FLOATS, Finding, Refused, bits, check_close, check_tangents, check_vmap, expect_refusal,
                     same_bits, set_kind)
from .op_inputs import (MODES, OPS, Builder, _positions, _reference, _rows, canonical, heads_axis, logical_shape,
                        self_overlaps, share_elements)

LAYOUTS = ["BHSD", "BSHD", "SBHD", "THD"]


def run(seed: int) -> tuple[str, str]:
    """Returns (kind, "accepted" | "refused: ..."); raises Finding."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    op = rng.choice(OPS)
    set_kind(f"op:{op}")
    qk, in_place = "qk" in op, op.endswith("_")
    dtype = rng.choice(FLOATS)
    layout = rng.choice(LAYOUTS)
    B = 1 if layout == "THD" else rng.randrange(1, 4)
    Hq, Hk = rng.randrange(1, 4), rng.randrange(1, 3)
    S = rng.choice([0, 1, 2, 3, 5, 7, 9]) if rng.random() < 0.9 else rng.randrange(10, 40)
    D = rng.choice([2, 4, 6, 8, 12, 16, 32])
    rd = rng.choice([D, D, D] + [d for d in range(2, D, 2)])
    L = rng.randrange(1, 24)
    theta = rng.choice([10000.0, 500.0, 1e6, rng.uniform(2.0, 1e5)])
    interleaved, inverse = rng.random() < 0.5, rng.random() < 0.3
    use_inv = rng.random() < 0.4
    # "lazy": freqs.conj(), a view; "physical": the conjugate values in memory,
    # whose frequencies are -inv_freq (docs/api.md "Ops").
    conj_mode = rng.choice([None, None, None, "lazy", "physical"])
    conj = conj_mode is not None
    past = rng.random() < 0.2
    start_pos = rng.choice([0, 0, 1, 2, 5]) if not past else rng.randrange(0, L + 4)
    reasons = []  # why the call must be refused: (exception types, reason)

    rule = rng.choice([None] * 6 + ["linear", "yarn"])
    scaling = None
    if rule == "linear":
        scaling = {"rope_type": "linear", "factor": rng.choice([0.5, 2.0, 4.0])}
    elif rule == "yarn":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    table = rotary.rope_freqs(rd, L, theta, scaling)
    if scaling is None:
        inv, scale = ref_inv_freq(rd, theta), 1.0
    else:
        inv_t, scale = rotary.rope_frequencies(rd, theta, scaling)
        inv = inv_t.numpy()
    freqs = table
    if rng.random() < 0.2:  # non-contiguous copy of the same table
        freqs = table.t().contiguous().t()
    if conj_mode == "lazy":
        freqs = freqs.conj()
    elif conj_mode == "physical":
        freqs = torch.conj_physical(freqs)
    given = -inv if conj_mode == "physical" else inv
    inv_arg = torch.from_numpy(given.copy()) if use_inv else None
    if use_inv and rng.random() < 0.3:
        inv_arg = torch.from_numpy(np.repeat(given, 2))[::2]

    b = Builder(rng, gen)
    shape_q = logical_shape(layout, B, Hq, S, D)
    shape_k = logical_shape(layout, B, Hk, S, D)
    pair_mode = rng.choice(["independent", "independent", "packed", "shared"]) if qk else "independent"
    if pair_mode == "packed":
        ax = heads_axis(layout)
        extra = rng.choice([0, 1])
        shift = -1 if (rng.random() < 0.25 and Hq > 0) else 0  # k starting inside q: overlap
        full = list(shape_q)
        full[ax] = Hq + Hk + extra
        base = b.tensor(tuple(full), dtype, rng.choice(["dense", "permuted", "gapped"]))
        q = base.narrow(ax, 0, Hq)
        k = base.narrow(ax, Hq + shift, Hk)
    elif pair_mode == "shared":
        n = max(math.prod(shape_q), math.prod(shape_k))
        buf = b.buffer(4 * n + 64, dtype)

        def strided(shape):
            strides = [rng.choice([1, 2, 4, 8, 16, 32, 64]) for _ in shape]
            strides[-1] = rng.choice([1, 1, 2])
            span = sum((s - 1) * st for s, st in zip(shape, strides)) + 1
            return buf.as_strided(shape, strides, rng.randrange(0, max(1, buf.numel() - span)))

        try:
            q, k = strided(shape_q), strided(shape_k)
        except RuntimeError:
            q, k = b.tensor(shape_q, dtype, "dense"), b.tensor(shape_k, dtype, "dense")
    else:
        q = b.tensor(shape_q, dtype, rng.choice(MODES))
        k = b.tensor(shape_k, dtype, rng.choice(MODES)) if qk else None

    positions, pkind = _positions(rng, layout, B, S, L, past)
    cu = None
    if layout == "THD":
        cuts = sorted(rng.randrange(0, S + 1) for _ in range(rng.randrange(0, 3)))
        cu = torch.tensor([0] + cuts + [S], dtype=rng.choice([torch.int32, torch.int64]))

    # ---- one invalid mutation, sometimes
    mutation = rng.choice(
        ["int_dtype", "odd_head", "freqs_wide", "freqs_dtype", "pos_int32", "pos_shape", "bad_layout", "start_neg",
         "start_huge", "start_overflow", "inv_f32", "inv_shape", "freqs_grad", "k_dtype", "k_seq", "cu_bad", "cu_float",
         "x_rank", "freqs_meta", "neg_position", "inplace_grad"]
    ) if rng.random() < 0.3 else None
    layout_arg = "BHSD" if layout == "THD" and rng.random() < 0.5 else layout
    if mutation == "int_dtype":
        q = torch.randint(-3, 3, q.shape, generator=gen, dtype=torch.int32).to(DEVICE)
        reasons.append("x is int32")
    elif mutation == "odd_head":
        q = q[..., : D - 1] if D > 2 else q[..., :1]
        reasons.append("odd head_dim")
    elif mutation == "freqs_wide":
        freqs = rotary.rope_freqs(D + 2, L)
        reasons.append("freqs wider than head_dim")
    elif mutation == "freqs_dtype":
        freqs = rng.choice([freqs.to(torch.complex128), torch.view_as_real(table)[..., 0].contiguous()])
        reasons.append("freqs not complex64")
    elif mutation == "pos_int32":
        positions = torch.zeros(B, dtype=torch.float32)  # any integer dtype is accepted
        reasons.append("positions float")
    elif mutation == "pos_shape":
        positions = torch.zeros(B + 1, S + 2, 2, dtype=torch.int64)
        reasons.append("positions 3-D")
    elif mutation == "bad_layout":
        layout_arg = rng.choice(["HBSD", "bhsd", "", "BHSD "])
        reasons.append("unknown layout")
    elif mutation == "start_neg":
        start_pos = -rng.randrange(1, 10)
        reasons.append("negative start_pos")
    elif mutation == "start_huge":
        start_pos = rng.choice([2**60, 2**62, 2**63 - 1])
        reasons.append("start_pos >= 2^60")
    elif mutation == "start_overflow":
        start_pos = rng.choice([2**63, 2**64, -(2**63) - 1, 10**30])
        reasons.append("start_pos outside int64")
    elif mutation == "inv_f32":
        inv_arg = torch.from_numpy(inv.copy()).float()
        reasons.append("inv_freq float32")
    elif mutation == "inv_shape":
        inv_arg = torch.ones(rd // 2 + 1, dtype=torch.float64)
        reasons.append("inv_freq wrong length")
    elif mutation == "freqs_grad":
        freqs = table.clone().requires_grad_()
        reasons.append("freqs requires grad")
    elif mutation == "k_dtype" and qk:
        k = k.to(torch.float64 if dtype != torch.float64 else torch.float32)
        reasons.append("k dtype differs")
    elif mutation == "k_seq" and qk:
        k = torch.randn(logical_shape(layout, B, Hk, S + 1, D), generator=gen).to(dtype).to(DEVICE)
        reasons.append("k seq differs")
    elif mutation == "cu_bad" and cu is not None:
        cu = torch.tensor([0, S + 1] if rng.random() < 0.5 else [1, S], dtype=torch.int64)
        reasons.append("bad cu_seqlens")
    elif mutation == "cu_float" and cu is not None:
        cu = cu.float()
        reasons.append("cu_seqlens float")
    elif mutation == "x_rank":
        q = q.unsqueeze(0)
        reasons.append("x rank")
    elif mutation == "freqs_meta":
        freqs = table.to("meta")
        reasons.append("freqs on another device")
    elif mutation == "neg_position":
        if layout == "THD":
            positions = torch.full((S,), -1, dtype=torch.int64)
        else:
            positions = torch.full((B, S), -rng.randrange(1, 5), dtype=torch.int64)
        # start_pos may make up for it: the rows decide below
    elif mutation == "inplace_grad" and in_place:
        q.requires_grad_() if q.is_leaf else None
        if q.requires_grad:
            reasons.append("in-place on a tensor that requires grad")
    else:
        mutation = None

    # ---- how positions are passed: the deprecated positions= (rank decides),
    # or offsets= / position_ids= (absolute: start_pos must be 0 with them)
    form = rng.choice(["legacy", "new", "new"])
    pos_kw = {}
    if positions is not None:
        is_ids = positions.dim() == 1 if layout == "THD" else positions.dim() >= 2
        if form == "legacy":
            pos_kw["positions"] = positions
        elif is_ids:
            pos_kw["position_ids"] = positions
            if start_pos != 0 and not reasons and rng.random() < 0.85:
                start_pos = 0
            elif isinstance(start_pos, int) and start_pos != 0 and not reasons:
                reasons.append("start_pos with position_ids")
        else:
            pos_kw["offsets"] = positions
    rotary_offset = rng.randrange(0, D - rd + 1) if rd < D and rng.random() < 0.4 else 0

    # ---- what the documented semantics say about the remaining inputs
    structural = bool(reasons)
    if not structural:
        rows = _rows(layout, B, S, start_pos, positions, cu)
        if rows.size and (rows < 0).any():
            reasons.append("negative position")
        elif rows.size and not use_inv and (rows >= L).any():
            reasons.append("position past the table without inv_freq")
        if in_place:
            if self_overlaps(q) or (qk and self_overlaps(k)):
                reasons.append("a written tensor overlaps itself")
            if qk and share_elements(q, k):
                reasons.append("q and k share elements")

    if DEVICE != "cpu":  # values the host must see to refuse stay on the host (then: a device mismatch)
        freqs = freqs.to(DEVICE) if freqs.device.type == "cpu" else freqs
        inv_arg = inv_arg.to(DEVICE) if inv_arg is not None else None
        by_value = {"negative position", "position past the table without inv_freq", "bad cu_seqlens"}
        if not by_value & set(reasons):
            positions = positions.to(DEVICE) if positions is not None else None
            cu = cu.to(DEVICE) if cu is not None else None

    grad = (not in_place) and not reasons and dtype in (torch.float32, torch.float64) and rng.random() < 0.3
    if grad:
        q = q.detach().requires_grad_()
        if qk:
            k = k.detach().requires_grad_()

    for name in pos_kw:  # moved to the device above, where by-value checks allow
        pos_kw[name] = positions
    kw = dict(inverse=inverse, cu_seqlens=cu, inv_freq=inv_arg, layout=layout_arg, **pos_kw)
    if rotary_offset:
        kw["rotary_offset"] = rotary_offset
    fn = getattr(rotary, op)
    args = (q, k, freqs) if qk else (q, freqs)
    kind = f"op:{op}"
    saved = [bits(t) for t in b.buffers]
    saved_in = [bits(t) for t in (q, k) if t is not None]

    # In place, a valid call runs in any grad mode (a tensor that requires
    # grad is refused only with grad on) and bumps what it writes in each.
    mode = rng.choice(["grad", "no_grad", "inference"]) if in_place and not reasons else "grad"
    grad_mode = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    written = [t for t in (q, k) if t is not None] if in_place else []
    versions = [t._version for t in written]

    def call():
        with grad_mode():
            return fn(*args, start_pos, interleaved, **kw)

    if reasons:
        try:
            expect_refusal(call, what=f"{op} ({', '.join(reasons)})")
        except Refused as r:
            for buf, s in zip(b.buffers, saved):
                if not same_bits(buf, s):
                    raise Finding(f"{op}: refused ({r}) but changed the bytes of an input") from None
            if [t._version for t in written] != versions:
                raise Finding(f"{op}: refused ({r}) but bumped a version counter") from None
            return kind, f"refused: {r}"
        raise Finding(f"{op}: accepted bad input ({', '.join(reasons)})")

    try:
        out = call()
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{op}: refused valid input with {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if any(t._version <= v for t, v in zip(written, versions)):
        raise Finding(f"{op}: in place under {mode}, a written tensor's version counter was not bumped")

    sign = -1.0 if (inverse != conj) else 1.0
    rows = _rows(layout, B, S, start_pos, positions, cu)
    outs = (out if qk else (out,)) if not in_place else ((q, k) if qk else (q,))
    for name, src, o, snap in zip(("q", "k"), (q, k), outs, saved_in):
        # the reference reads the values the call started from
        before = snap.view(src.dtype)
        expected = _reference(before, layout, rows, inv, scale, sign, rd, interleaved, rotary_offset)
        if o.dtype != src.dtype or o.shape != src.shape:
            raise Finding(f"{op}: output {name} is {o.dtype} {tuple(o.shape)}, input {src.dtype} {tuple(src.shape)}")
        check_close(canonical(o, layout), expected, dtype, f"{op} {name} ({layout}, {pkind})", scale)
        if in_place and rd < D:
            keep = [j for j in range(D) if not rotary_offset <= j < rotary_offset + rd]
            tail = canonical(o, layout)[..., keep]
            if not torch.equal(bits(tail), bits(canonical(before, layout)[..., keep])):
                raise Finding(f"{op}: in place, dims outside [rotary_offset, rotary_offset + rotary_dim) changed")
    if in_place:  # nothing outside q and k was written
        for buf, s in zip(b.buffers, saved):
            after = buf.detach().clone()
            restored = s.view(buf.dtype).clone()
            for t in (q, k):
                if t is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
                    view = restored.as_strided(t.shape, t.stride(), t.storage_offset() - buf.storage_offset())
                    view.copy_(after.as_strided(t.shape, t.stride(), t.storage_offset() - buf.storage_offset()))
            if not torch.equal(bits(after), bits(restored)):
                raise Finding(f"{op}: in place, bytes outside q/k were written")
    else:
        for buf, s in zip(b.buffers, saved):
            if not same_bits(buf, s):
                raise Finding(f"{op}: out of place, but an input changed")
    if grad:
        gq = torch.randn(q.shape, generator=gen, dtype=dtype).to(DEVICE)
        gk = torch.randn(k.shape, generator=gen, dtype=dtype).to(DEVICE) if qk else None
        loss = (outs[0] * gq).sum() + ((outs[1] * gk).sum() if qk else 0)
        loss.backward()
        for name, t, g in zip(("q", "k"), (q, k), (gq, gk)):
            if t is None:
                continue
            expected = _reference(g, layout, rows, inv, scale, -sign, rd, interleaved, rotary_offset)
            check_close(canonical(t.grad, layout), expected, dtype, f"{op} grad {name} ({layout})", scale)
    inputs = [t for t in (q, k) if t is not None]
    if dtype in (torch.float32, torch.float64) and rng.random() < 0.3 and not any(
            self_overlaps(t) for t in inputs):  # make_dual copies a tangent into its primal's strides
        # Forward mode: each output's tangent is the same rotation of its input's.
        check_tangents(gen, fn, inputs, (freqs, start_pos, interleaved), kw, in_place,
                       lambda name, x, t: _reference(t, layout, rows, inv, scale, sign, rd, interleaved, rotary_offset),
                       lambda o, want, what: check_close(canonical(o, layout), want, dtype, f"{op} {what} ({layout})",
                                                         scale))
    if rng.random() < 0.2:
        check_vmap(rng, gen, fn, inputs, (freqs, start_pos, interleaved), kw, in_place,
                   lambda name, t: _reference(t, layout, rows, inv, scale, sign, rd, interleaved, rotary_offset),
                   lambda o, want, what: check_close(canonical(o, layout), want, dtype, f"{op} vmap {what}", scale))
    return kind, "accepted"
