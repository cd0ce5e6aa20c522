"""Context parallelism: a [B, H, S, D] sequence sharded along S over two
ranks (torch.distributed, gloo, CPU). Each rank rotates its shard at its
global positions and the all-gathered result must equal the unsharded call
bit for bit (same kernel, same positions), with the positions given as
start_pos, as [B] offsets and as [B, S/2] position ids.

The ranks are separate processes with a hard deadline: a stuck collective
fails the test instead of hanging it."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
DEADLINE_S = 120.0  # whole test, process start-up included (importing torch takes ~30 s per rank on a loaded 2-core machine)
COLLECTIVE_TIMEOUT_S = 15.0


def _inputs(dtype, layout_seed):
    g = torch.Generator().manual_seed(1000 + layout_seed)
    B, Hq, Hk, S, D, L = 2, 4, 2, 12, 32, 64
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    offsets = torch.tensor([0, 17])  # per-batch offsets (e.g. cached prefix lengths)
    ids = torch.randint(0, L, (B, S), generator=g)  # arbitrary position ids
    return q, k, offsets, ids, L


def _gather_seq(t):
    """all_gather along the sequence dim (2) of [B, H, S/2, D] shards."""
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=2)


def _worker(rank, init_method):
    import rotary  # in the child: the same package the parent imported (sys.path is inherited)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for interleaved in (True, False):
                q, k, offsets, ids, L = _inputs(dtype, int(interleaved))
                S = q.shape[2]
                chunk = S // WORLD
                lo, hi = rank * chunk, (rank + 1) * chunk
                f = rotary.freqs_table(q.shape[-1], L)
                q_shard, k_shard = q[:, :, lo:hi].contiguous(), k[:, :, lo:hi].contiguous()
                cases = {
                    # global offset of this rank's first token
                    "start_pos": (dict(start_pos=lo), dict()),
                    # [B] offsets: the per-batch offsets plus this rank's global offset
                    "offsets": (dict(offsets=offsets + lo), dict(offsets=offsets)),
                    # [B, S/2] ids: this rank's slice of the global ids
                    "position_ids": (dict(position_ids=ids[:, lo:hi].contiguous()), dict(position_ids=ids)),
                }
                for name, (sharded_kw, full_kw) in cases.items():
                    start = sharded_kw.pop("start_pos", 0)
                    sq, sk = rotary.apply_rope_qk(q_shard, k_shard, f, start, interleaved, **sharded_kw)
                    gq, gk = _gather_seq(sq), _gather_seq(sk)
                    fq, fk = rotary.apply_rope_qk(q, k, f, 0, interleaved, **full_kw)
                    tag = f"rank {rank}, {dtype}, interleaved={interleaved}, {name}"
                    assert torch.equal(gq, fq), f"gathered q differs from the unsharded call ({tag})"
                    assert torch.equal(gk, fk), f"gathered k differs from the unsharded call ({tag})"
                    # A wrong offset is visible: the gathered result is not a no-op check.
                    if name == "start_pos" and rank == 1:
                        wrong, _ = rotary.apply_rope_qk(q_shard, k_shard, f, 0, interleaved)
                        assert not torch.equal(wrong, fq[:, :, lo:hi])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_ranks(init_method, deadline_s):
    ctx = mp.start_processes(_worker, args=(init_method,), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=0.2):  # raises ProcessRaisedException / ProcessExitedException on failure
            if time.monotonic() > deadline:
                pytest.fail(f"ranks did not finish within {deadline_s} s (hung collective?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_sequence_sharded_rope_equals_unsharded(tmp_path, monkeypatch):
    # Loopback only: no dependence on the host name resolving to a usable interface.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init_file = tmp_path / "dist_init"
    start = time.monotonic()
    _run_ranks(f"file://{init_file}", DEADLINE_S)
    assert time.monotonic() - start < 30.0
