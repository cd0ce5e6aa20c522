"""Refused placements for test_distributed.py (run in every rank of 2,
through dist_scenarios.scenarios): a clear error, nothing computed, nothing
written; head_dim or packed tokens split, q and k placed unlike, position
ids sharded unlike the sequence, shards whose spec does not say where they
lie, placements with no rotary rule, a sharded table. Split from
dist_scenarios.py."""

import re

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import rotary
from rotary_testing.dist_scenarios import D, IDS, L, OPS, _rand, dshard, local_part


def refusals(mesh):
    f = rotary.rope_freqs(D, L)
    q, k = _rand(2, 4, 6, D, seed=30), _rand(2, 2, 6, D, seed=31)
    ids = torch.randint(0, L - 8, (2, 6), generator=torch.Generator().manual_seed(32))

    def refused(pattern, fn):
        with pytest.raises(ValueError, match=pattern):
            fn()

    dq3, _ = dshard(q, mesh, [Shard(3)])
    dk3, _ = dshard(k, mesh, [Shard(3)])
    refused(re.escape(repr(Shard(3))) + r".*splits head_dim.*shard batch \(Shard\(dim=0\)\), heads \(Shard\(dim=1\)\)",
            lambda: OPS.apply_rope_qk(dq3, dk3, f))
    # in place: refused before anything is written
    before = (dq3.to_local().clone(), dk3.to_local().clone())
    refused("splits head_dim", lambda: OPS.apply_rope_qk_(dq3, dk3, f))
    assert torch.equal(dq3.to_local(), before[0]) and torch.equal(dk3.to_local(), before[1])

    dq2, _ = dshard(q, mesh, [Shard(2)])
    dk2, _ = dshard(k, mesh, [Shard(2)])
    dk1, _ = dshard(k, mesh, [Shard(1)])
    refused(r"q has placements \(Shard\(dim=2\)\) but k has \(Shard\(dim=1\)\).*sharded alike",
            lambda: OPS.apply_rope_qk_(dq2, dk1, f))
    refused(r"k is a plain tensor but q is a DTensor", lambda: OPS.apply_rope_qk(dq2, k, f))
    f_rep = DTensor.from_local(f, mesh, [Replicate()], run_check=False)
    refused(r"freqs is a DTensor but q and k are plain tensors; pass freqs.to_local\(\)",
            lambda: OPS.apply_rope_qk(q, k, f_rep))

    # position ids sharded unlike the sequence
    ids_b, _ = dshard(ids, mesh, [Shard(0)])
    refused(rf"{IDS} has placements \(Shard\(dim=0\)\) but q and k are placed \(Shard\(dim=2\)\): this rank "
            rf"rotates {IDS}\[.*Shard {IDS} \(ids\) the same way as the sequence/batch of q, or replicate it",
            lambda: OPS.apply_rope_qk(dq2, dk2, f, **{IDS: ids_b}))
    ids_s, _ = dshard(ids, mesh, [Shard(1)])
    dqr = DTensor.from_local(q, mesh, [Replicate()], run_check=False)
    dkr = DTensor.from_local(k, mesh, [Replicate()], run_check=False)
    refused(rf"{IDS} has placements \(Shard\(dim=1\)\) but q and k are placed \(Replicate\(\)\): this rank rotates "
            rf"{IDS}\[0:6\] along dim 1 and holds only \[\d:\d\]",
            lambda: OPS.apply_rope_qk(dqr, dkr, f, **{IDS: ids_s}))

    # [1, S] ids sharded on their broadcast dim: rank 0 holds the row, rank 1
    # none; every rank refuses (rank 0 rotated and wrote its shard)
    ids_1, _ = dshard(ids[:1], mesh, [Shard(0)])
    for dq in (dq2, dshard(q, mesh, [Shard(0)])[0]):
        before = dq.to_local().clone()
        refused(rf"{IDS} has placements \(Shard\(dim=0\)\) but x is placed .*: {IDS} dim 0 has size 1 and "
                rf"broadcasts, so every rank reads it whole; replicate {IDS}",
                lambda: OPS.apply_rope_(dq, f, **{IDS: ids_1}))
        assert torch.equal(dq.to_local(), before)

    # shards whose spec does not say where they lie (uneven, against torch.chunk sizes)
    rank = mesh.get_local_rank()
    q7 = _rand(2, 4, 7, D, seed=33)
    n = 3 if rank == 0 else 4  # the spec of a 7-token Shard(2) says 4 then 3
    lo = 0 if rank == 0 else 3
    local = q7[:, :, lo:lo + n].contiguous()
    bad = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=q7.shape, stride=q7.stride())
    refused(r"x has a local shard of shape .* global offset cannot be derived.*shape=, stride=",
            lambda: OPS.apply_rope(bad, f))

    strided = DTensor.from_local(q[:, :2].contiguous(), mesh, [_StridedShard(1, split_factor=2)], run_check=False,
                                 shape=q.shape, stride=q.stride())
    refused(r"x has placement _StridedShard\(dim=1, sf=2\) on mesh dim 0, which has no rotary rule",
            lambda: OPS.apply_rope(strided, f))

    part = DTensor.from_local(q, mesh, [Partial("max")], run_check=False)
    refused(r"x has placement Partial\(max\) on mesh dim 0; only Partial\(sum\) or Partial\(avg\) rotates term "
            r"by term: reduce it first", lambda: OPS.apply_rope(part, f))

    fs, _ = dshard(f, mesh, [Shard(0)])
    refused(r"freqs has placements \(Shard\(dim=0\)\); every rank needs all of it: replicate it",
            lambda: OPS.apply_rope(dq2, fs))

    # packed tokens: no sequence sharding
    tokens = _rand(8, 4, D, seed=34)
    cu = torch.tensor([0, 3, 8])
    dt, _ = dshard(tokens, mesh, [Shard(0)])
    refused(r"Shard\(dim=0\) on mesh dim 0, which splits packed tokens.*shard heads \(Shard\(dim=1\)\)",
            lambda: OPS.apply_rope(dt, f, cu_seqlens=cu))
    # ... but heads may be sharded
    dth, lth = dshard(tokens, mesh, [Shard(1)])
    out = OPS.apply_rope(dth, f, cu_seqlens=cu)
    assert torch.equal(out.to_local(), local_part(OPS.apply_rope(tokens, f, cu_seqlens=cu), mesh, [Shard(1)]))
    # one start per sequence: read whole on every rank, so a sharded one is refused in the packed words
    starts = torch.tensor([4, 20])
    out = OPS.apply_rope(dth, f, cu_seqlens=cu, offsets=starts)
    assert torch.equal(out.to_local(),
                       local_part(OPS.apply_rope(tokens, f, cu_seqlens=cu, offsets=starts), mesh, [Shard(1)]))
    ds, _ = dshard(starts, mesh, [Shard(0)])
    refused(r"offsets dim 0 is sharded, but with cu_seqlens every rank reads offsets whole \(packed tokens are "
            r"never split across ranks\); replicate offsets", lambda: OPS.apply_rope(dth, f, cu_seqlens=cu, offsets=ds))

    # bad input that is not about placement: the op's own validator answers, as on plain tensors
    with pytest.raises(ValueError, match="layout must be 'BHSD', 'BSHD' or 'SBHD', got 'XYZ'"):
        OPS.apply_rope(dq2, f, layout="XYZ")
