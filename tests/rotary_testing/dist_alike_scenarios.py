"""Scenarios of refusals that every rank must give alike (run by
test_distributed.py in every rank): a bad value that lies on one rank's
heads, rows or tokens is refused by every rank in the plain call's words,
and no rank writes. A rank that served the call while another refused
would leave the ranks out of step (and, in place, half written)."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import rotary
from rotary_testing.dist_scenarios import D, OPS, _rand

FP8 = torch.float8_e4m3fn
L = 32


def placed(t, mesh, pl):
    """The rank's shard of t with the whole call's shape in its spec (uneven and empty shards too)."""
    shape, off = compute_local_shape_and_global_offset(t.shape, mesh, pl)
    local = t
    for d, (o, n) in enumerate(zip(off, shape)):
        local = local.narrow(d, o, n)
    return DTensor.from_local(local.clone(), mesh, pl, run_check=False, shape=t.shape, stride=t.stride())


def _bits(t):
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.view(torch.uint8).clone() if t.dtype == FP8 else t.clone()


def refused_alike(call, plain_call, what, *written):
    """plain_call's error and message, raised by call on this rank too, with
    every tensor in written unchanged."""
    with pytest.raises(Exception) as want:
        plain_call()
    before = [_bits(t) for t in written]
    with pytest.raises(type(want.value)) as got:
        call()
    assert str(got.value).split("\n")[0] == str(want.value).split("\n")[0], f"{what}: {got.value} vs {want.value}"
    for i, (t, b) in enumerate(zip(written, before)):
        assert torch.equal(_bits(t), b), f"{what}: tensor {i} written by a refused call"


def bad_scale_on_one_ranks_heads(mesh):
    """A per-head scale whose bad entry is one rank's head: checked whole
    before each rank cuts its heads (the message names the global head)."""
    W = mesh.size()
    f = rotary.freqs_table(D, L)
    hq, hk = 2 * W, W
    q, k, v = _rand(1, hq, 2, D, seed=41), _rand(1, hk, 2, D, seed=42), _rand(1, hk, 2, D, seed=43)
    cache = torch.zeros(1, hk, 8, D).to(FP8)
    bad = torch.full((hk,), 0.5)
    bad[-1] = 0.0  # the last rank's head
    for name in ("k_scale", "v_scale"):
        scales = {**dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.5)), name: bad}
        full = [q.clone(), k.clone(), v.clone(), cache.clone(), cache.clone()]
        ts = [placed(t, mesh, [Shard(1)]) for t in (q, k, v, cache, cache)]
        refused_alike(lambda: OPS.apply_rope_with_kv_cache_(*ts, f, 0, False, **scales),
                      lambda: OPS.apply_rope_with_kv_cache_(*full, f, 0, False, **scales),
                      f"{name} bad at head {hk - 1}", *ts)
    fp8 = torch.ones(hq)
    fp8[-1] = float("nan")
    refused_alike(lambda: OPS.apply_qk_norm_rope(placed(q, mesh, [Shard(1)]), placed(k, mesh, [Shard(1)]), f, 0,
                                                 q_fp8_scale=fp8),
                  lambda: OPS.apply_qk_norm_rope(q, k, f, 0, q_fp8_scale=fp8), f"q_fp8_scale bad at head {hq - 1}")


def start_pos_with_an_empty_batch_rank(mesh):
    """Shard(batch) of fewer rows than ranks, no position tensors: the rank
    with no rows refuses a start_pos past the table too."""
    f = rotary.freqs_table(D, L)
    q, k = _rand(1, 2, 3, D, seed=44), _rand(1, 1, 3, D, seed=45)
    for op in ("apply_rope_qk", "apply_rope_qk_"):
        dq, dk = placed(q, mesh, [Shard(0)]), placed(k, mesh, [Shard(0)])
        refused_alike(lambda: getattr(OPS, op)(dq, dk, f, L - 2, False),
                      lambda: getattr(OPS, op)(q.clone(), k.clone(), f, L - 2, False), f"{op} Shard(batch)", dq, dk)
    # In range: every rank serves it, the rank with no rows an empty shard.
    oq, _ = OPS.apply_rope_qk(placed(q, mesh, [Shard(0)]), placed(k, mesh, [Shard(0)]), f, 1, False)
    assert torch.equal(oq.full_tensor(), OPS.apply_rope_qk(q, k, f, 1, False)[0])


def plain_weights_that_require_grad(mesh):
    """Plain norm weights that require grad with DTensor q and k (which do
    not): the backward would meet a plain weight among DTensors; refused
    by name up front."""
    W = mesh.size()
    f = rotary.freqs_table(D, L)
    dq = placed(_rand(1, 2 * W, 2, D, seed=46), mesh, [Shard(1)])
    dk = placed(_rand(1, W, 2, D, seed=47), mesh, [Shard(1)])
    w = torch.ones(D, requires_grad=True)
    with pytest.raises(ValueError, match=r"q_weight requires grad: pass q_weight as a replicated DTensor .* or detach"):
        OPS.apply_qk_norm_rope(dq, dk, f, 0, q_weight=w, k_weight=torch.ones(D))
    with pytest.raises(ValueError, match=r"q and k require grad: pass k_weight as a replicated DTensor"):
        OPS.apply_qk_norm_rope(dq.detach().requires_grad_(), dk.detach().requires_grad_(), f, 0, k_weight=torch.ones(D))
    # Detached, it is served; replicated DTensor weights take gradients.
    OPS.apply_qk_norm_rope(dq, dk, f, 0, q_weight=w.detach(), k_weight=torch.ones(D))
    wd = DTensor.from_local(torch.ones(D), mesh, [Replicate()], run_check=False).requires_grad_()
    oq, ok = OPS.apply_qk_norm_rope(dq, dk, f, 0, q_weight=wd, k_weight=torch.ones(D).detach())
    oq.to_local().sum().backward()
    assert wd.grad is not None


def q_and_k_placed_apart_refuse_as_the_pair(mesh):
    """apply_rope_qk with q and k placed differently rotates each alone:
    a bad start_pos or position is still refused in apply_rope_qk's words."""
    W = mesh.size()
    f = rotary.freqs_table(D, L)
    q, k = _rand(1, 2 * W, 3, D, seed=48), _rand(1, W, 3, D, seed=49)
    dq = placed(q, mesh, [Shard(1)])
    dk = DTensor.from_local(k.clone(), mesh, [Replicate()], run_check=False)
    refused_alike(lambda: OPS.apply_rope_qk(dq, dk, f, L - 1, False), lambda: OPS.apply_rope_qk(q, k, f, L - 1, False),
                  "start_pos past the table")
    ids = torch.tensor([0, 1, L])
    refused_alike(lambda: OPS.apply_rope_qk(dq, dk, f, 0, False, position_ids=ids),
                  lambda: OPS.apply_rope_qk(q, k, f, 0, False, position_ids=ids), "a position id past the table")


