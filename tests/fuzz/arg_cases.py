"""Fuzz cases for the op arguments added after the first op fuzz, one
category per argument (the others drawn at random): rotary_offset,
pair_axes (N-D positions), torch.view_as_real(freqs) tables, negative and
conjugate views, every integer dtype of the index tensors, and bool / float
scalars where ints are expected.

The random call, the exact positions, the reference and the outcome check
live in arg_draw.py; this file keeps one case family per argument."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from .arg_draw import (INT64_EDGES, INT_DTYPES, Draw, _overlap_reasons, _sign, angles, int_range, int_tensor,
                       neg_view, position_problem, run_call)


# ------------------------------------------------------------ rotary_offset
def run_rotary_offset(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d = Draw(rng, gen)
    q = d.heads(d.Hq)
    k = d.heads(d.Hk) if d.qk else None
    start = rng.choice([0, 1, 3])
    use_inv = rng.random() < 0.3
    kw = dict(layout=d.layout if not d.varlen else "THD", cu_seqlens=d.cu,
              inverse=d.inverse, inv_freq=torch.from_numpy(d.inv.copy()) if use_inv else None)
    pos = d.grid(start)
    reasons, mention = _overlap_reasons(d, q, k), None
    r = rng.random()
    if r < 0.55:
        d.offset = rng.randrange(0, d.D - d.rd + 1)
    elif r < 0.75:
        d.offset = rng.choice([-1, -d.rd, d.D - d.rd + 1, d.D, d.D + 2])
        reasons, mention = reasons + ["rotary_offset outside the head"], "rotary_offset"
    else:
        d.offset = rng.choice(INT64_EDGES)
        reasons, mention = reasons + ["rotary_offset near the int64 bounds"], "rotary_offset"
    kw["rotary_offset"] = d.offset
    why = position_problem(pos, use_inv, d.L)
    if why:
        reasons.append(why)
        mention = mention if len(reasons) == 1 else None
    return run_call(d, q, k, d.table, start, kw, reasons=reasons, mention=mention, what=f"rotary_offset={d.offset}", kind="rotary_offset",
                    angle=None if reasons else angles(d, pos, sign=_sign(d)))


# ---------------------------------------------------------------- pair_axes
def run_pair_axes(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d = Draw(rng, gen)
    q = d.heads(d.Hq)
    k = d.heads(d.Hk) if d.qk else None
    n = rng.randrange(1, 4)
    pairs = d.rd // 2
    axes = [rng.randrange(n) for _ in range(pairs)]
    axes[rng.randrange(pairs)] = n - 1  # n_axes is max + 1
    use_inv = rng.random() < 0.3
    hi = d.L + 5 if use_inv else d.L
    form = "packed" if d.varlen else rng.choice(["nbs", "nbs", "ns", "n1s", "nb1"])
    B, S = d.B, d.S
    shape = {"packed": (n, S), "nbs": (n, B, S), "ns": (n, S), "n1s": (n, 1, S), "nb1": (n, B, 1)}[form]
    ids = np.array([rng.randrange(0, hi) for _ in range(math.prod(shape))], dtype=object).reshape(shape)
    full = ids if ids.ndim == 3 else ids[:, None, :]
    full = np.broadcast_to(full, (n, B, S))
    reasons, mention, arg = _overlap_reasons(d, q, k), None, list(axes)
    start = 0
    r = rng.random()
    if r < 0.12:
        arg = [bool(a % 2) for a in axes]
        reasons, mention = reasons + ["pair_axes of bools"], "pair_axes"
    elif r < 0.24:
        j = rng.randrange(pairs)
        arg[j] = rng.choice([-1, 16, 17, 255, 256, 2**32, 2**40, -(2**63)])
        reasons, mention = reasons + ["pair_axes value out of range"], "pair_axes"
    elif r < 0.30:
        arg = arg + [0] if rng.random() < 0.5 else arg[:-1]
        reasons, mention = reasons + ["pair_axes of the wrong length"], "pair_axes"
    elif r < 0.36:
        ids = np.concatenate([ids, ids[:1]], axis=0)  # one axis too many
        reasons, mention = reasons + ["an axis count that does not match"], None
    elif r < 0.42:
        start = rng.randrange(1, 4)
        reasons, mention = reasons + ["start_pos with position_ids"], "start_pos"
    why = position_problem(full, use_inv, d.L) if not reasons else None
    if why:
        reasons.append(why)
    dtype = rng.choice([torch.int64, torch.int64, torch.int32, torch.int16, torch.uint8]) if ids.size and \
        max(int(v) for v in ids.reshape(-1)) < 128 else torch.int64
    kw = dict(layout="THD" if d.varlen else d.layout, cu_seqlens=d.cu, inverse=d.inverse,
              inv_freq=torch.from_numpy(d.inv.copy()) if use_inv else None,
              position_ids=int_tensor(ids, dtype), pair_axes=arg)
    if rng.random() < 0.3:
        d.offset = kw["rotary_offset"] = rng.randrange(0, d.D - d.rd + 1)
    return run_call(d, q, k, d.table, start, kw, reasons=reasons, mention=mention, what=f"pair_axes {form}", kind="pair_axes",
                    angle=None if reasons else angles(d, full, axes, _sign(d)))


# --------------------------------------------------------------- freqs_real
def run_freqs_real(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d = Draw(rng, gen)
    q = d.heads(d.Hq)
    k = d.heads(d.Hk) if d.qk else None
    L, P = d.L, d.rd // 2
    real = torch.view_as_real(d.table)
    sign, bad = _sign(d), None
    kind = rng.choice(["plain", "strided", "conj_physical", "padded", "odd_offset", "odd_stride", "last_strided",
                       "width3", "float64", "flat"])
    if kind == "plain":
        freqs = real
    elif kind == "strided":  # view_as_real of a non-contiguous complex table
        freqs = torch.view_as_real(d.table.t().contiguous().t())
    elif kind == "conj_physical":
        freqs, sign = torch.view_as_real(torch.conj_physical(d.table)), -sign
    elif kind == "padded":  # [L, P, 4] storage, first two of each: strides even
        big = torch.zeros(L, P, 4)
        big[..., :2] = real
        freqs = big[..., :2]
    elif kind == "odd_offset":
        buf = torch.zeros(1 + L * P * 2)
        buf[1:] = real.reshape(-1)
        freqs, bad = buf[1:].view(L, P, 2), "an odd storage offset"
    elif kind == "odd_stride":
        big = torch.zeros(L, P, 3)
        big[..., :2] = real
        freqs, bad = big[..., :2], "odd strides"
    elif kind == "last_strided":
        freqs, bad = real.permute(2, 0, 1).contiguous().permute(1, 2, 0), "a last dim that is not contiguous"
    elif kind == "width3":
        freqs, bad = torch.cat([real, real[..., :1]], dim=-1), "a last dim of 3"
    elif kind == "float64":
        freqs, bad = real.double(), "float64"
    else:
        freqs, bad = real.reshape(L, 2 * P), "a 2-D float table"
    start = rng.choice([0, 1, 2])
    pos = d.grid(start)
    reasons = _overlap_reasons(d, q, k)
    if bad:
        reasons.append(f"freqs with {bad}")
    why = position_problem(pos, False, d.L)
    if why:
        reasons.append(why)
    mention = "freqs" if bad and len(reasons) == 1 else None
    kw = dict(layout="THD" if d.varlen else d.layout, cu_seqlens=d.cu, inverse=d.inverse)
    return run_call(d, q, k, freqs, start, kw, reasons=reasons, mention=mention, what=f"freqs_real {kind}", kind="freqs_real",
                    angle=None if reasons else angles(d, pos, sign=sign))


# -------------------------------------------------------------------- views
def run_views(seed):
    """A negative or conjugate view as one tensor argument: the right result
    (for the logical values) or a clear refusal naming it."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    if rng.random() < 0.3:
        from .kv_cases import run_kv
        return run_kv(seed, focus="views")
    d = Draw(rng, gen)
    q = d.heads(d.Hq, "dense")
    k = d.heads(d.Hk, "dense") if d.qk else None
    which = rng.choice(["q", "q", "k", "k", "freqs_conj", "freqs_neg", "freqs_conj_neg", "inv_freq", "positions",
                        "cu_seqlens"] if d.qk else ["q", "q", "freqs_conj", "freqs_neg", "inv_freq", "positions",
                                                    "cu_seqlens"])
    if which == "cu_seqlens" and not d.varlen:
        which = "q"
    start, freqs, sign, scale = rng.choice([0, 1, 2]), d.table, _sign(d), 1.0
    use_inv = which == "inv_freq" or rng.random() < 0.2
    kw = dict(layout="THD" if d.varlen else d.layout, cu_seqlens=d.cu, inverse=d.inverse,
              inv_freq=torch.from_numpy(d.inv.copy()) if use_inv else None)
    offsets = None
    if which in ("q", "k"):
        t = q if which == "q" else k
        v, base = neg_view(t, rng)
        d.b.buffers.append(base)
        if which == "q":
            q = v
        else:
            k = v
    elif which.startswith("freqs"):
        if "conj" in which:
            freqs, sign = freqs.conj(), -sign
        if "neg" in which:
            freqs, scale = torch._neg_view(freqs), -1.0
            kw["inv_freq"], use_inv = None, False  # past the table the sign of a table row is not defined
    elif which == "inv_freq":
        kw["inv_freq"], base = neg_view(kw["inv_freq"], rng)
    elif which == "positions":
        o = rng.randrange(0, 3)
        offsets = torch.tensor(o) if d.varlen or rng.random() < 0.5 else torch.tensor([o] * d.B)
        kw["offsets"], _ = neg_view(offsets, rng)
        offsets = offsets.numpy()
    else:
        kw["cu_seqlens"], _ = neg_view(d.cu, rng)
    pos = d.grid(start, offsets)
    reasons = _overlap_reasons(d, q, k)
    why = position_problem(pos, use_inv, d.L)
    if why:
        reasons.append(why)
    mention = None
    return run_call(d, q, k, freqs, start, kw, reasons=reasons, either=True, mention=mention, what=f"views {which}", kind="views",
                    angle=None if reasons else angles(d, pos, sign=sign), scale=scale)


