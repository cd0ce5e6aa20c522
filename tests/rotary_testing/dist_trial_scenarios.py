"""DTensor scenarios a second trial found wrong, run by test_distributed.py in
every rank: position tensors and scales of the wrong size (sliced to fit
instead of refused), N-D positions on replicated inputs, a size-1 dim
sharded like q, a Partial gradient in the backward pass, and messages that
named the wrong cause."""

import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import rotary
from rotary_testing.dist_scenarios import local_part
from rotary_testing.reference import rope_reference, rope_reference_nd

D = 16


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _refused_as_plain(call_plain, call_dist):
    """The DTensor call raises what the plain call raises, in its words."""
    with pytest.raises(ValueError) as plain:
        call_plain()
    with pytest.raises(ValueError, match=re.escape(str(plain.value).split("\n")[0])):
        call_dist()


def wrong_size_positions_are_refused(mesh):
    f = rotary.freqs_table(D, 64)
    q = _rand(2, 2, 6, D, seed=1)
    cases = [("offsets", torch.tensor([1, 2, 3])), ("position_ids", torch.arange(9).expand(2, 9)),
             ("position_ids", torch.arange(9)), ("position_ids", torch.arange(6).expand(5, 6))]
    for placement in (Replicate(), Shard(0), Shard(2)):
        dq = distribute_tensor(q, mesh, [placement])
        for name, pos in cases:
            _refused_as_plain(lambda: rotary.apply_rope(q, f, **{name: pos}),
                              lambda: rotary.apply_rope(dq, f, **{name: pos}))
    # A start_pos the plain call refuses, on every rank (not pushed past int64 by a shard's offset).
    dq = distribute_tensor(q, mesh, [Shard(2)])
    with pytest.raises(IndexError, match=r"apply_rope: start_pos must be < 2\^60"):
        rotary.apply_rope(dq, f, 2**63 - 2)
    # A per-head fp8 scale of the wrong length, with heads sharded.
    W = mesh.size()
    qh, kh = _rand(1, 2 * W, 3, D, seed=2), _rand(1, W, 3, D, seed=3)
    dqh, dkh = distribute_tensor(qh, mesh, [Shard(1)]), distribute_tensor(kh, mesh, [Shard(1)])
    for n in (2 * W + 1, 2 * W - 1):
        scale = torch.ones(n)
        with torch.no_grad():
            _refused_as_plain(lambda: rotary.apply_qk_norm_rope(qh, kh, f, q_fp8_scale=scale),
                              lambda: rotary.apply_qk_norm_rope(dqh, dkh, f, q_fp8_scale=scale))


def nd_positions_on_replicated_inputs(mesh):
    f = rotary.freqs_table(D, 64)
    axes = [0, 0, 0, 0, 1, 1, 2, 2]
    for B in (1, 2):
        q = _rand(B, 4, 6, D, seed=4 + B)
        for ids in (torch.randint(0, 64, (3, B, 6), generator=torch.Generator().manual_seed(7)),
                    torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(8))):
            out = rotary.apply_rope(distribute_tensor(q, mesh, [Replicate()]), f, position_ids=ids, pair_axes=axes)
            pos = (ids if ids.dim() == 3 else ids[:, None].expand(3, B, 6)).numpy()
            want = rope_reference_nd(q, pos, axes, D)
            torch.testing.assert_close(out.to_local().double(), want, rtol=1e-5, atol=1e-5)
    m = rotary.RotaryEmbedding(D, 64, mrope_section=[4, 2, 2])  # pairs on axes 0,0,0,0,1,1,2,2, as above
    q = _rand(1, 4, 6, D, seed=9)
    ids = torch.randint(0, 64, (3, 1, 6), generator=torch.Generator().manual_seed(10))
    out = m(distribute_tensor(q, mesh, [Replicate()]), position_ids=ids)
    torch.testing.assert_close(out.to_local().double(), rope_reference_nd(q, ids.numpy(), axes, D),
                               rtol=1e-5, atol=1e-5)


def a_size_one_dim_sharded_like_q(mesh):
    f = rotary.freqs_table(D, 64)
    for q, qpl, kw, ipl in (
            (_rand(2, 2, 1, D, seed=11), Shard(2), {"position_ids": torch.tensor([[9], [4]])}, Shard(1)),
            (_rand(1, 2, 5, D, seed=12), Shard(0), {"position_ids": torch.arange(5)[None] * 3}, Shard(0)),
            (_rand(1, 2, 5, D, seed=13), Shard(0), {"offsets": torch.tensor([7])}, Shard(0))):
        (name, pos), = kw.items()
        dq = distribute_tensor(q, mesh, [qpl])
        out = rotary.apply_rope(dq, f, **{name: distribute_tensor(pos, mesh, [ipl])})
        assert tuple(out.placements) == (qpl,)
        assert torch.equal(out.to_local(), local_part(rotary.apply_rope(q, f, **kw), mesh, [qpl]))
        want = rope_reference(q, positions=pos)  # [B, S] ids or [B] offsets
        torch.testing.assert_close(out.to_local().double(), local_part(want, mesh, [qpl]), rtol=1e-5, atol=1e-5)