def one_output_used(mesh):
    """Only q's output feeds the loss: k's output gradient is undefined, not a
    plain tensor of zeros beside DTensors (which the rule refused)."""
    W = mesh.size()
    f = rotary.freqs_table(D, L)
    q, k = _rand(1, 2 * W, 3, D, seed=50), _rand(1, W, 3, D, seed=51)
    for op in (OPS.apply_rope_qk, OPS.apply_qk_norm_rope):
        dq, dk = placed(q, mesh, [Shard(1)]).requires_grad_(), placed(k, mesh, [Shard(1)]).requires_grad_()
        pq, pk = q.clone().requires_grad_(), k.clone().requires_grad_()
        op(dq, dk, f, 2, False)[0].sum().backward()
        op(pq, pk, f, 2, False)[0].sum().backward()
        assert dk.grad is None and pk.grad is None, "k's output fed nothing"
        assert torch.equal(dq.grad.full_tensor(), pq.grad), f"{op}: q's gradient"


def scenarios():
    return [("alike_bad_scale_on_one_ranks_heads", bad_scale_on_one_ranks_heads),
            ("alike_start_pos_with_an_empty_batch_rank", start_pos_with_an_empty_batch_rank),
            ("alike_plain_weights_that_require_grad", plain_weights_that_require_grad),
            ("alike_q_and_k_placed_apart_refuse_as_the_pair", q_and_k_placed_apart_refuse_as_the_pair),
            ("alike_one_output_used", one_output_used)]
