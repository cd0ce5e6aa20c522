"""Op scenarios for test_distributed.py (run in every rank, through
dist_scenarios.scenarios): tensor parallel (Shard(heads)), Shard(batch),
context parallel with offsets derived from the spec or head-tail position
ids, in place, a 2-D mesh, and a check that CommDebugMode sees a collective
at all. Each compares the sharded call with the unsharded one and the
float64 reference (dist_scenarios.run_case). Split from dist_scenarios.py."""

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import CommDebugMode

import rotary
from rotary_testing.dist_scenarios import (D, HEADS_DIM, IDS, L, OFFSETS, OPS, SEQ_DIM, _rand, dshard, local_part,
                                           reference, run_case)


def tp_heads(mesh):
    W = mesh.size()
    for layout in ("BHSD", "BSHD", "SBHD"):
        for interleaved in (True, False):
            B, Hq, Hk, S = 2, 2 * W, W, 5
            shape = {"BHSD": (B, "H", S, D), "BSHD": (B, S, "H", D), "SBHD": (S, B, "H", D)}[layout]
            q = _rand(*[Hq if s == "H" else s for s in shape], seed=1)
            k = _rand(*[Hk if s == "H" else s for s in shape], seed=2)
            run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(HEADS_DIM[layout])], start_pos=3,
                     interleaved=interleaved, layout=layout, ref_pos=None, full_kw={}, dist_kw={},
                     tag=f"TP {layout} interleaved={interleaved}")
    # one tensor, and freqs as a replicated DTensor instead of a plain tensor
    x = _rand(2, 2 * W, 4, D, seed=3)
    f = DTensor.from_local(rotary.rope_freqs(D, L), mesh, [Replicate()], run_check=False)
    run_case(mesh, OPS.apply_rope, [x], [Shard(1)], start_pos=0, interleaved=True, layout="BHSD", ref_pos=None,
             full_kw={}, dist_kw={}, tag="TP apply_rope, replicated DTensor freqs", freqs=f)


def dp_batch(mesh):
    W = mesh.size()
    q, k = _rand(2 * W, 2, 5, D, seed=4), _rand(2 * W, 1, 5, D, seed=5)
    offsets = torch.arange(2 * W) * 7 + 1
    ids = torch.randint(0, L - 8, (2 * W, 5), generator=torch.Generator().manual_seed(6))
    for name, pos, placed in (
        ("plain [B] offsets", offsets, offsets),
        ("[B] offsets sharded like batch", offsets, dshard(offsets, mesh, [Shard(0)])[0]),
        ("[B, S] ids sharded like batch", ids, dshard(ids, mesh, [Shard(0)])[0]),
    ):
        arg = OFFSETS if pos.dim() == 1 else IDS
        start = 2 if pos.dim() == 1 else 0  # ids are absolute (start_pos must be 0 with position_ids)
        run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(0)], start_pos=start, interleaved=False, layout="BHSD",
                 ref_pos=pos, full_kw={arg: pos}, dist_kw={arg: placed}, tag=f"DP {name}")


def cp_offsets_derived(mesh):
    W = mesh.size()
    rank = mesh.get_local_rank()
    # 2W + 1 tokens: uneven shards (torch.chunk sizes), offsets still derived from the spec
    for layout in ("BHSD", "SBHD", "BSHD"):
        S = 2 * W + 1
        shape = {"BHSD": (2, 3, S, D), "BSHD": (2, S, 3, D), "SBHD": (S, 2, 3, D)}[layout]
        q, k = _rand(*shape, seed=7), _rand(*shape, seed=8)
        placements = [Shard(SEQ_DIM[layout])]
        shards = run_case(mesh, OPS.apply_rope_qk, [q, k], placements, start_pos=5, interleaved=True,
                          layout=layout, ref_pos=None, full_kw={}, dist_kw={}, tag=f"CP derived {layout}")
        # The offset matters: the shard rotated at start_pos alone is wrong on ranks past 0.
        off = compute_local_shape_and_global_offset(q.shape, mesh, placements)[1][SEQ_DIM[layout]]
        if off > 0 and shards[0][1].numel() > 0:  # (4 ranks, 9 tokens: the last shard is empty)
            plain = OPS.apply_rope(shards[0][1].detach(), rotary.rope_freqs(D, L), 5, True, layout=layout)
            want = local_part(OPS.apply_rope(q, rotary.rope_freqs(D, L), 5, True, layout=layout), mesh, placements)
            assert not torch.equal(plain, want), f"rank {rank}: the check cannot see a missing offset"
    offsets = torch.tensor([0, 11])
    q, k = _rand(2, 3, 3 * W, D, seed=9), _rand(2, 1, 3 * W, D, seed=10)
    run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(2)], start_pos=1, interleaved=False, layout="BHSD",
             ref_pos=offsets, full_kw={OFFSETS: offsets}, dist_kw={OFFSETS: offsets}, tag="CP derived + offsets")


