"""torch.func.vmap of apply_rope (python/rotary/_vmap.py) against a Python
loop over the slices (what torch's fallback does, one call per slice, then a
stack) and against one call on the slices already in the heads (the floor).

    PYTHONPATH=python python benchmarks/bench_vmap.py [--threads 1,2] [--heap reuse] [--quick]

The protocol is benchmarks/protocol.py's: a load guard, interleaved seeded
rounds, medians, and CPU time / wall next to every ratio.
"""

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol  # noqa: E402
import rotary  # noqa: E402

CASES = {  # name: (V, per-slice shape [B, H, S, D], start_pos); the row says V and the shape run
    "prefill-like": (8, (1, 8, 512, 128), 0),
    "decode-like": (64, (1, 32, 1, 128), 7),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="small slices, 2 rounds: a smoke run")
    protocol.add_protocol_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds = 2
        for name, (v, shape, start) in list(CASES.items()):
            CASES[name] = (min(v, 4), shape[:2] + (min(shape[2], 16),) + shape[3:], start)
    guard = protocol.check_load(args)
    print(guard.header())
    warnings.simplefilter("ignore")  # torch.func's own notices
    freqs = rotary.freqs_table(128, 4096)
    for nt in protocol.thread_passes(args.threads):
        print(f"\n{nt} thread(s), fp32, median of {args.rounds} interleaved rounds\n")
        print("| case | vmap (rule) | loop / vmap | one call / vmap |")
        print("|---|--:|--:|--:|")
        for name, (v, shape, start) in CASES.items():
            xs = torch.randn((v,) + shape)
            folded = xs.movedim(0, 1).flatten(1, 2)  # [B, V * H, S, D]: the slices in the heads
            vmapped = torch.func.vmap(lambda x: rotary.apply_rope(x, freqs, start))
            # Before timing: the three ways give the same bits.
            loop = torch.stack([rotary.apply_rope(x, freqs, start) for x in xs])
            assert torch.equal(vmapped(xs), loop), f"{name}: vmap differs from the loop"
            assert torch.equal(rotary.apply_rope(folded, freqs, start).unflatten(1, (v, -1)).movedim(1, 0), loop)
            name = f"{name}, V={v}, slice {list(shape)}"
            stats = protocol.time_interleaved({
                "vmap": lambda: vmapped(xs),
                "loop": lambda: torch.stack([rotary.apply_rope(x, freqs, start) for x in xs]),
                "one": lambda: rotary.apply_rope(folded, freqs, start),
            }, rounds=args.rounds, seed=args.seed, progress=f"{name} threads={nt}")
            base = stats["vmap"]
            print(f"| {name} | {base.median * 1e6:.1f} us (cpu/wall {base.cpu_wall:.1f}) "
                  f"| {protocol.ratio_cell(stats['loop'], base, guard)} "
                  f"| {protocol.ratio_cell(stats['one'], base, guard)} |")
    print()
    print(guard.finish())


if __name__ == "__main__":
    main()
