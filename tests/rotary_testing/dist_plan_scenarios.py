"""Scenarios of the DTensor rules' fast path (_dtensor_plans.py), run by
test_distributed.py in every rank: a remembered call gives what the rule
gives, bit for bit, refuses a bad start_pos alike and writes nothing; calls
whose ranks rotate different tokens, or whose options are cut per rank, are
never remembered; a changed placement or option is never served by a plan
made for another."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

import rotary
from rotary import _dtensor_plans as plans
from rotary_testing.dist_scenarios import D, L, OPS, _rand, dshard, local_part, reference

FP8 = torch.float8_e4m3fn


def _plan_count(op):
    return sum(1 for k in plans._PLANS if k[0] == op)


def tp_decode_hits(mesh):
    """Decode steps: one rule run, then plans; each step as the rule gives it."""
    W = mesh.size()
    f = rotary.rope_freqs(D, L)
    q, k = _rand(2, 2 * W, 1, D, seed=11), _rand(2, W, 1, D, seed=12)
    dq, dk = dshard(q, mesh, [Shard(1)])[0], dshard(k, mesh, [Shard(1)])[0]
    op = OPS.apply_rope_qk.default
    plans._PLANS.clear()
    for step in range(4):
        hit = _plan_count(op) == 1
        assert hit == (step > 0), f"step {step}: plans {_plan_count(op)}"
        oq, ok = OPS.apply_rope_qk(dq, dk, f, 5 + step, False)
        plans._PLANS.clear()
        rq, rk = OPS.apply_rope_qk(dq, dk, f, 5 + step, False)  # the rule itself
        for o, r, t in ((oq, rq, q), (ok, rk, k)):
            assert isinstance(o, DTensor) and o._spec == r._spec, f"step {step}: spec {o._spec} vs {r._spec}"
            assert torch.equal(o.to_local(), r.to_local()), f"step {step}: plan differs from the rule"
            want = local_part(reference(t, "BHSD", 5 + step, False, None), mesh, [Shard(1)])
            torch.testing.assert_close(o.to_local().double(), want, atol=1e-5, rtol=0)
    # Past the table: the plan's local call refuses as the rule's global check does, and writes nothing.
    msgs = []
    for remembered in (True, False):
        plans._PLANS.clear()
        OPS.apply_rope_qk_(dq, dk, f, 0, False)
        if not remembered:
            plans._PLANS.clear()
        before = [dq.to_local().clone(), dk.to_local().clone()]
        with pytest.raises(IndexError) as e:
            OPS.apply_rope_qk_(dq, dk, f, L, False)
        msgs.append(str(e.value).split("\n")[0])
        assert torch.equal(dq.to_local(), before[0]) and torch.equal(dk.to_local(), before[1]), "refused call wrote"
    assert "start_pos" in msgs[0] and msgs[0] == msgs[1], msgs


def never_remembered(mesh):
    """Sequence / batch shards (ranks rotate different tokens, the whole
    call's values are checked each call) and per-head scales cut per rank."""
    W = mesh.size()
    f = rotary.rope_freqs(D, L)
    plans._PLANS.clear()
    q, k = _rand(1, 2, 2 * W, D, seed=13), _rand(1, 1, 2 * W, D, seed=14)
    for _ in range(2):
        OPS.apply_rope_qk(dshard(q, mesh, [Shard(2)])[0], dshard(k, mesh, [Shard(2)])[0], f, 3, False)
    assert not plans._PLANS, "a sequence-sharded call was remembered"
    # Only the last rank's tokens run past the table: every rank refuses, on every call.
    for _ in range(2):
        with pytest.raises(IndexError, match="start_pos"):
            OPS.apply_rope_qk(dshard(q, mesh, [Shard(2)])[0], dshard(k, mesh, [Shard(2)])[0], f, L - 2 * W + 1,
                              False)
    ids = torch.randint(0, L, (2 * W, 3), generator=torch.Generator().manual_seed(15))
    qb, kb = _rand(2 * W, 2, 3, D, seed=16), _rand(2 * W, 1, 3, D, seed=17)
    for _ in range(2):
        OPS.apply_rope_qk(dshard(qb, mesh, [Shard(0)])[0], dshard(kb, mesh, [Shard(0)])[0], f, 0, False,
                          position_ids=ids)
    assert not plans._PLANS, "a batch-sharded call with positions was remembered"
    # The fused cache write with a per-head scale: each rank's scale is cut.
    kv = OPS.apply_rope_with_kv_cache_
    hq, hk = 2 * W, W
    data = [_rand(1, hq, 1, D, seed=18), _rand(1, hk, 1, D, seed=19), _rand(1, hk, 1, D, seed=20)]
    caches = [torch.zeros(1, hk, 4, D).to(FP8) for _ in range(2)]
    scale = torch.linspace(0.5, 2.0, hk)
    dts = [dshard(t, mesh, [Shard(1)])[0] for t in data + caches]
    for pos in range(2):
        kv(*dts, rotary.freqs_table(D, L), start_pos=pos, k_scale=scale, v_scale=torch.tensor(0.5))
    assert not plans._PLANS, "a per-head scale cut per rank was remembered"
    # The same write with one scale for all heads: remembered, and the plan writes what the rule writes.
    kw = dict(k_scale=torch.tensor(0.75), v_scale=torch.tensor(0.5))
    fresh = data + [torch.zeros(1, hk, 4, D).to(FP8)] * 2

    def placed():
        return [dshard(t, mesh, [Shard(1)])[0] for t in fresh]

    got = []
    for remembered in (False, True):
        plans._PLANS.clear()
        if remembered:
            kv(*placed(), rotary.freqs_table(D, L), start_pos=0, **kw)
            assert _plan_count(kv.default) == 1
        outs = placed()
        kv(*outs, rotary.freqs_table(D, L), start_pos=2, **kw)
        got.append([o.to_local().view(torch.uint8) if o.dtype == FP8 else o.to_local() for o in outs])
    for a, b in zip(*got):
        assert torch.equal(a, b), "the plan's cache write differs from the rule's"


def changed_call_runs_the_rule(mesh):
    """A plan serves only the call it was made for: q and k placed apart,
    a sharded table, or another option run the rule (and its refusals)."""
    W = mesh.size()
    f = rotary.rope_freqs(D, L)
    q, k = _rand(2, 2 * W, 3, D, seed=21), _rand(2, W, 3, D, seed=22)
    dq, dk = dshard(q, mesh, [Shard(1)])[0], dshard(k, mesh, [Shard(1)])[0]
    plans._PLANS.clear()
    OPS.apply_rope_qk(dq, dk, f, 1, False)
    OPS.apply_rope_qk(dq, dk, f, 1, False)
    kr = DTensor.from_local(k, mesh, [Replicate()], run_check=False)
    oq, ok = OPS.apply_rope_qk(dq, kr, f, 1, False)  # placed apart: each rotated alone
    assert tuple(ok.placements) == (Replicate(),) and torch.equal(
        ok.to_local(), OPS.apply_rope(k, f, 1, False)), "k placed apart"
    f_sharded = dshard(f, mesh, [Shard(0)])[0]
    with pytest.raises(ValueError, match=r"freqs has placements \(Shard\(dim=0\)\)"):
        OPS.apply_rope_qk(dq, dk, f_sharded, 1, False)
    with pytest.raises(ValueError, match=r"norm='heads' normalizes over all heads"):
        OPS.apply_qk_norm_rope(dq, dk, f, 1, False, norm="heads")
    OPS.apply_qk_norm_rope(dq, dk, f, 1, False)  # per head: local, remembered
    with pytest.raises(ValueError, match=r"norm='heads' normalizes over all heads"):
        OPS.apply_qk_norm_rope(dq, dk, f, 1, False, norm="heads")


def scenarios():
    return [("plans_tp_decode_hits", tp_decode_hits), ("plans_never_remembered", never_remembered),
            ("plans_changed_call_runs_the_rule", changed_call_runs_the_rule)]
