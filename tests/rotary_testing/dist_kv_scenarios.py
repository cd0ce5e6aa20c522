"""DTensor scenarios of the fused RoPE + KV-cache write (tensor parallel), run
by test_distributed.py in every rank. Each sharded call is compared bit for
bit with the unsharded call on the full tensors."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import rotary
from rotary_testing.dist_scenarios import dshard, local_part

OP = torch.ops.rotary.apply_rope_with_kv_cache_
FP8 = torch.float8_e4m3fn
D = 16


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _inputs(world, kv_layout, fp8):
    hq, hk, B, S = 2 * world, world, 2, 3
    q, k, v = _rand(B, hq, S, D, seed=1), _rand(B, hk, S, D, seed=2), _rand(B, hk, S, D, seed=3)
    if kv_layout == "BHSD":
        shape, kw = (B, hk, 8, D), dict(start_pos=2)
    else:  # NHD pages of 4, token (b, s) at slot 5 * b + 2 * s, one skipped
        shape = (6, 4, hk, D)
        kw = dict(start_pos=1, slot_mapping=torch.tensor([[0, 2, -1], [5, 7, 9]]))
    cache = (torch.full(shape, 0.5) if not fp8 else torch.full(shape, 0.5).to(FP8))
    if fp8:
        kw.update(k_scale=torch.linspace(0.5, 2.0, hk), v_scale=torch.tensor(0.75))
    return [q, k, v, cache.clone(), cache.clone()], kw


def _same(a, b, what):
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b), what


def _run(mesh, kv_layout, fp8, placements):
    f = rotary.freqs_table(D, 32)
    full, kw = _inputs(mesh.size(), kv_layout, fp8)
    want = [t.clone() for t in full]
    OP(*want, f, kv_layout=kv_layout, **kw)
    cache_heads = 1 if kv_layout == "BHSD" else 2
    cache_pl = [Shard(cache_heads) if isinstance(p, Shard) else p for p in placements]
    pls = [placements] * 3 + [cache_pl] * 2
    dts = [dshard(t, mesh, pl)[0] for t, pl in zip(full, pls)]
    OP(*dts, f, kv_layout=kv_layout, **kw)
    for name, dt, w, pl in zip(("q", "k", "v", "k_cache", "v_cache"), dts, want, pls):
        _same(dt.to_local(), local_part(w, mesh, pl), f"{name} ({kv_layout}, fp8={fp8}, {placements})")


def kv_tp(mesh):
    for kv_layout, fp8 in (("BHSD", False), ("NHD", False), ("NHD", True), ("BHSD", True)):
        _run(mesh, kv_layout, fp8, [Shard(1)])
    _run(mesh, "BHSD", False, [Replicate()])


def kv_refusals(mesh):
    f = rotary.freqs_table(D, 32)
    full, kw = _inputs(mesh.size(), "BHSD", False)
    before = [t.clone() for t in full]

    def placed(q_pl, cache_pl):
        return [dshard(t, mesh, pl)[0] for t, pl in zip(full, [q_pl] * 3 + [cache_pl] * 2)]

    with pytest.raises(ValueError, match=r"q has placement Shard\(dim=2\) on mesh dim 0; the fused KV-cache write is "
                                         r"computed locally for Replicate and Shard\(dim=1\)"):
        OP(*placed([Shard(2)], [Shard(2)]), f, **kw)
    with pytest.raises(ValueError, match=r"k_cache must have \(Shard\(dim=1\)\).*got \(Replicate\(\)\)"):
        OP(*placed([Shard(1)], [Replicate()]), f, **kw)
    dts = placed([Shard(1)], [Shard(1)])
    with pytest.raises(ValueError, match=r"v_cache is a plain tensor; pass q, k, v, k_cache and v_cache all as DTensors"):
        OP(*dts[:4], full[4], f, **kw)
    slots, _ = dshard(torch.zeros(2, 3, dtype=torch.long), mesh, [Shard(0)])  # [batch, seq], sharded
    with pytest.raises(ValueError, match=r"cache_positions has placements \(Shard\(dim=0\)\); tensor-parallel cache "
                                         r"writes need all of it"):
        OP(*dts, f, cache_positions=slots, **kw)
    for a, b in zip(full, before):  # the DTensors were cut from copies; the globals are untouched
        assert torch.equal(a, b)
    for dt, b, pl in zip(dts, before, [[Shard(1)]] * 5):
        assert torch.equal(dt.to_local(), local_part(b, mesh, pl)), "a refused call wrote"


def scenarios():
    return [("kv_tp", kv_tp), ("kv_refusals", kv_refusals)]