# ------------------------------------------------------------- index_dtypes
def _wrap_values(rng, dt, n, L, use_inv, start=0):
    lo, hi = int_range(dt)
    pool = [0, 1, 2, L - 1, L, hi, hi - 1, lo, lo + 1, 127, 128, 250, 255, 256, 32767, 65535, 2**31 - 1, 2**31,
            2**32 - 1, 2**40, 2**60, 2**63 - 1, 2**63, 2**64 - 1, -1, -5]
    # values whose sum with start_pos wraps to a small row, in the dtype or read as int64
    pool += [hi + 1 - start + j for j in range(3)] + [2**64 - start + j for j in range(2)] + [2**32 - start]
    pool = [v for v in pool if lo <= v <= hi]
    small = [v for v in range(0, L) if lo <= v <= hi]
    return [rng.choice(pool) if rng.random() < 0.4 else rng.choice(small) for _ in range(n)]


def run_index_dtypes(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    if rng.random() < 0.3:
        from .kv_cases import run_kv
        return run_kv(seed, focus="index_dtypes")
    d = Draw(rng, gen)
    q = d.heads(d.Hq)
    k = d.heads(d.Hk) if d.qk else None
    dt = rng.choice(INT_DTYPES + [torch.bool] if rng.random() < 0.1 else INT_DTYPES)
    use_inv = rng.random() < 0.5
    which = rng.choice(["offsets", "position_ids", "legacy", "cu_seqlens"] if d.varlen else
                       ["offsets", "position_ids", "legacy"])
    kw = dict(layout="THD" if d.varlen else d.layout, cu_seqlens=d.cu, inverse=d.inverse,
              inv_freq=torch.from_numpy(d.inv.copy()) if use_inv else None)
    reasons, mention, either = _overlap_reasons(d, q, k), which if which != "legacy" else None, False
    start = rng.choice([0, 0, 1, 10])
    B, S = d.B, d.S
    if dt == torch.bool:
        vals = torch.zeros((B,) if which == "offsets" and not d.varlen else ((S,) if d.varlen else (B, S)),
                           dtype=torch.bool)
        kw["offsets" if which != "position_ids" else "position_ids"] = vals
        if which == "position_ids":
            start = 0
        reasons.append("a bool index tensor")
        mention = "position_ids" if which == "position_ids" else "offsets"
        if which == "cu_seqlens":
            kw.pop("offsets")
            kw["cu_seqlens"], mention = d.cu.bool(), "cu_seqlens"
        if which == "legacy":
            kw.pop("offsets")
            kw["positions"], mention = vals, None
        return run_call(d, q, k, d.table, start, kw, reasons=reasons, mention=mention, what=f"index_dtypes {which} bool", kind="index_dtypes")
    if which == "cu_seqlens":
        kw["cu_seqlens"] = int_tensor(d.cu.tolist(), dt)
        either = dt not in (torch.int32, torch.int64)  # documented int32/int64; a correct widening passes too
        if not either:
            mention = None  # a valid cu_seqlens: a refusal, if any, is about the positions
        pos = d.grid(start)
    elif which == "offsets" or (which == "legacy" and rng.random() < 0.5):
        shape = () if d.varlen or rng.random() < 0.3 else (B,)
        vals = _wrap_values(rng, dt, math.prod(shape), d.L, use_inv, start)
        t = int_tensor(vals, dt, shape)
        kw["offsets" if which == "offsets" else "positions"] = t
        pos = d.grid(start, np.asarray(vals, dtype=object).reshape(shape))
    else:  # ids
        shape = (S,) if d.varlen else rng.choice([(B, S), (1, S), (B, 1)] + ([(S,)] if which == "position_ids" else []))
        vals = _wrap_values(rng, dt, math.prod(shape), d.L, use_inv, start)
        t = int_tensor(vals, dt, shape)
        arr = np.asarray(vals, dtype=object).reshape(shape)
        if which == "position_ids":
            start = 0 if rng.random() < 0.85 else start
            if start:
                reasons.append("start_pos with position_ids")
                mention = "start_pos"
            kw["position_ids"] = t
            pos = np.broadcast_to(arr if arr.ndim == 2 else arr[None, :], (B, S)).copy()
        else:  # deprecated positions=: ids added to start_pos
            kw["positions"] = t
            full = arr if arr.ndim == 2 else arr[None, :]
            pos = np.broadcast_to(full + start, (B, S)).copy()
    why = position_problem(pos, use_inv, d.L)
    if why:
        reasons.append(why)
    if np.asarray(pos).size == 0:
        either = True  # no token reads the values: refusing a bad one by value is as right as ignoring it
    if len(reasons) != 1:
        mention = None
    return run_call(d, q, k, d.table, start, kw, reasons=reasons, either=either and not reasons, mention=mention,
                    what=f"{which} {str(dt)[6:]}", kind="index_dtypes", angle=None if reasons else angles(d, pos, sign=_sign(d)))


# ------------------------------------------------------------------ scalars
def run_scalars(seed):
    """bool / float (and oversized) scalars where an int is expected: refused
    with a TypeError / ValueError that names the argument."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    target = rng.choice(["op", "op", "op", "kv", "module", "module", "kv_module"])
    if target == "kv":
        from .kv_cases import run_kv
        return run_kv(seed, focus="scalars")
    if target == "module":
        from .module_cases import run_module_scalars
        return run_module_scalars(seed)
    if target == "kv_module":
        from .kv_module_cases import run_kv_module_scalars
        return run_kv_module_scalars(seed)
    d = Draw(rng, gen, varlen=False)
    q = d.heads(d.Hq)
    k = d.heads(d.Hk) if d.qk else None
    arg = rng.choice(["start_pos", "start_pos", "rotary_offset"])
    value = rng.choice([True, False, 2.0, 0.0, 1.5, float("nan"), "3", None, torch.tensor(1.0)])
    kw = dict(layout=d.layout, inverse=d.inverse)
    start = 0
    if arg == "start_pos":
        start = value
    else:
        kw["rotary_offset"] = value
    reasons = _overlap_reasons(d, q, k) + [f"{arg}={value!r}"]
    return run_call(d, q, k, d.table, start, kw, reasons=reasons, mention=arg if len(reasons) == 1 else None,
                    allowed=(TypeError, ValueError), what=f"{arg}={value!r}", kind="scalars")