def _head_tail(S, W):
    """Load-balanced order: rank r holds chunks r and 2W-1-r of the sequence."""
    chunks = torch.arange(S).chunk(2 * W)
    return torch.cat([torch.cat([chunks[r], chunks[2 * W - 1 - r]]) for r in range(W)])


def cp_head_tail_ids(mesh):
    W = mesh.size()
    B, S = 2, 4 * W
    perm = _head_tail(S, W)
    q, k = _rand(B, 4, S, D, seed=11), _rand(B, 2, S, D, seed=12)
    qp, kp = q[:, :, perm].contiguous(), k[:, :, perm].contiguous()
    ids = (perm[None, :] + torch.tensor([[0], [9]])).contiguous()  # [B, S]: batch 1 starts at 9
    for name, placed in (
        ("ids sharded like the sequence", dshard(ids, mesh, [Shard(1)])[0]),
        ("replicated plain ids", ids),
        ("replicated DTensor ids", DTensor.from_local(ids, mesh, [Replicate()], run_check=False)),
    ):
        for interleaved in (True, False):
            run_case(mesh, OPS.apply_rope_qk, [qp, kp], [Shard(2)], start_pos=0, interleaved=interleaved,
                     layout="BHSD", ref_pos=ids, full_kw={IDS: ids}, dist_kw={IDS: placed},
                     tag=f"CP head-tail, {name}, interleaved={interleaved}")
    # The head-tail ids are the natural positions: same as rotating in order, then reordering.
    natural = OPS.apply_rope_qk(q, k, rotary.rope_freqs(D, L), 0, True, **{OFFSETS: torch.tensor([0, 9])})
    balanced = OPS.apply_rope_qk(qp, kp, rotary.rope_freqs(D, L), 0, True, **{IDS: ids})
    assert torch.equal(natural[0][:, :, perm], balanced[0]) and torch.equal(natural[1][:, :, perm], balanced[1])
    if IDS == "position_ids":  # [seq] ids, shared by the batch
        run_case(mesh, OPS.apply_rope_qk, [qp, kp], [Shard(2)], start_pos=0, interleaved=True, layout="BHSD",
                 ref_pos=perm.expand(B, S), full_kw={IDS: perm}, dist_kw={IDS: dshard(perm, mesh, [Shard(0)])[0]},
                 tag="CP head-tail, [S] ids")


def in_place(mesh):
    W = mesh.size()
    f = rotary.rope_freqs(D, L)
    x = _rand(2, 2 * W, 2 * W, D, seed=13)
    q, k = _rand(2, 2 * W, 2 * W, D, seed=14), _rand(2, W, 2 * W, D, seed=15)
    for placements in ([Shard(1)], [Shard(2)]):
        dx, lx = dshard(x, mesh, placements)
        dq, lq = dshard(q, mesh, placements)
        dk, lk = dshard(k, mesh, placements)
        with CommDebugMode() as comm:
            OPS.apply_rope_(dx, f, 4, False)
            OPS.apply_rope_qk_(dq, dk, f, 4, True)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert torch.equal(lx, local_part(OPS.apply_rope(x, f, 4, False), mesh, placements)), placements
        fq, fk = OPS.apply_rope_qk(q, k, f, 4, True)
        assert torch.equal(lq, local_part(fq, mesh, placements)) and torch.equal(lk, local_part(fk, mesh, placements))
        torch.testing.assert_close(lq.double(), local_part(reference(q, "BHSD", 4, True, None), mesh, placements),
                                   atol=1e-5, rtol=0)


def mesh_2d(mesh):
    """DP x CP on a 2 x (W/2) mesh: Shard(batch) and Shard(seq) together, [B] offsets."""
    from torch.distributed.device_mesh import init_device_mesh

    m2 = init_device_mesh("cpu", (2, mesh.size() // 2), mesh_dim_names=("dp", "cp"))
    offsets = torch.tensor([3, 0, 8, 1])
    q, k = _rand(4, 2, 6, D, seed=16), _rand(4, 2, 6, D, seed=17)
    run_case(m2, OPS.apply_rope_qk, [q, k], [Shard(0), Shard(2)], start_pos=2, interleaved=True, layout="BHSD",
             ref_pos=offsets, full_kw={OFFSETS: offsets}, dist_kw={OFFSETS: offsets}, tag="DP x CP")


def comm_mode_sees_collectives(mesh):
    """CommDebugMode counts a gloo all-gather here, so a zero count means something."""
    t = dshard(_rand(2, mesh.size() * 2, 3, D, seed=18), mesh, [Shard(1)])[0]
    with CommDebugMode() as comm:
        t.full_tensor()
    assert comm.get_total_counts() > 0
