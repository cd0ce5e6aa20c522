"""Scenarios a trial found silently wrong, run by test_distributed.py in
every rank: a module's host-driven rule (dynamic) sizing its table by the
positions of every rank, not of its own shard; position tensors whose
placement has no local reading (Partial, _StridedShard) refused alike on
every rank; and DDP's broadcast_buffers writing rank 0's tables into a rank
in another state."""

import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import rotary
from rotary_testing.dist_scenarios import _rand, dshard, local_part
from rotary_testing.reference import exact_angle, rope_reference, rotate_pairs_nd

D = 16
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def dynamic_sharded_positions(mesh):
    """Context parallel with position ids: the last rank holds the largest
    position, past the table; every rank must grow the same table."""
    W = mesh.size()
    S = 4 * W
    q, k = _rand(1, 2, S, D, seed=1), _rand(1, 1, S, D, seed=2)
    ids = (torch.arange(S) * 12)[None]  # up to 12 * (S - 1), past max_seq_len on the last rank only
    for make in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        full = make(D, 32, scaling=dict(DYNAMIC, max_position_embeddings=32))
        want_q, want_k = full(q, k, position_ids=ids)
        sharded = make(D, 32, scaling=dict(DYNAMIC, max_position_embeddings=32))
        dq, _ = dshard(q, mesh, [Shard(2)])
        dk, _ = dshard(k, mesh, [Shard(2)])
        di, _ = dshard(ids, mesh, [Shard(1)])
        got_q, got_k = sharded(dq, dk, position_ids=di)
        assert sharded.rope_state == full.rope_state, (make.__name__, sharded.rope_state, full.rope_state)
        assert torch.equal(got_q.to_local(), local_part(want_q, mesh, [Shard(2)])), make.__name__
        assert torch.equal(got_k.to_local(), local_part(want_k, mesh, [Shard(2)])), make.__name__
    # The grown rule differs from the plain one past the table: the check above can fail.
    plain = rope_reference(q, positions=ids)
    assert not torch.allclose(want_q.double(), plain, atol=1e-3)


def positions_without_a_local_reading(mesh):
    W = mesh.size()
    f = rotary.freqs_table(D, 64)
    q = _rand(1, 2, 2 * W, D, seed=3)
    ids = (torch.arange(2 * W) * 3)[None].contiguous()
    rank = mesh.get_local_rank()
    part = DTensor.from_local(ids if rank == 0 else torch.zeros_like(ids), mesh, [Partial()], run_check=False)
    dq_rep = DTensor.from_local(q, mesh, [Replicate()], run_check=False)
    with pytest.raises(ValueError, match=r"position_ids has placement Partial\(sum\) on mesh dim 0; each rank reads "
                                         r"its positions as whole values"):
        rotary.apply_rope(dq_rep, f, position_ids=part)
    tokens = [t for c in range(2) for t in range(c * W + rank, c * W + rank + 1)]
    strided = DTensor.from_local(ids[:, tokens].contiguous(), mesh, [_StridedShard(1, split_factor=2)],
                                 run_check=False, shape=ids.shape, stride=ids.stride())
    dq_seq, _ = dshard(q, mesh, [Shard(2)])
    with pytest.raises(ValueError, match=r"position_ids has placement _StridedShard\(.*\) on mesh dim 0"):
        rotary.apply_rope(dq_seq, f, position_ids=strided)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], "original_max_position_embeddings": 16,
            "factor": 4.0}


def _rule_reference(x, inv, scale=1.0):
    """Float64 interleaved RoPE of x [B, H, S, D] at positions 0.., turned by inv, scaled."""
    angle = exact_angle(np.arange(x.shape[2]), np.asarray(inv))
    X = x.detach().double().numpy()
    return torch.from_numpy(rotate_pairs_nd(X, angle, True) * scale)


def _ddp_steps(make, scaling, seqs, reference):
    """DDP (broadcast_buffers=True) over a block holding the module, one step
    per length in seqs (this rank's); each output against reference(y, seq)
    for the rotated input y. Every rank checks the largest error of all
    ranks, after every step's backward: a rank that raised alone would leave
    the others waiting in a collective."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(D, D)
            self.rope = make(D, 64, scaling=scaling)

        def forward(self, x):
            return self.rope(self.lin(x))

    torch.manual_seed(0)
    block = Block()
    ddp = torch.nn.parallel.DistributedDataParallel(block)
    errors = []
    for step, seq in enumerate(seqs):
        x = _rand(1, 2, seq, D, seed=10 + step)
        out = ddp(x)
        with torch.no_grad():
            err = (out.double() - reference(block.lin(x), seq)).abs().max().item()
        out.sum().backward()
        errors.append(err)
    worst = torch.tensor([max(errors)], dtype=torch.float64)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    assert worst.item() < 2e-6, (make.__name__, seqs, errors, worst.item())
    return block.rope


def ddp_broadcast_buffers(mesh):
    """Rank 0 past original_max_position_embeddings (longrope's long
    factors), the others short; then a dynamic rule grown on every rank
    (float64 angles: one-row tables, which the broadcast copies), rank 0 to
    100 positions and the others to 60, which a later call of 40 keeps (a
    dynamic table does not shrink): each rank rotates by its own tables."""
    rank = mesh.get_local_rank()
    orig, factor = LONGROPE["original_max_position_embeddings"], LONGROPE["factor"]
    scale = math.sqrt(1 + math.log(factor) / math.log(orig))

    def longrope(y, seq):
        factors = LONGROPE["long_factor" if seq > orig else "short_factor"]
        return _rule_reference(y, 1.0 / (np.asarray(factors) * 10000.0 ** (np.arange(0, D, 2) / D)), scale)

    def dynamic(y, _):
        own = 100 if rank == 0 else 60
        base = 10000.0 * (2.0 * own / 16 - 1) ** (D / (D - 2))
        return _rule_reference(y, 1.0 / base ** (np.arange(0, D, 2) / D))

    for make in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        rope = _ddp_steps(make, LONGROPE, [24 if rank == 0 else 8] * 3, longrope)
        assert (rope.rope_state > 0) == (rank == 0), (make.__name__, rope.rope_state)  # long on rank 0
        rope = _ddp_steps(make, dict(DYNAMIC, max_position_embeddings=16),
                          [100, 100, 100] if rank == 0 else [60, 40, 40], dynamic)
        assert rope.rope_state == (100 if rank == 0 else 60), (make.__name__, rope.rope_state)


def scenarios():
    return [("dynamic_sharded_positions", dynamic_sharded_positions),
            ("positions_without_a_local_reading", positions_without_a_local_reading),
            ("ddp_broadcast_buffers", ddp_broadcast_buffers)]
