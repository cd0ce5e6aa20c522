"""Per-rank cost of the rotary op on DTensor shards against the same op on a
plain tensor of the shard's size: the DTensor dispatch overhead (goal <= 1.1x).

  python benchmarks/bench_distributed.py                 # 2 ranks, gloo, CPU
  python benchmarks/bench_distributed.py --world 4 --quick
  python benchmarks/bench_distributed.py --device cuda   # NCCL, one GPU per rank

Each rank times ``apply_rope_qk`` on its shard two ways in interleaved
rounds (benchmarks/protocol.py: seeded order, medians, CPU time / wall next
to the ratio, refused on a loaded machine): through DTensor (Shard(heads) for
tensor parallel, Shard(seq) for context parallel) and on the local tensors
directly; start_pos advances every call, as in a decode loop. For scale,
torch's own fixed DTensor cost of one elementwise op (torch.mul on q's
shard, DTensor minus local) is timed in the same rounds. Printed: median
microseconds per call on rank 0 and the ratio, at
decode (one token) and prefill sizes, for each --threads count per rank (a
row is marked when ranks x threads exceed the CPUs). No collective runs
inside the timed calls.
"""

import argparse
import itertools
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import add_protocol_args, check_load, pin_heap, ratio_cell, thread_passes, time_interleaved  # noqa: E402

# name, batch, q heads, kv heads, seq, head_dim
SIZES = [
    ("decode", 8, 32, 8, 1, 128),
    ("prefill", 1, 32, 8, 1024, 128),
]


def _time(fn, iters, sync):
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _worker(rank, args, init_method):
    pin_heap(getattr(args, "heap", "default"))  # each rank is its own process: the header's regime holds here too
    import rotary  # noqa: F401  (registers the ops and, with DTensor, their rules)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh(args.device, (args.world,))
    dev = torch.device(args.device, torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    f = rotary.rope_freqs(128, 4096).to(dev)
    guard, rows = args.guard, []
    for nt in thread_passes([None] if cuda else args.threads):
        for name, B, Hq, Hk, S, Dh in SIZES:
            for mode in ("TP Shard(heads)", "CP Shard(seq)"):
                if mode.startswith("CP") and S < args.world:
                    continue  # one token cannot be split along the sequence
                W = args.world
                if mode.startswith("TP"):
                    dim, ql, kl = 1, (B, Hq // W, S, Dh), (B, Hk // W, S, Dh)
                else:
                    dim, ql, kl = 2, (B, Hq, S // W, Dh), (B, Hk, S // W, Dh)
                q = torch.randn(ql, device=dev, dtype=dtype)
                k = torch.randn(kl, device=dev, dtype=dtype)
                dq = DTensor.from_local(q, mesh, [Shard(dim)], run_check=False)
                dk = DTensor.from_local(k, mesh, [Shard(dim)], run_check=False)
                # start_pos advances as in a decode loop (each call a new value).
                pos = itertools.cycle(range(100, 4096 - S))
                variants = {"local": lambda: torch.ops.rotary.apply_rope_qk(q, k, f, next(pos), True),
                            "DTensor": lambda: torch.ops.rotary.apply_rope_qk(dq, dk, f, next(pos), True),
                            # torch's own fixed DTensor cost, for scale: one elementwise op on q's shard
                            "mul local": lambda: torch.mul(q, 2.0),
                            "mul DTensor": lambda: torch.mul(dq, 2.0)}
                # One count for both, from the local call: the ranks stay in step.
                iters = max(5, int(args.target_s / max(_time(variants["local"], 3, sync), 1e-7)))
                st = time_interleaved(variants, args.rounds, calls=iters, warmup=1, seed=args.seed, sync=sync)
                over = "" if cuda or W * nt <= (os.cpu_count() or 1) else " (oversubscribed)"
                torch_cost = (st["mul DTensor"].median - st["mul local"].median) * 1e6
                rows.append((name, mode, f"{list(ql)}", nt or "-", st["local"].median * 1e6,
                             st["DTensor"].median * 1e6, ratio_cell(st["DTensor"], st["local"], guard) + over,
                             torch_cost))
    dist.barrier()
    if rank == 0:
        print(f"world={args.world} device={args.device} dtype={args.dtype} CPUs={os.cpu_count()} "
              f"torch={torch.__version__}; median per call on rank 0, {args.rounds} interleaved rounds"
              f"{guard.marker()}")
        print(f"{'size':8} {'sharding':16} {'local q shard':22} {'threads':>7} {'local us':>10} {'DTensor us':>11}"
              f" {'torch.mul DTensor-local us':>26}  ratio DTensor / local")
        for r in rows:
            print(f"{r[0]:8} {r[1]:16} {r[2]:22} {r[3]:>7} {r[4]:10.1f} {r[5]:11.1f} {r[7]:26.1f}  {r[6]}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-s", type=float, default=0.05, help="time per round per variant")
    p.add_argument("--quick", action="store_true", help="3 short rounds (a smoke run)")
    add_protocol_args(p)  # --threads: per rank
    args = p.parse_args()
    if args.quick:
        args.rounds, args.target_s = 3, 0.01
    args.guard = check_load(args)
    print(args.guard.header(), flush=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(args, f"file://{d}/init"), nprocs=args.world, start_method="spawn")
    print(args.guard.finish())


if __name__ == "__main__":
    main()
