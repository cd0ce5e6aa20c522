"""Fuzz cases for the fused KV-cache write rotary.apply_rope_with_kv_cache_
(cache layouts BHSD / BSHD / NHD / HND, slot_mapping with -1 and bad slots,
cache_positions, fp8 caches with k_scale / v_scale, GQA, varlen); those for
rotary.KVCache + CppRotaryEmbedding.forward_with_cache are in
kv_module_cases.py (run.py finds both here).

Accepted: q and k against the float64 reference, every written cache row
bitwise equal to the rotated k row / the v row (fp8: torch's
``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``, kv_oracle.py),
every other byte unchanged. Refused: every input byte-identical."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

import rotary

from .arg_draw import INT_DTYPES, angles, int_range, int_tensor, logical, neg_view, position_problem, reference
from .common import DOCUMENTED, FLOATS, Finding, bits, check_close, judge_refusal, set_kind
from .kv_module_cases import run_kv_module  # noqa: F401 - a family of run.py
from .kv_oracle import BAD_SCALES, FP8, KV_LAYOUTS, _Shape, cache_canon, logical_copy, quantize
from .op_inputs import Builder, canonical, logical_shape


def run_kv(seed, focus=None):
    """focus: None (op:kv_cache), "views", "index_dtypes" or "scalars"."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kind = set_kind({"views": "views", "index_dtypes": "index_dtypes", "scalars": "scalars"}.get(focus, "op:kv_cache"))
    dtype = rng.choice(FLOATS)
    varlen = rng.random() < 0.25
    layout = "THD" if varlen else rng.choice(["BHSD", "BSHD", "SBHD"])
    B = 1 if varlen else rng.randrange(1, 4)
    Hk = rng.randrange(1, 3)
    Hq = Hk * rng.choice([1, 1, 2, 3]) if rng.random() < 0.8 else rng.randrange(1, 4)
    S = rng.choice([0, 1, 1, 2, 3, 5, 8])
    D = rng.choice([4, 8, 16])
    rd = rng.choice([D, D] + list(range(2, D, 2)))
    L = rng.randrange(S + 4, 40)
    interleaved = rng.random() < 0.5
    inv = rotary.inv_frequencies(rd)[0].numpy()
    table = rotary.freqs_table(rd, L)
    b = Builder(rng, gen)
    modes = ["dense", "permuted", "gapped", "offset"]
    q = b.tensor(logical_shape(layout, B, Hq, S, D), dtype, rng.choice(modes))
    k = b.tensor(logical_shape(layout, B, Hk, S, D), dtype, rng.choice(modes))
    v = b.tensor(logical_shape(layout, B, Hk, S, D), dtype, rng.choice(modes))
    kv_layout = rng.choice(KV_LAYOUTS)
    paged = kv_layout in ("NHD", "HND")
    fp8 = rng.random() < 0.3 and focus != "views"
    reasons, mention, either = [], None, focus == "views"
    kw = dict(kv_layout=kv_layout)

    lens, cu = None, None
    if varlen:
        cuts = sorted(rng.randrange(0, S + 1) for _ in range(rng.randrange(0, 3)))
        bounds = [0] + cuts + [S]
        lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        cu = torch.tensor(bounds, dtype=rng.choice([torch.int32, torch.int64]))
        kw["cu_seqlens"] = cu
    Bq = 1 if varlen else B
    local = np.zeros((Bq, S), dtype=object)
    outer = np.zeros((Bq, S), dtype=object)  # contiguous caches: the row (sequence) of each token
    if varlen:
        at = 0
        for n_, ln in enumerate(lens):
            local[0, at : at + ln], outer[0, at : at + ln] = np.arange(ln), n_
            at += ln
    else:
        local[:] = np.arange(S)[None, :]
        outer[:] = np.arange(B)[:, None]

    # ---- positions
    use_inv = rng.random() < 0.2
    if use_inv:
        kw["inv_freq"] = torch.from_numpy(inv.copy())
    pform = rng.choice(["none", "none", "offsets", "ids"])
    start = rng.choice([0, 1, 3]) if pform != "ids" else 0
    pos_dtype = torch.int64
    if focus == "index_dtypes" and pform != "none":
        pos_dtype = rng.choice(INT_DTYPES)
    if pform == "offsets":
        shape = () if varlen or rng.random() < 0.4 else (B,)
        vals = [rng.randrange(0, 4) for _ in range(math.prod(shape))]
        if pos_dtype != torch.int64 and rng.random() < 0.5:
            lo, hi = int_range(pos_dtype)
            vals = [rng.choice([v for v in (hi, hi - 3, 255, 2**63, 2**64 - 1, lo, -1) if lo <= v <= hi]) for _ in vals]
        kw["offsets"] = int_tensor(vals, pos_dtype, shape)
        o = np.asarray(vals, dtype=object).reshape(shape)
        pos = local + start + (o if o.ndim == 0 else o[:, None])
    elif pform == "ids":
        n_tok = Bq * S
        vals = [rng.randrange(0, L) for _ in range(n_tok)]
        if pos_dtype != torch.int64 and rng.random() < 0.5:
            lo, hi = int_range(pos_dtype)
            vals = [rng.choice([v for v in (hi, 255, 2**63, 2**64 - 1, lo, -1, 1) if lo <= v <= hi]) for _ in vals]
        shape = (S,) if varlen else (B, S)
        kw["position_ids"] = int_tensor(vals, pos_dtype, shape)
        pos = np.asarray(vals, dtype=object).reshape(Bq, S)
    else:
        pos = local + start
    why = position_problem(pos, use_inv, L)
    if why:
        reasons.append(why)
    rope_ok = not why

    # ---- destinations
    T = Bq * S
    dest_dtype = rng.choice([torch.int32, torch.int64])
    if focus == "index_dtypes":
        dest_dtype = rng.choice(INT_DTYPES)
    flat_dest = rng.random() < 0.4 or varlen
    dest = [[None] * S for _ in range(Bq)]
    if paged:
        block = rng.choice([1, 2, 4, 16, 17])
        nb = (T + 3 + block - 1) // block + 1
        pool = nb * block
        slots = torch.randperm(pool, generator=gen)[:T].tolist()
        slots = [(-1 if rng.random() < 0.2 else s_) for s_ in slots]
        if T > 1 and rng.random() < 0.1:
            slots[1] = slots[0]  # two tokens, one slot: either may land
        lo, hi = int_range(dest_dtype)
        if focus == "index_dtypes" and rng.random() < 0.5:
            slots = [rng.choice([v for v in (-1, 255, 127, hi, lo, 2**63, 2**64 - 1, pool, 0) if lo <= v <= hi])
                     for _ in slots]
        slots = [s_ if lo <= s_ <= hi else 0 for s_ in slots]
        for t_, s_ in enumerate(slots):
            if 0 <= s_ < pool:
                dest[t_ // S][t_ % S] = (s_ // block, s_ % block)
        if any(not (-1 <= s_ < pool) for s_ in slots):
            reasons.append("slot_mapping outside the cache")
            mention = "slot_mapping"
        kw["slot_mapping"] = int_tensor(slots, dest_dtype, (T,) if flat_dest else (Bq, S))
        shape = (nb, block, Hk, D) if kv_layout == "NHD" else (nb, Hk, block, D)
    else:
        rows = len(lens) if varlen else B
        top = max([int(p) for p in pos.reshape(-1)] + [0]) if rope_ok else 0
        smax = rng.randrange(max(S, 1), max(S, 1) + 6)
        if rng.random() < 0.5 and not use_inv:
            smax = max(smax, top + 1)
        given = rng.random() < 0.4 or focus == "index_dtypes"
        if given:
            inner = np.array([[int(x) for x in torch.randperm(max(smax, S), generator=gen)[:S].tolist()]
                              for _ in range(Bq)], dtype=object).reshape(Bq, S) if S else np.zeros((Bq, 0), dtype=object)
            lo, hi = int_range(dest_dtype)
            if focus == "index_dtypes" and rng.random() < 0.5:
                inner = np.array([rng.choice([v for v in (255, 127, hi, lo, 2**63, 2**64 - 1, smax, 0, -1) if lo <= v <= hi])
                                  for _ in range(T)], dtype=object).reshape(Bq, S)
            inner = np.vectorize(lambda x: x if lo <= x <= hi else 0, otypes=[object])(inner) if T else inner
            kw["cache_positions"] = int_tensor(inner.reshape(-1) if flat_dest else inner, dest_dtype,
                                               (T,) if flat_dest else (Bq, S))
        else:
            inner = pos
            dest_dtype = torch.int64
        bad = [x for x in inner.reshape(-1) if not (0 <= int(x) < smax)] if (given or rope_ok) else []
        if bad:
            reasons.append("a cache position outside max_seq_len")
            mention = "cache_positions" if given else None
        for bi in range(Bq):
            for si in range(S):
                if 0 <= int(inner[bi, si]) < smax:
                    dest[bi][si] = (int(outer[bi, si]), int(inner[bi, si]))
        shape = (rows, Hk, smax, D) if kv_layout == "BHSD" else (rows, smax, Hk, D)
    taken = [x for row in dest for x in row if x is not None]
    if len(set(taken)) < len(taken):  # which token a shared row holds would depend on the schedule
        reasons.append("two tokens, one cache row")
        mention = None
    if dest_dtype not in (torch.int32, torch.int64) and (paged or "cache_positions" in kw):
        either = True  # documented int32 / int64: a refusal naming it, or the exact values used
        mention = "slot_mapping" if paged else "cache_positions"
    cdtype = FP8 if fp8 else dtype
    kc = b.tensor(shape, cdtype, rng.choice(["dense", "dense", "permuted", "gapped"]))
    vc = b.tensor(shape, cdtype, rng.choice(["dense", "dense", "permuted", "gapped"]))
    if fp8:
        for name in ("k_scale", "v_scale"):
            if rng.random() < 0.7:
                n = rng.choice([0, 1, Hk])
                vals = [rng.uniform(0.05, 2.0) for _ in range(max(n, 1))]
                kw[name] = torch.tensor(vals[0] if n == 0 else vals, dtype=torch.float32)
    kw["interleaved"] = interleaved
    kw["layout"] = layout

    # ---- one invalid mutation, sometimes
    args = [q, k, v, kc, vc, table]
    mutation = None
    if focus is None and rng.random() < 0.4:
        mutation = rng.choice(["scale_value", "scale_value", "scale_value", "scale_nonfp8", "scale_dtype", "scale_shape",
                               "no_slot", "slot_contig", "cpos_paged", "kv_layout", "cache_dtype", "cache_heads",
                               "v_is_k", "v_in_cache", "caches_alias", "cache_expanded", "dest_float", "v_dtype"])
    if focus == "scalars":
        mutation = "scalar"
    bad_mention = {"scale_value": None, "scale_nonfp8": "k_scale", "scale_dtype": "scale", "scale_shape": "scale",
                   "no_slot": "slot_mapping", "slot_contig": "slot_mapping", "cpos_paged": "cache_positions",
                   "kv_layout": "kv_layout", "cache_dtype": "k_cache", "cache_heads": "cache", "v_is_k": "v",
                   "v_in_cache": "v", "caches_alias": "cache", "cache_expanded": "cache", "dest_float": None,
                   "v_dtype": "v", "scalar": "start_pos"}
    if mutation == "scale_value":
        if not fp8:
            args[3], args[4] = kc.to(FP8), vc.to(FP8)
            b.buffers += [args[3], args[4]]
            fp8, cdtype = True, FP8
        name = rng.choice(["k_scale", "v_scale"])
        n = rng.choice([0, 1, Hk])
        vals = [rng.uniform(0.05, 2.0) for _ in range(max(n, 1))]
        vals[rng.randrange(len(vals))] = rng.choice(BAD_SCALES)
        kw[name] = torch.tensor(vals[0] if n == 0 else vals, dtype=torch.float32)
        reasons.append(f"{name} {vals}")
        bad_mention["scale_value"] = name
    elif mutation == "scale_nonfp8" and not fp8:
        kw["k_scale"] = torch.tensor(rng.choice([1.0, 0.5]))
        reasons.append("k_scale on a non-fp8 cache")
    elif mutation == "scale_dtype" and fp8:
        kw[rng.choice(["k_scale", "v_scale"])] = torch.tensor(0.5, dtype=rng.choice([torch.float64, torch.float16, torch.int32]))
        reasons.append("scale not float32")
    elif mutation == "scale_shape" and fp8:
        kw[rng.choice(["k_scale", "v_scale"])] = torch.full((Hk + 1,), 0.5)
        reasons.append("scale shape")
    elif mutation == "no_slot" and paged:
        kw.pop("slot_mapping")
        reasons.append("paged without slot_mapping")
    elif mutation == "slot_contig" and not paged:
        kw["slot_mapping"] = torch.zeros(T, dtype=torch.int64)
        reasons.append("slot_mapping with a contiguous cache")
    elif mutation == "cpos_paged" and paged:
        kw["cache_positions"] = torch.zeros(T, dtype=torch.int64)
        reasons.append("cache_positions with a paged cache")
    elif mutation == "kv_layout":
        kw["kv_layout"] = rng.choice(["bhsd", "THD", "", "SBHD", "NHD " if paged else "BHSD "])
        reasons.append("unknown kv_layout")
    elif mutation == "cache_dtype":
        other = torch.float64 if dtype != torch.float64 else torch.float32
        other = rng.choice([other, torch.int8, torch.float8_e5m2])
        args[3], args[4] = kc.to(other), vc.to(other)
        b.buffers += [args[3], args[4]]
        reasons.append("cache dtype")
    elif mutation == "cache_heads":
        ax = 2 if kv_layout in ("BSHD", "NHD") else 1
        args[3], args[4] = kc.narrow(ax, 0, 1).repeat_interleave(Hk + 1, ax), vc.narrow(ax, 0, 1).repeat_interleave(Hk + 1, ax)
        b.buffers += [args[3], args[4]]
        reasons.append("cache heads")
    elif mutation == "v_is_k" and T:
        args[2] = k
        reasons.append("v is k")
    elif mutation == "v_in_cache" and T and kv_layout == "BHSD" and not fp8 and shape[2] >= S and shape[0] >= B \
            and layout == "BHSD":
        args[2] = vc[:B, :, :S] if not varlen else vc
        if args[2].shape == v.shape:
            reasons.append("v inside v_cache")
        else:
            args[2] = v
    elif mutation == "caches_alias":
        args[4] = args[3]
        reasons.append("v_cache is k_cache")
    elif mutation == "cache_expanded" and shape[0] > 1:
        args[3] = kc.narrow(0, 0, 1).expand(shape)
        reasons.append("expanded k_cache")
    elif mutation == "dest_float":
        name = "slot_mapping" if paged else "cache_positions"
        kw[name] = torch.zeros(T if T else 1, dtype=torch.float32)
        reasons.append(f"{name} float")
        bad_mention["dest_float"] = name
    elif mutation == "v_dtype":
        args[2] = v.to(torch.float64 if dtype != torch.float64 else torch.float32)
        b.buffers.append(args[2])
        reasons.append("v dtype")
    elif mutation == "scalar":
        start = rng.choice([True, False, 2.0, 1.5, float("nan"), "1", torch.tensor(1.0)])
        reasons.append(f"start_pos={start!r}")
    else:
        mutation = None
    if mutation:
        mention = bad_mention.get(mutation) if len(reasons) == 1 else None
    elif len(reasons) > 1:
        mention = None

    # ---- views: one argument as a negative / conjugate view
    which = None
    if focus == "views":
        which = rng.choice(["q", "k", "v", "k_cache", "v_cache", "freqs_conj", "freqs_neg", "slot_or_pos",
                            "positions", "k_scale"])
        idx = {"q": 0, "k": 1, "v": 2, "k_cache": 3, "v_cache": 4}
        if which in idx:
            view, base = neg_view(args[idx[which]], rng)
            if view is None:
                which = None
            else:
                b.buffers.append(base)
                args[idx[which]] = view
        elif which == "freqs_conj":
            args[5] = table.conj()  # turns the other way; inv_freq stays the table's own
        elif which == "freqs_neg":
            args[5] = torch._neg_view(table)
            if use_inv:
                kw.pop("inv_freq")
                use_inv = False
                why = position_problem(pos, use_inv, L)
                if why and why not in reasons:
                    reasons.append(why)
        elif which == "slot_or_pos":
            name = "slot_mapping" if paged else "cache_positions"
            if name in kw and kw[name].dtype in (torch.int32, torch.int64):
                kw[name], _ = neg_view(kw[name], rng)
        elif which == "positions":
            name = "offsets" if "offsets" in kw else ("position_ids" if "position_ids" in kw else None)
            if name and kw[name].dtype in (torch.int32, torch.int64):
                kw[name], _ = neg_view(kw[name], rng)
        elif which == "k_scale" and fp8:
            pass
        which = which or "none"

    q, k, v, kc, vc, freqs = args
    sign = -1.0 if (which == "freqs_conj") else 1.0
    scale_rope = -1.0 if which == "freqs_neg" else 1.0
    label = f"apply_rope_with_kv_cache_ ({kv_layout}, {layout}, {'fp8' if fp8 else str(dtype)[6:]}" + \
        (f", {mutation}" if mutation else "") + (f", view {which}" if which else "") + ")"

    before = dict(q=logical(q), k=logical(k))
    v_before = logical_copy(v)
    kc_before, vc_before = logical_copy(cache_canon(kc, kv_layout)), logical_copy(cache_canon(vc, kv_layout))
    saved = [bits(t) for t in b.buffers]
    extra = [t for t in kw.values() if isinstance(t, torch.Tensor)]
    saved_extra = [logical_copy(t) for t in extra]

    try:
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, freqs, start, **kw)
    except Finding:
        raise
    except DOCUMENTED as e:
        msg = judge_refusal(label, e, b.buffers, saved, reasons, either, mention)
        if mutation == "scalar" and type(e) not in (TypeError, ValueError):
            raise Finding(f"{label}: {msg} (a TypeError / ValueError expected)") from None
        return kind, f"refused: {msg}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{label}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if reasons:
        raise Finding(f"{label}: accepted bad input ({', '.join(reasons)})")

    # ---- accepted: q and k rotated, the caches hold exactly the token rows
    ang = angles(_Shape(rd), pos, sign=sign, inv=inv)
    for name, t in (("q", q), ("k", k)):
        expected = reference(canonical(before[name], layout), ang, 0, rd, interleaved, scale_rope)
        check_close(canonical(t, layout), expected, dtype, f"{label} {name}")
    if not torch.equal(bits(logical_copy(v)), bits(v_before)):
        raise Finding(f"{label}: v was written")
    for t, s in zip(extra, saved_extra):
        if not torch.equal(bits(logical_copy(t)), bits(s)):
            raise Finding(f"{label}: an index or scale tensor was written")
    krow, vrow = canonical(logical_copy(k), layout), canonical(v_before, layout)
    for cname, cache, cb, src, sname in (("k_cache", kc, kc_before, krow, "k_scale"), ("v_cache", vc, vc_before, vrow, "v_scale")):
        after = logical_copy(cache_canon(cache, kv_layout))
        want = cb.clone()
        cands = {}
        for bi in range(Bq):
            for si in range(S):
                if dest[bi][si] is not None:
                    row = src[bi, :, si, :]
                    row = quantize(row, kw.get(sname), dtype) if fp8 else row
                    cands.setdefault(dest[bi][si], []).append(row)
        for (o, i), rows in cands.items():
            got = after[o, :, i, :]
            pick = next((r for r in rows if torch.equal(bits(r), bits(got))), rows[0])
            want[o, :, i, :] = pick
        if not torch.equal(bits(after), bits(want)):
            diff = (bits(after) != bits(want)).nonzero()[:1].tolist()
            raise Finding(f"{label}: {cname} differs from the expected rows (first at {diff}; "
                          f"{len(cands)} rows written)")
    return kind, "accepted"
