"""Decode-step call overhead on the CPU: where the time of one RoPE call goes.

q [64, 32, 1, 128] and k [64, 8, 1, 128] (fp32 by default): the op through
each entry point, against two torch.add of the same tensors (the cost of any
two out-of-place ops). Median over rounds, every call timed in the same run,
in a plain process. --cpu-time times the thread's CPU time instead of the wall
clock (steadier on a shared machine).

    PYTHONPATH=python .venv/bin/python benchmarks/bench_decode.py [--threads 2] [--dtype float32]
"""

import argparse
import statistics
import time

import torch

import rotary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--cpu-time", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.cpu_time else time.perf_counter
    dtype = getattr(torch, a.dtype)
    q = torch.randn(64, 32, 1, 128, dtype=dtype)
    k = torch.randn(64, 8, 1, 128, dtype=dtype)
    py, cpp = rotary.RotaryEmbedding(128, 4096), rotary.CppRotaryEmbedding(128, 4096)
    op = torch.ops.rotary.apply_rope_qk.default
    freqs, inv = py.freqs, py.inv_freq
    cases = {
        "2x torch.add": lambda: (torch.add(q, 1.0), torch.add(k, 1.0)),
        "2x empty_like (allocation)": lambda: (torch.empty_like(q), torch.empty_like(k)),
        "op overload": lambda: op(q, k, freqs, 7),
        "op overload + inv_freq": lambda: op(q, k, freqs, 7, inv_freq=inv),
        "rotary.apply_rope_qk": lambda: rotary.apply_rope_qk(q, k, freqs, 7),
        "rotary.RotaryEmbedding": lambda: py(q, k, 7),
        "rotary.CppRotaryEmbedding": lambda: cpp(q, k, 7),
    }
    times = {name: [] for name in cases}
    for _ in range(a.rounds):
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            t = clock()
            for _ in range(a.calls):
                fn()
            times[name].append((clock() - t) / a.calls * 1e6)
    base = statistics.median(times["2x torch.add"])
    print(f"decode {a.dtype}, {a.threads} thread(s), {'thread CPU time' if a.cpu_time else 'wall clock'}\n")
    print("| call | us | / 2x torch.add |\n|---|--:|--:|")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"| {name} | {m:.1f} | {m / base:.2f} |")


if __name__ == "__main__":
    main()
