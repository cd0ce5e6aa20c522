"""The timing protocol every benchmark here shares, so that a busy machine cannot fool it.

On a 2-core machine an OpenMP-parallel baseline (clone, torch.add) waits at
every barrier for a descheduled thread whenever anything else runs, and slows
10-100x, while single-threaded code does not: every ratio against it then
flatters the single-threaded side. Hence:

- the load average is recorded before and after the run; ratios are refused
  when the 1-minute load before is above --max-load (0.5), unless --allow-load
  (or a --quick smoke run) lets them through, then marked '*' and each table
  '(load X.XX: not a quiet machine)';
- every variant runs once per round, in a new seeded order, for N rounds;
  medians per variant, ratios of medians;
- CPU time / wall of each variant (process CPU time covers all its threads):
  ~1.0 means one thread was busy, ~2.0 two;
- every pass runs at each of --threads (default 1 and 2);
- --processes N (where a script wires it) repeats the whole run in N fresh
  processes, each with its own seed, and gives each ratio's median and range
  over them: a process's heap and code layout moved a 50 us decode call's
  ratio between 1.02 and 1.30 on one quiet machine, more than any one
  process's rounds show;
- --heap pins where a large output's pages come from: 'fresh' (every block
  of 1 MiB or more is mapped anew per call, so every call pays its page
  faults) or 'reuse' (freed blocks stay in the heap: pages mapped and often
  cached). Under glibc's defaults ('default') a block's fate depends on the
  sizes freed before it (the mmap threshold moves), so ours and a peer can
  land in different regimes in the same round; the pinned ones cannot.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence


def thread_list(text: str) -> List[int]:
    return [int(t) for t in str(text).split(",") if t.strip()]


def add_protocol_args(p: argparse.ArgumentParser, threads: str = "1,2") -> None:
    g = p.add_argument_group("timing protocol (benchmarks/protocol.py)")
    g.add_argument("--threads", type=thread_list, default=threads,
                   help=f"torch thread counts, one pass each, comma list (default {threads})")
    g.add_argument("--max-load", type=float, default=0.5,
                   help="refuse ratios when the 1-minute load average before the run is above this (default 0.5)")
    g.add_argument("--allow-load", action="store_true",
                   help="print ratios above --max-load anyway, each marked '*' (--quick implies it)")
    g.add_argument("--wait-load", type=float, default=0.0, metavar="S",
                   help="first wait up to S seconds for the load to fall to --max-load")
    g.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle (default 0)")
    g.add_argument("--heap", choices=sorted(HEAP_REGIMES), default="default",
                   help="where large outputs' pages come from: default (glibc's own rules), fresh (mapped anew "
                   "per call: page faults every call), reuse (freed blocks kept: mapped, often cached)")


# glibc mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
HEAP_REGIMES = {
    "default": "glibc defaults (a block over the moving mmap threshold, 32 MiB at most, is mapped anew per call)",
    "fresh": "glibc, mmap threshold pinned at 1 MiB (every large block mapped anew: page faults every call)",
    "reuse": "glibc, mmap off and no trim (freed blocks reused: pages mapped, often cached)",
}


def pin_heap(regime: str) -> str:
    """Pins the heap regime (process-wide, before anything is timed); returns
    the line for a table header."""
    if regime == "default":
        return HEAP_REGIMES[regime]
    try:
        libc = ctypes.CDLL("libc.so.6")
        if regime == "fresh":
            ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20) == 1  # a set threshold no longer moves
        else:
            ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except OSError:
        ok = False
    if not ok:
        raise SystemExit(f"--heap {regime}: glibc's mallopt is not available here; use --heap default")
    return HEAP_REGIMES[regime]


def _own_cpu_s() -> float:
    # This process's threads and its reaped children (ranks, compile workers).
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


class LoadGuard:
    def __init__(self, max_load: float, allowed_by: str = ""):
        self.max_load, self.allowed_by = max_load, allowed_by
        self.before = os.getloadavg()
        self.after: Optional[Sequence[float]] = None
        self.t0, self.cpu0 = time.perf_counter(), _own_cpu_s()
        self.heap = HEAP_REGIMES["default"]

    @property
    def loaded(self) -> bool:
        return self.before[0] > self.max_load

    def star(self) -> str:
        return "*" if self.loaded else ""

    def marker(self) -> str:
        return f" (load {self.before[0]:.2f}: not a quiet machine)" if self.loaded else ""

    def header(self) -> str:
        state = (f"> --max-load {self.max_load:.2f}: not a quiet machine, ratios marked '*', allowed by "
                 f"{self.allowed_by}" if self.loaded else f"<= --max-load {self.max_load:.2f}: quiet")
        return (f"load average before: {_fmt(self.before)} ({os.cpu_count()} CPUs; 1-min {self.before[0]:.2f}"
                f" {state}); heap: {self.heap}")

    def finish(self) -> str:
        """Footer: the load after, against what this run's own threads account for."""
        self.after = os.getloadavg()
        wall = max(time.perf_counter() - self.t0, 1e-9)
        busy = (_own_cpu_s() - self.cpu0) / wall
        decay = math.exp(-wall / 60.0)  # the kernel's 1-minute average
        own = self.before[0] * decay + busy * (1 - decay)
        line = (f"load average after: {_fmt(self.after)} (expected from the load before and this run's own"
                f" {busy:.2f} busy threads over {wall:.1f} s: about {own:.2f})")
        if self.after[0] - own > self.max_load:
            line += (f"\nWARNING: 1-min load after {self.after[0]:.2f} > --max-load {self.max_load:.2f}, and"
                     f" {self.after[0] - own:.2f} above the expected: something else ran, ratios above are suspect")
        elif self.after[0] > self.max_load:
            line += (f"\n1-min load after {self.after[0]:.2f} > --max-load {self.max_load:.2f}, about as expected"
                     " from the load before and this run's own threads")
        return line


