"""Decode-step call overhead on the CPU: where the time of one RoPE call goes.

q [64, 32, 1, 128] and k [64, 8, 1, 128] (fp32 by default): the op through
each entry point, against two torch.add of the same tensors (the cost of any
two out-of-place ops). Timed with benchmarks/protocol.py: every call once per
round in a seeded shuffled order, medians over rounds, CPU time / wall next
to each ratio, one pass per --threads count, refused on a loaded machine.
--cpu-time also prints the process CPU time per call (all threads), which a
descheduled thread does not inflate. --processes N repeats the run in N fresh
processes and gives each ratio's median and range over them.

    PYTHONPATH=python .venv/bin/python benchmarks/bench_decode.py [--threads 1,2] [--dtype float32] [--processes 6] [--quick]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import (add_process_args, add_protocol_args, check_load, ratio_cell, run_processes,  # noqa: E402
                      save_results, spread_table, thread_passes, time_interleaved)

import torch  # noqa: E402

import rotary  # noqa: E402
from bench_common import float64_rope  # noqa: E402


def check_rotations(cases, q, k) -> None:
    """Before anything is timed: every rotating call against an independent
    float64 rotation of position 7 (longrope's attention scaling changes its
    table: its two modules bit for bit instead)."""
    tol = dict(rtol=1e-5, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    exact = (float64_rope(q, 7, True), float64_rope(k, 7, True))
    for name, fn in cases.items():
        if not name.startswith(("op", "rotary.")) or "longrope" in name:
            continue
        for got, want in zip(fn(), exact):
            torch.testing.assert_close(got.double(), want, **tol, msg=name)
    py, cpp = cases["rotary.RotaryEmbedding, longrope"](), cases["rotary.CppRotaryEmbedding, longrope"]()
    assert all(torch.equal(a, b) for a, b in zip(py, cpp)), "the two longrope modules differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=300, help="calls per sample")
    ap.add_argument("--cpu-time", action="store_true", help="also the process CPU time per call")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 30 calls: a smoke run")
    add_protocol_args(ap)
    add_process_args(ap)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.calls = 3, 30
    if a.processes > 1:
        runs = run_processes(a)
        for nt in a.threads:
            print(f"\ndecode {a.dtype}, {nt} thread(s), wall clock: over {a.processes} processes, the median and range"
                  f" of each one's median of {a.rounds} interleaved rounds\n")
            print("| call | us | / 2x torch.add, median [range] | cpu/wall |\n|---|--:|--:|--:|")
            print(spread_table(runs, nt, "2x torch.add"))
        return
    guard = check_load(a)
    dtype = getattr(torch, a.dtype)
    q = torch.randn(64, 32, 1, 128, dtype=dtype)
    k = torch.randn(64, 8, 1, 128, dtype=dtype)
    py, cpp = rotary.RotaryEmbedding(128, 4096), rotary.CppRotaryEmbedding(128, 4096)
    op = torch.ops.rotary.apply_rope_qk.default
    freqs, inv = py.freqs, py.inv_freq
    # Host-driven rules: the table is chosen on the host per call, under the module's lock.
    dyn = {"rope_type": "dynamic", "factor": 2.0}
    lng = {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 2048,
           "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
    py_dyn, cpp_dyn = rotary.RotaryEmbedding(128, 4096, scaling=dyn), rotary.CppRotaryEmbedding(128, 4096, scaling=dyn)
    py_lng, cpp_lng = rotary.RotaryEmbedding(128, 4096, scaling=lng), rotary.CppRotaryEmbedding(128, 4096, scaling=lng)
    cases = {
        "2x torch.add": lambda: (torch.add(q, 1.0), torch.add(k, 1.0)),
        "2x empty_like (allocation)": lambda: (torch.empty_like(q), torch.empty_like(k)),
        "op overload": lambda: op(q, k, freqs, 7),
        "op overload + inv_freq": lambda: op(q, k, freqs, 7, inv_freq=inv),
        "rotary.apply_rope_qk": lambda: rotary.apply_rope_qk(q, k, freqs, 7),
        "rotary.RotaryEmbedding": lambda: py(q, k, 7),
        "rotary.CppRotaryEmbedding": lambda: cpp(q, k, 7),
        "rotary.RotaryEmbedding, dynamic": lambda: py_dyn(q, k, 7),
        "rotary.CppRotaryEmbedding, dynamic": lambda: cpp_dyn(q, k, 7),
        "rotary.RotaryEmbedding, longrope": lambda: py_lng(q, k, 7),
        "rotary.CppRotaryEmbedding, longrope": lambda: cpp_lng(q, k, 7),
    }
    check_rotations(cases, q, k)
    print(guard.header())
    passes = {}
    for nt in thread_passes(a.threads):
        st = passes[nt] = time_interleaved(cases, a.rounds, calls=a.calls, warmup=20, seed=a.seed)
        base = st["2x torch.add"]
        print(f"\ndecode {a.dtype}, {nt} thread(s), wall clock, median of {a.rounds} interleaved rounds"
              f"{guard.marker()}\n")
        cpu_head = " CPU us | CPU / 2x torch.add |" if a.cpu_time else ""
        print(f"| call | us | / 2x torch.add (cpu/wall this vs it) |{cpu_head}\n|---|--:|--:|"
              + ("--:|--:|" if a.cpu_time else ""))
        for name, s in st.items():
            row = f"| {name} | {s.median * 1e6:.1f} | {ratio_cell(s, base, guard)} |"
            if a.cpu_time:
                row += f" {s.cpu_per_call * 1e6:.1f} | {guard.star()}{s.cpu_per_call / base.cpu_per_call:.2f}x |"
            print(row)
    print("\n" + guard.finish())
    save_results(a.results_json, guard, passes)


if __name__ == "__main__":
    main()
