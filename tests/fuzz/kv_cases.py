"""Fuzz cases for the fused KV-cache write rotary.apply_rope_with_kv_cache_
(cache layouts BHSD / BSHD / NHD / HND, slot_mapping with -1 and bad slots,
cache_positions, fp8 caches with k_scale / v_scale, GQA, varlen); those for
rotary.KVCache + CppRotaryEmbedding.forward_with_cache are in
kv_module_cases.py (run.py finds both here), the invalid mutations and
negative views in kv_mutations.py.

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

from .arg_draw import INT_DTYPES, angles, int_range, int_tensor, logical, position_problem, reference
from .common import DOCUMENTED, FLOATS, Finding, bits, check_close, judge_refusal, set_kind
from .kv_module_cases import run_kv_module  # noqa: F401 - a family of run.py
from .kv_mutations import mutate, negative_view
from .kv_oracle import FP8, KV_LAYOUTS, _Shape, cache_canon, logical_copy, quantize
from .op_inputs import Builder, canonical, logical_shape


class KvDraw:
    """One drawn call: shapes and tensors, then (in this order, so that a
    seed always draws the same case) positions, cache destinations and
    caches. ``reasons`` says why it must be refused, ``mention`` which
    argument the refusal must name, ``either`` that both outcomes pass."""

    def __init__(self, seed, focus):
        rng = self.rng = random.Random(seed)
        self.gen, self.focus = torch.Generator().manual_seed(seed), focus
        self.dtype = rng.choice(FLOATS)
        self.varlen = rng.random() < 0.25
        self.layout = "THD" if self.varlen else rng.choice(["BHSD", "BSHD", "SBHD"])
        self.B = 1 if self.varlen else rng.randrange(1, 4)
        Hk = self.Hk = rng.randrange(1, 3)
        self.Hq = Hk * rng.choice([1, 1, 2, 3]) if rng.random() < 0.8 else rng.randrange(1, 4)
        S = self.S = rng.choice([0, 1, 1, 2, 3, 5, 8])
        D = self.D = rng.choice([4, 8, 16])
        self.rd = rng.choice([D, D] + list(range(2, D, 2)))
        self.L = rng.randrange(S + 4, 40)
        self.interleaved = rng.random() < 0.5
        self.inv = rotary.inv_frequencies(self.rd)[0].numpy()
        self.table = rotary.freqs_table(self.rd, self.L)
        b = self.b = Builder(rng, self.gen)
        modes = ["dense", "permuted", "gapped", "offset"]
        self.q = b.tensor(logical_shape(self.layout, self.B, self.Hq, S, D), self.dtype, rng.choice(modes))
        self.k = b.tensor(logical_shape(self.layout, self.B, Hk, S, D), self.dtype, rng.choice(modes))
        self.v = b.tensor(logical_shape(self.layout, self.B, Hk, S, D), self.dtype, rng.choice(modes))
        self.kv_layout = rng.choice(KV_LAYOUTS)
        self.paged = self.kv_layout in ("NHD", "HND")
        self.fp8 = rng.random() < 0.3 and focus != "views"
        self.reasons, self.mention, self.either = [], None, focus == "views"
        self.kw = dict(kv_layout=self.kv_layout)
        self._sequences()

    def _sequences(self):
        """local: each token's index in its sequence; outer: its sequence
        (the row of a contiguous cache)."""
        rng, S = self.rng, self.S
        self.lens = None
        if self.varlen:
            cuts = sorted(rng.randrange(0, S + 1) for _ in range(rng.randrange(0, 3)))
            bounds = [0] + cuts + [S]
            self.lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
            self.kw["cu_seqlens"] = torch.tensor(bounds, dtype=rng.choice([torch.int32, torch.int64]))
        self.Bq = 1 if self.varlen else self.B
        self.local = np.zeros((self.Bq, S), dtype=object)
        self.outer = np.zeros((self.Bq, S), dtype=object)
        if self.varlen:
            at = 0
            for n_, ln in enumerate(self.lens):
                self.local[0, at : at + ln], self.outer[0, at : at + ln] = np.arange(ln), n_
                at += ln
        else:
            self.local[:] = np.arange(S)[None, :]
            self.outer[:] = np.arange(self.B)[:, None]

    def positions(self):
        """start_pos, offsets= or position_ids= (of a drawn dtype with the
        index_dtypes focus); self.pos: every token's position."""
        rng, kw, S, Bq = self.rng, self.kw, self.S, self.Bq
        self.use_inv = rng.random() < 0.2
        if self.use_inv:
            kw["inv_freq"] = torch.from_numpy(self.inv.copy())
        pform = rng.choice(["none", "none", "offsets", "ids"])
        self.start = rng.choice([0, 1, 3]) if pform != "ids" else 0
        pos_dtype = torch.int64
        if self.focus == "index_dtypes" and pform != "none":
            pos_dtype = rng.choice(INT_DTYPES)
        if pform == "offsets":
            shape = () if self.varlen or rng.random() < 0.4 else (self.B,)
            vals = [rng.randrange(0, 4) for _ in range(math.prod(shape))]
            if pos_dtype != torch.int64 and rng.random() < 0.5:
                lo, hi = int_range(pos_dtype)
                vals = [rng.choice([v for v in (hi, hi - 3, 255, 2**63, 2**64 - 1, lo, -1) if lo <= v <= hi])
                        for _ in vals]
            kw["offsets"] = int_tensor(vals, pos_dtype, shape)
            o = np.asarray(vals, dtype=object).reshape(shape)
            self.pos = self.local + self.start + (o if o.ndim == 0 else o[:, None])
        elif pform == "ids":
            vals = [rng.randrange(0, self.L) for _ in range(Bq * S)]
            if pos_dtype != torch.int64 and rng.random() < 0.5:
                lo, hi = int_range(pos_dtype)
                vals = [rng.choice([v for v in (hi, 255, 2**63, 2**64 - 1, lo, -1, 1) if lo <= v <= hi]) for _ in vals]
            kw["position_ids"] = int_tensor(vals, pos_dtype, (S,) if self.varlen else (self.B, S))
            self.pos = np.asarray(vals, dtype=object).reshape(Bq, S)
        else:
            self.pos = self.local + self.start
        why = position_problem(self.pos, self.use_inv, self.L)
        if why:
            self.reasons.append(why)
        if pform != "none" and not S:
            self.either = True  # no token reads the values: refusing a bad one by value is as right as ignoring it
        self.rope_ok = not why

    def destinations(self):
        """slot_mapping (paged) or cache_positions / the positions
        (contiguous); self.dest[b][s]: the (row, index) a token writes, or
        None; self.shape: the caches'."""
        rng, kw, S, Bq = self.rng, self.kw, self.S, self.Bq
        T = self.T = Bq * S
        self.dest_dtype = rng.choice([torch.int32, torch.int64])
        if self.focus == "index_dtypes":
            self.dest_dtype = rng.choice(INT_DTYPES)
        flat = rng.random() < 0.4 or self.varlen
        self.dest = [[None] * S for _ in range(Bq)]
        lo, hi = int_range(self.dest_dtype)
        if self.paged:
            block = rng.choice([1, 2, 4, 16, 17])
            nb = (T + 3 + block - 1) // block + 1
            pool = nb * block
            slots = torch.randperm(pool, generator=self.gen)[:T].tolist()
            slots = [(-1 if rng.random() < 0.2 else s_) for s_ in slots]
            if T > 1 and rng.random() < 0.1:
                slots[1] = slots[0]  # two tokens, one slot: either may land
            if self.focus == "index_dtypes" and rng.random() < 0.5:
                slots = [rng.choice([v for v in (-1, 255, 127, hi, lo, 2**63, 2**64 - 1, pool, 0) if lo <= v <= hi])
                         for _ in slots]
            slots = [s_ if lo <= s_ <= hi else 0 for s_ in slots]
            for t_, s_ in enumerate(slots):
                if 0 <= s_ < pool:
                    self.dest[t_ // S][t_ % S] = (s_ // block, s_ % block)
            if any(not (-1 <= s_ < pool) for s_ in slots):
                self.reasons.append("slot_mapping outside the cache")
                self.mention = "slot_mapping"
            kw["slot_mapping"] = int_tensor(slots, self.dest_dtype, (T,) if flat else (Bq, S))
            self.shape = (nb, block, self.Hk, self.D) if self.kv_layout == "NHD" else (nb, self.Hk, block, self.D)
        else:
            self._contiguous_rows(flat, lo, hi)
        taken = [x for row in self.dest for x in row if x is not None]
        if len(set(taken)) < len(taken):  # which token a shared row holds would depend on the schedule
            self.reasons.append("two tokens, one cache row")
            self.mention = None
        if self.dest_dtype not in (torch.int32, torch.int64) and (self.paged or "cache_positions" in kw):
            self.either = True  # documented int32 / int64: a refusal naming it, or the exact values used
            self.mention = "slot_mapping" if self.paged else "cache_positions"

    def _contiguous_rows(self, flat, lo, hi):
        rng, S, Bq, T = self.rng, self.S, self.Bq, self.T
        rows = len(self.lens) if self.varlen else self.B
        top = max([int(p) for p in self.pos.reshape(-1)] + [0]) if self.rope_ok else 0
        smax = rng.randrange(max(S, 1), max(S, 1) + 6)
        if rng.random() < 0.5 and not self.use_inv:
            smax = max(smax, top + 1)
        given = rng.random() < 0.4 or self.focus == "index_dtypes"
        if given:
            inner = np.zeros((Bq, 0), dtype=object)
            if S:
                inner = np.array([[int(x) for x in torch.randperm(max(smax, S), generator=self.gen)[:S].tolist()]
                                  for _ in range(Bq)], dtype=object).reshape(Bq, S)
            if self.focus == "index_dtypes" and rng.random() < 0.5:
                pool = [v for v in (255, 127, hi, lo, 2**63, 2**64 - 1, smax, 0, -1) if lo <= v <= hi]
                inner = np.array([rng.choice(pool) for _ in range(T)], dtype=object).reshape(Bq, S)
            inner = np.vectorize(lambda x: x if lo <= x <= hi else 0, otypes=[object])(inner) if T else inner
            self.kw["cache_positions"] = int_tensor(inner.reshape(-1) if flat else inner, self.dest_dtype,
                                                    (T,) if flat else (Bq, S))
        else:
            inner = self.pos
            self.dest_dtype = torch.int64
        bad = [x for x in inner.reshape(-1) if not (0 <= int(x) < smax)] if (given or self.rope_ok) else []
        if bad:
            self.reasons.append("a cache position outside max_seq_len")
            self.mention = "cache_positions" if given else None
        for bi in range(Bq):
            for si in range(S):
                if 0 <= int(inner[bi, si]) < smax:
                    self.dest[bi][si] = (int(self.outer[bi, si]), int(inner[bi, si]))
        self.shape = (rows, self.Hk, smax, self.D) if self.kv_layout == "BHSD" else (rows, smax, self.Hk, self.D)

    def caches(self):
        rng, b = self.rng, self.b
        self.cdtype = FP8 if self.fp8 else self.dtype
        self.kc = b.tensor(self.shape, self.cdtype, rng.choice(["dense", "dense", "permuted", "gapped"]))
        self.vc = b.tensor(self.shape, self.cdtype, rng.choice(["dense", "dense", "permuted", "gapped"]))
        if self.fp8:
            for name in ("k_scale", "v_scale"):
                if rng.random() < 0.7:
                    n = rng.choice([0, 1, self.Hk])
                    vals = [rng.uniform(0.05, 2.0) for _ in range(max(n, 1))]
                    self.kw[name] = torch.tensor(vals[0] if n == 0 else vals, dtype=torch.float32)
        self.kw["interleaved"] = self.interleaved
        self.kw["layout"] = self.layout


def run_kv(seed, focus=None):
    """focus: None (op:kv_cache), "views", "index_dtypes" or "scalars"."""
    kind = set_kind({"views": "views", "index_dtypes": "index_dtypes", "scalars": "scalars"}.get(focus, "op:kv_cache"))
    c = KvDraw(seed, focus)
    c.positions()
    c.destinations()
    c.caches()
    args = [c.q, c.k, c.v, c.kc, c.vc, c.table]
    mutation = mutate(c, args)
    which = negative_view(c, args) if focus == "views" else None

    q, k, v, kc, vc, freqs = args
    sign = -1.0 if (which == "freqs_conj") else 1.0
    scale_rope = -1.0 if which == "freqs_neg" else 1.0
    label = f"apply_rope_with_kv_cache_ ({c.kv_layout}, {c.layout}, {'fp8' if c.fp8 else str(c.dtype)[6:]}" + \
        (f", {mutation}" if mutation else "") + (f", view {which}" if which else "") + ")"

    before = dict(q=logical(q), k=logical(k))
    v_before = logical_copy(v)
    kc_before, vc_before = logical_copy(cache_canon(kc, c.kv_layout)), logical_copy(cache_canon(vc, c.kv_layout))
    saved = [bits(t) for t in c.b.buffers]
    extra = [t for t in c.kw.values() if isinstance(t, torch.Tensor)]
    saved_extra = [logical_copy(t) for t in extra]

    try:
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, freqs, c.start, **c.kw)
    except Finding:
        raise
    except DOCUMENTED as e:
        msg = judge_refusal(label, e, c.b.buffers, saved, c.reasons, c.either, c.mention)
        if mutation == "scalar" and type(e) not in (TypeError, ValueError):
            raise Finding(f"{label}: {msg} (a TypeError / ValueError expected)") from None
        return kind, f"refused: {msg}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{label}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if c.reasons:
        raise Finding(f"{label}: accepted bad input ({', '.join(c.reasons)})")

    # ---- accepted: q and k rotated, the caches hold exactly the token rows
    ang = angles(_Shape(c.rd), c.pos, sign=sign, inv=c.inv)
    for name, t in (("q", q), ("k", k)):
        expected = reference(canonical(before[name], c.layout), ang, 0, c.rd, c.interleaved, scale_rope)
        check_close(canonical(t, c.layout), expected, c.dtype, f"{label} {name}")
    if not torch.equal(bits(logical_copy(v)), bits(v_before)):
        raise Finding(f"{label}: v was written")
    for t, s in zip(extra, saved_extra):
        if not torch.equal(bits(logical_copy(t)), bits(s)):
            raise Finding(f"{label}: an index or scale tensor was written")
    rows = canonical(logical_copy(k), c.layout), canonical(v_before, c.layout)
    for cname, cache, cb, src, sname in (("k_cache", kc, kc_before, rows[0], "k_scale"),
                                         ("v_cache", vc, vc_before, rows[1], "v_scale")):
        _check_rows(c, label, cname, logical_copy(cache_canon(cache, c.kv_layout)), cb, src, c.kw.get(sname))
    return kind, "accepted"


def _check_rows(c: KvDraw, label, cname, after, before, src, scale):
    """Every destination holds one of the rows written there (quantized for
    fp8), every other byte is as it was."""
    want, cands = before.clone(), {}
    for bi in range(c.Bq):
        for si in range(c.S):
            if c.dest[bi][si] is not None:
                row = src[bi, :, si, :]
                cands.setdefault(c.dest[bi][si], []).append(quantize(row, scale, c.dtype) if c.fp8 else row)
    for (o, i), rows in cands.items():
        got = after[o, :, i, :]
        want[o, :, i, :] = next((r for r in rows if torch.equal(bits(r), bits(got))), rows[0])
    if not torch.equal(bits(after), bits(want)):
        diff = (bits(after) != bits(want)).nonzero()[:1].tolist()
        raise Finding(f"{label}: {cname} differs from the expected rows (first at {diff}; {len(cands)} rows written)")