def _fmt(load: Sequence[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def check_load(args: argparse.Namespace) -> LoadGuard:
    """Waits (--wait-load) for a quiet machine; refuses to go on above --max-load
    unless --allow-load or --quick."""
    deadline = time.monotonic() + args.wait_load
    while os.getloadavg()[0] > args.max_load and time.monotonic() < deadline:
        print(f"waiting for the load to fall: {os.getloadavg()[0]:.2f} > {args.max_load:.2f}", file=sys.stderr)
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
    by = "--allow-load" if args.allow_load else ("--quick" if getattr(args, "quick", False) else "")
    guard = LoadGuard(args.max_load, by)
    guard.heap = pin_heap(getattr(args, "heap", "default"))
    if guard.loaded and not by:  # exit status 3: refused, nothing timed
        print(
            f"refused: 1-min load average {guard.before[0]:.2f} > --max-load {args.max_load:.2f}. On a busy machine "
            "an OpenMP baseline waits at every barrier for a descheduled thread, so ratios would flatter "
            "single-threaded code. Rerun when quiet, add --wait-load 300, or pass --allow-load (ratios marked '*').",
            file=sys.stderr)
        raise SystemExit(3)
    return guard


def thread_passes(threads: Sequence[Optional[int]], reset_compiled: bool = False) -> Iterator[Optional[int]]:
    """Sets torch's thread count for each pass (None: leave it); restores it after.
    reset_compiled: each pass compiles afresh. Inductor bakes the thread
    count into its C++ code (one thread: no OpenMP region at all), and its
    FX-graph and AOTAutograd caches, in memory and on disk, are not keyed on
    it: a reset alone would load the first pass's code, so they are off."""
    import torch

    saved = torch.get_num_threads()
    no_caches = torch._inductor.config.force_disable_caches
    try:
        if reset_compiled:
            torch._inductor.config.force_disable_caches = True
        for nt in threads:
            if nt is not None:
                torch.set_num_threads(nt)
                if reset_compiled:
                    torch._dynamo.reset()
            yield nt
    finally:
        torch.set_num_threads(saved)
        torch._inductor.config.force_disable_caches = no_caches


class Stats:
    def __init__(self, wall: List[float], cpu: List[float], calls: int):
        self.walls, self.cpus, self.calls = wall, cpu, calls  # per round: s per call, CPU / wall

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu_wall(self) -> float:
        return statistics.median(self.cpus)

    @property
    def cpu_per_call(self) -> float:  # process CPU seconds per call, all threads
        return statistics.median(w * c for w, c in zip(self.walls, self.cpus))


def _calibrate(fn: Callable[[], object], sync: Callable[[], None], target_s: float) -> int:
    best = math.inf
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(1, min(10000, int(target_s / max(best, 1e-7))))


def time_interleaved(variants: Dict[str, Callable[[], object]], rounds: int, calls: Optional[int] = None,
                     warmup: int = 2, seed: int = 0, sync: Optional[Callable[[], None]] = None,
                     target_s: float = 0.01, progress: str = "") -> Dict[str, Stats]:
    """One sample of every variant per round, in a new seeded order each round
    (a call pays for what its predecessor left behind: dirty cache lines, a
    spun-down thread pool), so load changes and neighbours hit all alike.
    calls per sample: fixed, or None to calibrate each variant to ~target_s."""
    sync = sync or (lambda: None)
    for fn in variants.values():  # allocator, caches, lazy init, compiles
        for _ in range(warmup):
            fn()
    sync()
    inner = {n: calls or _calibrate(fn, sync, target_s) for n, fn in variants.items()}
    walls: Dict[str, List[float]] = {n: [] for n in variants}
    cpus: Dict[str, List[float]] = {n: [] for n in variants}
    names, order = list(variants), random.Random(seed)
    gc_on = gc.isenabled()
    gc.disable()  # a collection would land on whichever variant runs then
    try:
        for r in range(rounds):
            if progress:
                print(f"  {progress}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            gc.collect()  # between rounds, untimed
            order.shuffle(names)
            for n in names:
                fn, k = variants[n], inner[n]
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(k):
                    fn()
                sync()
                t, c = time.perf_counter() - t0, time.process_time() - c0
                walls[n].append(t / k)
                cpus[n].append(c / t if t > 0 else math.nan)
    finally:
        if gc_on:
            gc.enable()
    return {n: Stats(walls[n], cpus[n], inner[n]) for n in variants}


def ratio_cell(stats: Stats, base: Stats, guard: LoadGuard, digits: int = 2) -> str:
    """'0.45x (cpu/wall 1.0 vs 1.9)': stats' median over base's; '*' in front under load."""
    r = stats.median / base.median
    num = f"{r:.{digits}f}" if r >= 0.1 else f"{r:.2g}"  # 2 significant digits below 0.1
    return (f"{guard.star()}{num}x"
            f" (cpu/wall {stats.cpu_wall:.1f} vs {base.cpu_wall:.1f})")


def add_process_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", type=int, default=1,
                   help="repeat the run in N fresh processes (seeds --seed, --seed + 1, ...) and give each ratio's "
                   "median and range over them (default 1)")
    p.add_argument("--results-json", help=argparse.SUPPRESS)  # one process's medians, for the parent


def save_results(path: Optional[str], guard: LoadGuard, passes: Dict[int, Dict[str, Stats]]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"loaded": guard.loaded, "passes": {
                str(nt): {n: [st.median, st.cpu_wall, st.cpu_per_call] for n, st in stats.items()}
                for nt, stats in passes.items()}}, f)


def run_processes(args: argparse.Namespace) -> List[dict]:
    """Reruns this script --processes times, one after another, each a single
    process with its own seed; returns their medians. Each child checks the
    load itself (--max-load and --allow-load pass through) and, unless the
    load is allowed, waits at least 300 s for it to fall: the children before
    it raise the 1-minute load by their own busy threads."""
    runs = []
    allowed = args.allow_load or getattr(args, "quick", False)
    wait = str(args.wait_load if allowed else max(args.wait_load, 300.0))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            path = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, sys.argv[0], *sys.argv[1:], "--processes", "1", "--seed", str(args.seed + i),
                   "--wait-load", wait, "--results-json", path]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            for line in done.stdout.splitlines():
                if line.startswith(("load average", "WARNING", "1-min load")):
                    print(f"process {i + 1}: {line}")
            if done.returncode != 0:
                raise SystemExit(done.returncode)
            with open(path) as f:
                runs.append(json.load(f))
    return runs


def spread_table(runs: List[dict], threads: int, base: str) -> str:
    """Rows of '| name | us | ratio median [min-max] | cpu/wall |' over the
    processes' medians; '*' in front when any process ran under load."""
    star = "*" if any(r["loaded"] for r in runs) else ""
    passes = [r["passes"][str(threads)] for r in runs]
    rows = []
    for name in passes[0]:
        us = statistics.median(p[name][0] for p in passes) * 1e6
        ratios = sorted(p[name][0] / p[base][0] for p in passes)
        cw = statistics.median(p[name][1] for p in passes)
        rows.append(f"| {name} | {us:.1f} | {star}{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
                    f" | {cw:.1f} |")
    return "\n".join(rows)
