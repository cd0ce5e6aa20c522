"""DTensor scenarios of the prologue ops (apply_qk_norm_rope and its KV-cache
form), run by test_distributed.py in every rank: tensor parallel with a
per-head norm, context parallel with a norm over all heads, each sharded
call (and its backward, weight gradients included) equal bit for bit to the
unsharded call; the norm over all heads refused on head shards."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import rotary
from rotary_testing.dist_scenarios import dshard, local_part

OPS = torch.ops.rotary
D, L = 16, 64


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(mesh, placements, norm, weights_as_dtensor, train, tag):
    W = mesh.size()
    q, k = _rand(2, 2 * W, 2 * W, D, seed=1), _rand(2, W, 2 * W, D, seed=2)  # [B, H, S, D]
    n = (lambda h: D) if norm == "head" else (lambda h: h * D)
    qw, kw = 1 + 0.3 * _rand(n(2 * W), seed=3), 1 + 0.3 * _rand(n(W), seed=4)
    f = rotary.freqs_table(D, L)
    grads = [_rand(*t.shape, seed=9 + i) for i, t in enumerate((q, k))]
    kwargs = dict(norm=norm, eps=1e-5, weight_offset=0.5)

    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    full = OPS.apply_qk_norm_rope(leaves[0], leaves[1], f, 3, q_weight=leaves[2], k_weight=leaves[3], **kwargs)
    sum((o * g).sum() for o, g in zip(full, grads)).backward()

    shards = [dshard(t, mesh, placements, requires_grad=train) for t in (q, k)]
    w_leaves = [w.clone().requires_grad_(train) for w in (qw, kw)]
    if weights_as_dtensor:
        ws = [DTensor.from_local(w, mesh, [Replicate()], run_check=False) for w in w_leaves]
    else:
        ws = w_leaves
    with CommDebugMode() as comm, torch.set_grad_enabled(train):
        out = OPS.apply_qk_norm_rope(shards[0][0], shards[1][0], f, 3, q_weight=ws[0], k_weight=ws[1], **kwargs)
    assert comm.get_total_counts() == 0, f"{tag}: collectives inside the op: {comm.get_comm_counts()}"
    for i, o in enumerate(out):
        assert isinstance(o, DTensor) and tuple(o.placements) == tuple(placements), f"{tag} {i}: {o}"
        assert torch.equal(o.to_local(), local_part(full[i].detach(), mesh, placements)), f"{tag} {i}: output"
    if not train:
        return
    # The backward runs on DTensors: the weight gradients are sums over every
    # rank's tokens or heads (a Partial, reduced into the replicated weight).
    sum((o.to_local() * local_part(g, mesh, placements)).sum() for o, g in zip(out, grads)).backward()
    for i, (_, leaf) in enumerate(shards):
        torch.testing.assert_close(leaf.grad, local_part(leaves[i].grad, mesh, placements), rtol=1e-5, atol=1e-6,
                                   msg=f"{tag} {i}: grad")
    for w, full_w in zip(w_leaves, leaves[2:]):
        torch.testing.assert_close(w.grad, full_w.grad, rtol=1e-5, atol=1e-6, msg=f"{tag}: weight grad")


def norm_tp_head(mesh):
    _case(mesh, [Shard(1)], "head", False, False, "TP heads, norm head, inference")
    _case(mesh, [Shard(1)], "head", True, True, "TP heads, norm head, training with replicated DTensor weights")


def norm_tp_fp8_q(mesh):
    """A per-head fp8 scale is cut to each rank's heads."""
    W = mesh.size()
    q, k = _rand(1, 2 * W, 3, D, seed=11), _rand(1, W, 3, D, seed=12)
    f, scale = rotary.freqs_table(D, L), torch.linspace(0.004, 0.05, 2 * W)
    full_q, full_k = OPS.apply_qk_norm_rope(q, k, f, 1, q_fp8_scale=scale)
    dq, _ = dshard(q, mesh, [Shard(1)])
    dk, _ = dshard(k, mesh, [Shard(1)])
    oq, ok = OPS.apply_qk_norm_rope(dq, dk, f, 1, q_fp8_scale=scale)
    want = local_part(full_q, mesh, [Shard(1)])
    assert oq.dtype == torch.float8_e4m3fn and torch.equal(oq.to_local().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(ok.to_local(), local_part(full_k, mesh, [Shard(1)]))


def norm_cp_heads(mesh):
    _case(mesh, [Shard(2)], "heads", False, False, "CP seq, norm heads, inference")
    _case(mesh, [Shard(2)], "heads", True, True, "CP seq, norm heads, training")


def norm_refusals(mesh):
    W = mesh.size()
    q, k = _rand(1, 2 * W, 3, D, seed=5), _rand(1, W, 3, D, seed=6)
    f = rotary.freqs_table(D, L)
    dq, _ = dshard(q, mesh, [Shard(1)])
    dk, _ = dshard(k, mesh, [Shard(1)])
    before = dq.to_local().clone(), dk.to_local().clone()
    for op in (OPS.apply_qk_norm_rope, OPS.apply_qk_norm_rope_):
        with pytest.raises(ValueError, match=r"norm='heads' normalizes over all heads of a token, but q and k are "
                                             r"Shard\(1\) \(heads\)"):
            op(dq, dk, f, norm="heads")
    assert torch.equal(dq.to_local(), before[0]) and torch.equal(dk.to_local(), before[1])
    # Training needs the weights as DTensors (the backward runs on DTensors).
    tq, _ = dshard(q, mesh, [Shard(1)], requires_grad=True)
    tk, _ = dshard(k, mesh, [Shard(1)], requires_grad=True)
    with pytest.raises(ValueError, match=r"q and k require grad: pass q_weight as a replicated DTensor"):
        OPS.apply_qk_norm_rope(tq, tk, f, q_weight=torch.ones(D))
    # The KV-cache form: the same refusal, nothing written.
    v, _ = dshard(_rand(1, W, 3, D, seed=7), mesh, [Shard(1)])
    caches = [dshard(torch.zeros(1, W, 8, D), mesh, [Shard(1)])[0] for _ in range(2)]
    with pytest.raises(ValueError, match=r"norm='heads' normalizes over all heads"):
        OPS.apply_qk_norm_rope_with_kv_cache_(dq, dk, v, *caches, f, norm="heads")
    assert all(torch.equal(c.to_local(), torch.zeros_like(c.to_local())) for c in caches)
    # Per-head norm with the cache write under TP: each rank's heads, as one process writes them.
    full_q, full_k = q.clone(), k.clone()
    full_c = [torch.zeros(1, W, 8, D) for _ in range(2)]
    vv = _rand(1, W, 3, D, seed=7)
    OPS.apply_qk_norm_rope_with_kv_cache_(full_q, full_k, vv, *full_c, f, 2, k_weight=torch.full((D,), 1.5))
    OPS.apply_qk_norm_rope_with_kv_cache_(dq, dk, v, *caches, f, 2, k_weight=torch.full((D,), 1.5))
    assert torch.equal(dk.to_local(), local_part(full_k, mesh, [Shard(1)]))
    for c, fc in zip(caches, full_c):
        assert torch.equal(c.to_local(), local_part(fc, mesh, [Shard(1)]))


def scenarios():
    return [("norm_tp_head", norm_tp_head), ("norm_tp_fp8_q", norm_tp_fp8_q), ("norm_cp_heads", norm_cp_heads),
            ("norm_refusals", norm_refusals)]
