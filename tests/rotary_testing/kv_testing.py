"""Cases for apply_rope_with_kv_cache_ (test_kv_cache_layouts.py, _refusals, _module and _devices, on every device):
inputs, the unfused sequence it must equal bit for bit
(apply_rope_qk_, then index writes in plain torch) and the float64
reference of what lands in the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import rotary
from rotary_testing.reference import positions_grid
from rotary_testing.rope_testing import from_bhsd, gen, layout_shape, random_strided, randn, ref_rope4, ref_varlen, to_bhsd

FP8 = torch.float8_e4m3fn


@dataclass
class KVCase:
    dtype: torch.dtype = torch.float32
    interleaved: bool = True
    kv_layout: str = "BHSD"
    block: int = 16  # paged block size
    B: int = 2
    S: int = 5
    Hq: int = 4
    Hk: int = 2
    D: int = 16
    r: Optional[int] = None  # rotary_dim (None: D)
    start: int = 3
    pos: str = "none"  # none | offsets | ids | cache_positions | seq_offsets (packed: [num_seqs])
    lens: Optional[list] = None  # packed varlen sequence lengths
    layout: str = "BHSD"  # q/k/v layout
    strided: bool = False
    fp8: Optional[str] = None  # None | "tensor" | "head"
    skip: bool = False  # some slots -1
    table: int = 32
    smax: int = 40  # contiguous caches: max_seq_len
    inv_freq: bool = False
    seed: int = 0
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    @property
    def paged(self):
        return self.kv_layout in ("NHD", "HND")


def _heads(c: KVCase, H, seed):
    if c.lens is not None:
        shape = (sum(c.lens), H, c.D)
    else:
        shape = layout_shape(c.layout, c.B, H, c.S, c.D)
    x = random_strided(shape, c.dtype, seed) if c.strided else randn(shape, c.dtype, seed)
    return x.to(c.device)


def _cache_shape(c: KVCase, slots):
    if c.paged:
        nb = (slots + c.block - 1) // c.block + 1
        return (nb, c.block, c.Hk, c.D) if c.kv_layout == "NHD" else (nb, c.Hk, c.block, c.D)
    rows = len(c.lens) if c.lens is not None else c.B
    smax = c.smax
    return (rows, c.Hk, smax, c.D) if c.kv_layout == "BHSD" else (rows, smax, c.Hk, c.D)


def cache_view(t, kv_layout):
    """[outer, heads, inner, D] view of a cache (the op's convention)."""
    return t.transpose(1, 2) if kv_layout in ("BSHD", "NHD") else t


def build(c: KVCase):
    """(args, kwargs, rope positions [tokens], (outer, inner) per token or
    None when skipped) for one call; the tensors are fresh each time."""
    B, S = (1, sum(c.lens)) if c.lens is not None else (c.B, c.S)
    tokens = B * S
    g = gen(c.seed + 17)
    q, k, v = _heads(c, c.Hq, c.seed), _heads(c, c.Hk, c.seed + 1), _heads(c, c.Hk, c.seed + 2)
    r = c.r or c.D
    f = rotary.freqs_table(r, c.table).to(c.device)
    kw = dict(kv_layout=c.kv_layout)
    # rotary position of every token, in the reference's convention
    if c.lens is not None:
        cu = torch.tensor([0] + torch.tensor(c.lens).cumsum(0).tolist(), dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(len(c.lens)), torch.tensor(c.lens))
        local = torch.arange(tokens) - cu[seq_of]
        kw["cu_seqlens"] = cu.to(c.device)
        if c.pos == "ids":
            ids = torch.randperm(c.table, generator=g)[:tokens]  # distinct: each token its own cache row
            rope_pos, kw["position_ids"] = ids.clone(), ids.to(c.device)
            kw["start_pos"] = 0
        elif c.pos == "seq_offsets":  # one start per sequence: its cache rows begin there
            offs = torch.randint(0, c.table - c.start - max(c.lens), (len(c.lens),), generator=g)
            rope_pos, kw["offsets"], kw["start_pos"] = c.start + offs[seq_of] + local, offs.to(c.device), c.start
        else:
            off = 2 if c.pos == "offsets" else 0
            rope_pos = c.start + off + local
            kw["start_pos"] = c.start
            if c.pos == "offsets":
                kw["offsets"] = torch.tensor(off, device=c.device)
        outer = seq_of
    else:
        positions = None
        if c.pos == "offsets":
            positions = torch.randint(0, c.table - c.S - c.start, (c.B,), generator=g)
            kw["offsets"] = positions.to(c.device)
        elif c.pos == "ids":
            positions = torch.stack([torch.randperm(c.table, generator=g)[: c.S] for _ in range(c.B)])
            kw["position_ids"] = positions.to(c.device)
        kw["start_pos"] = 0 if c.pos == "ids" else c.start
        rope_pos = torch.from_numpy(positions_grid(c.B, c.S, kw["start_pos"], positions)).reshape(-1)
        outer = torch.arange(c.B).repeat_interleave(c.S)
    if c.inv_freq:
        kw["inv_freq"] = torch.from_numpy(__import__("rotary_testing.reference", fromlist=["_"]).inv_freq(r)).to(c.device)
    if c.layout != "BHSD" and c.lens is None:
        kw["layout"] = c.layout
    if c.paged:
        pool = tokens + 3
        slots = torch.randperm(_cache_shape(c, pool)[0] * c.block, generator=g)[:tokens]
        if c.skip:
            slots[::3] = -1
        kw["slot_mapping"] = slots.reshape(B, S).to(c.device) if c.lens is None and c.B > 1 else slots.to(c.device)
        dest = [None if s < 0 else (int(s) // c.block, int(s) % c.block) for s in slots]
        shape = _cache_shape(c, pool)
    else:
        inner = rope_pos.clone()
        if c.pos == "cache_positions":
            inner = torch.randperm(c.smax, generator=g)[:tokens] if c.lens is not None else torch.stack(
                [torch.randperm(c.smax, generator=g)[:S] for _ in range(B)]).reshape(-1)
            kw["cache_positions"] = inner.reshape(B, S).to(c.device) if c.lens is None else inner.to(c.device)
        dest = [(int(o), int(i)) for o, i in zip(outer, inner)]
        shape = _cache_shape(c, 0)
    cdtype = FP8 if c.fp8 else c.dtype
    kc = (randn(shape, torch.float32, c.seed + 3) * 4).to(cdtype).to(c.device)
    vc = (randn(shape, torch.float32, c.seed + 4) * 4).to(cdtype).to(c.device)
    if c.fp8:
        n = 1 if c.fp8 == "tensor" else c.Hk
        sc = lambda s: (torch.rand(n, generator=gen(c.seed + s)) * 0.5 + 0.05).reshape(() if n == 1 else (n,))
        kw["k_scale"], kw["v_scale"] = sc(5).to(c.device), sc(6).to(c.device)
    kw["interleaved"] = c.interleaved
    kw.update(c.extra)
    return (q, k, v, kc, vc, f), kw, rope_pos, dest


def quantize(x, scale, heads_dim):
    """The reference expression, in x's dtype promoted with float32 (see
    docs/kv_cache.md: 16-bit inputs are divided in float32, once)."""
    work = torch.promote_types(x.dtype, torch.float32)
    s = scale.to(work)
    if s.dim() == 1 and s.numel() > 1:
        s = s.reshape([-1 if d == heads_dim else 1 for d in range(x.dim())])
    return (x.to(work) / s).clamp(-448, 448).to(FP8)


def canonical_tokens(x, c: KVCase):
    """[tokens, H, D] view of q/k/v in token order (b * S + s)."""
    if c.lens is not None:
        return x
    xb = to_bhsd(x, c.layout)
    return xb.transpose(1, 2).reshape(-1, xb.shape[1], c.D)


def unfused(args, kw, dest, c: KVCase):
    """apply_rope_qk_, then one index write per cache: the sequence the fused
    op must match bit for bit."""
    q, k, v, kc, vc, f = args
    rope_kw = {n: kw[n] for n in ("start_pos", "interleaved", "offsets", "position_ids", "cu_seqlens", "inv_freq", "layout") if n in kw}
    rotary.apply_rope_qk_(q, k, f, **rope_kw)
    keep = [i for i, d in enumerate(dest) if d is not None]
    if not keep:
        return
    idx = torch.tensor(keep, device=q.device)
    o = torch.tensor([dest[i][0] for i in keep], device=q.device)
    n = torch.tensor([dest[i][1] for i in keep], device=q.device)
    for src, cache, sname in ((k, kc, "k_scale"), (v, vc, "v_scale")):
        rows = canonical_tokens(src, c).index_select(0, idx)
        if c.fp8:
            rows = quantize(rows, kw[sname], 1)
        cache_view(cache, c.kv_layout)[o, :, n, :] = rows


def expected_k_rows(k_in, rope_pos, c: KVCase):
    """float64 reference of the rotated k, [tokens, Hk, D]."""
    r = c.r
    if c.lens is not None:
        cu = torch.tensor([0] + torch.tensor(c.lens).cumsum(0).tolist())
        if c.pos in ("ids", "seq_offsets"):  # rope_pos: each token's absolute position
            ref = ref_varlen(k_in.cpu(), cu, r, 0, c.interleaved, rope_pos)
        else:
            ref = ref_varlen(k_in.cpu(), cu, r, c.start + (2 if c.pos == "offsets" else 0), c.interleaved)
        return ref
    grid = rope_pos.reshape(c.B, c.S)
    ref = ref_rope4(k_in.cpu(), r, 0, c.interleaved, grid, layout=c.layout)
    return canonical_tokens(ref, c)