def a_partial_gradient_rotates_term_by_term(mesh):
    f = rotary.freqs_table(D, 64)
    q = _rand(2, 2, 6, D, seed=14, dtype=torch.float64)
    w = _rand(D, 8, seed=15, dtype=torch.float64)
    # Replicate output into a column-sharded matmul: autograd hands the backward a Partial(sum) gradient.
    dq = distribute_tensor(q, mesh, [Replicate()]).requires_grad_()
    (rotary.apply_rope(dq, f, 2) @ distribute_tensor(w, mesh, [Shard(1)])).full_tensor().sum().backward()
    want = rope_reference(torch.ones(2, 2, 6, 8, dtype=torch.float64) @ w.T, 2, inverse=True)
    torch.testing.assert_close(dq.grad.full_tensor(), want, rtol=1e-6, atol=1e-6)  # a complex64 table
    # Forward: Partial in, Partial out; the sum is the rotation of the sum.
    rank = mesh.get_local_rank()
    part = DTensor.from_local(q * (rank + 1), mesh, [Partial()], run_check=False)
    out = rotary.apply_rope(part, f, 3)
    assert tuple(out.placements) == (Partial(),)
    total = sum(r + 1 for r in range(mesh.size()))
    torch.testing.assert_close(out.full_tensor(), rope_reference(q * total, 3), rtol=1e-6, atol=1e-6)  # a complex64 table
    # Not a sum or a mean, or a norm (not linear): refused by name.
    with pytest.raises(ValueError, match=r"Partial\(max\) on mesh dim 0; only Partial\(sum\) or Partial\(avg\)"):
        rotary.apply_rope(DTensor.from_local(q, mesh, [Partial("max")], run_check=False), f)
    qf, kf = q.float(), _rand(2, 1, 6, D, seed=16)
    with pytest.raises(ValueError, match=r"Partial\(sum\) on mesh dim 0; a norm needs whole values"):
        rotary.apply_qk_norm_rope(DTensor.from_local(qf, mesh, [Partial()], run_check=False),
                                  DTensor.from_local(kf, mesh, [Partial()], run_check=False), f)


def messages_name_the_cause(mesh):
    f = rotary.freqs_table(D, 64)
    q = _rand(1, 2, 8, D, seed=17)
    other = init_device_mesh("cpu", (mesh.size(),), mesh_dim_names=("cp",))
    with pytest.raises(ValueError, match=r"q is on mesh .* but k is on mesh .*cp=.*; use one mesh"):
        rotary.apply_rope_qk(distribute_tensor(q, mesh, [Shard(2)]), distribute_tensor(q, other, [Shard(2)]), f)
    # The fused norm + cache op with a replicated DTensor q_fp8_scale: the op's own refusal.
    W = mesh.size()
    qh, kh, vh = _rand(1, 2 * W, 1, D, seed=18), _rand(1, W, 1, D, seed=19), _rand(1, W, 1, D, seed=20)
    kc, vc = torch.zeros(1, W, 4, D), torch.zeros(1, W, 4, D)
    dist = [distribute_tensor(t, mesh, [Shard(1)]) for t in (qh, kh, vh, kc, vc)]
    scale = distribute_tensor(torch.ones(2 * W), mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"q_fp8_scale \(q returned as float8_e4m3fn\) needs the out-of-place"):
        rotary.apply_qk_norm_rope_with_kv_cache_(*dist, f, q_fp8_scale=scale)
    assert all(t.to_local().eq(0).all() for t in dist[3:])
    # A host-driven module names positions it cannot read, before gathering them.
    m = rotary.RotaryEmbedding(D, 32, scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 32})
    ids = DTensor.from_local(torch.arange(8)[None], mesh, [Partial()], run_check=False)
    with pytest.raises(ValueError, match=r"RotaryEmbedding on DTensor: position_ids has placement Partial\(sum\)"):
        m(distribute_tensor(q, mesh, [Replicate()]), position_ids=ids)


def scenarios():
    return [("wrong_size_positions_are_refused", wrong_size_positions_are_refused),
            ("nd_positions_on_replicated_inputs", nd_positions_on_replicated_inputs),
            ("a_size_one_dim_sharded_like_q", a_size_one_dim_sharded_like_q),
            ("a_partial_gradient_rotates_term_by_term", a_partial_gradient_rotates_term_by_term),
            ("messages_name_the_cause", messages_name_the_cause)]
