#!/usr/bin/env python3
"""Benchmark torch.ops.rotary.apply_rope_qk against its peers, measured in one run.

RoPE is memory-bound: it reads q and k once and writes them once. Every case is
therefore reported as median time, bandwidth (bytes of q and k read + written)
and ratios against peers timed in the same run, round-robin, so that a noisy
machine moves all of them together (benchmarks/protocol.py: load guard,
interleaved seeded rounds, medians, CPU time / wall next to every ratio, one
pass per --threads count):

  clone        q.clone() and k.clone(): the memory floor
  reference    eager reference formula: view_as_complex(q) * freqs[pos], per tensor
  rotate_half  eager Hugging Face reference: x * cos + rotate_half(x) * sin with
               cat'ed [S, D] tables in x's dtype (ours runs interleaved=False)
  compile(..)  torch.compile of the two references (CPU: inductor C++ backend;
               CUDA: triton), compiled once and warmed up before timing
  liger        Liger's fused rope (CUDA, only when liger_kernel imports)
  add          torch.add(q, q) + torch.add(k, k), decode only: the dispatcher floor
  ours_        torch.ops.rotary.apply_rope_qk_ (in place, no output allocation)

Allocator: by default the process keeps glibc's defaults, as a user's does.
--heap fresh and --heap reuse (benchmarks/protocol.py) pin the two regimes
those defaults mix: every large output on fresh pages (page faults on every
call, in every peer that allocates, clone included), or on reused, mapped
pages. Report both: a ratio taken under the defaults depends on which regime
each peer's blocks happened to land in.

On the GPU (bench_cuda.py), each large case runs in the Hugging Face layout
and contiguous BHSD, both pairings, out of place (the module call) and in
place, with torch.compile(fullgraph) of the HF formula, Liger and FlashInfer
(when benchmarks/peers/build_flashinfer.py built it) as peers; decode is timed
against one torch.add launch, with the module's host overhead.

Usage:  PYTHONPATH=python python benchmarks/bench.py [--device cpu|cuda|all]
        [--dtype fp32,bf16] [--cuda-dtype bf16,fp16,fp32] [--threads 1,2] [--repeat N] [--quick] [--impls ours,...]
        [--heap default|fresh|reuse] [--markdown PATH] [--png PATH] [--max-load 0.5] [--allow-load] [--wait-load S]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (CPU_CASES, CUDA_CASES, DTYPES, QUICK_CASE, Case, Timer, build_peers,  # noqa: E402
                          case_bytes, fmt_time, log)
from protocol import (LoadGuard, Stats, add_protocol_args, check_load, ratio_cell,  # noqa: E402
                      thread_passes, time_interleaved)

import torch  # noqa: E402


# --------------------------------------------------------------------------
# Tables

# Peers compared with ours interleaved / ours half (same pairing convention).
HALF_PEERS = ("rotate_half", "compile(rotate_half)", "liger")


def ours_for(peer: str) -> str:
    """The call of ours a peer is compared with: the same pairing."""
    return "ours_half" if peer in HALF_PEERS else "ours"


@dataclasses.dataclass
class Result:
    device: str
    case: Case
    dtype: str
    threads: Optional[int]
    times: Dict[str, Stats]
    notes: Dict[str, str]

    @property
    def title(self) -> str:
        q, k = self.case.q_shape, self.case.k_shape
        t = f", threads={self.threads}" if self.threads is not None else ""
        layout = " (memory [B, S, H, D])" if self.case.hf_layout else ""
        return f"{self.device} {self.case.name} {self.dtype}{t}: q {list(q)} k {list(k)}{layout}"

    def markdown(self, guard: LoadGuard) -> str:
        nbytes = case_bytes(self.case, DTYPES[self.dtype])
        clone = self.times["clone"]
        lines = [
            f"#### {self.title}{guard.marker()}",
            "",
            "| impl | median | GB/s | time / clone | ours speedup vs it |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, st in self.times.items():
            t = st.median
            if name.startswith("ours") or name in ("clone", "add"):
                speed = "-"
            else:
                speed = f"{ratio_cell(st, self.times[ours_for(name)], guard)} (vs {ours_for(name)})"
            label = {
                "ours": "ours (interleaved)",
                "ours_half": "ours (interleaved=False)",
                "ours_": "ours in place (apply_rope_qk_)",
                "add": "torch.add q,k (floor)",
                "clone": "clone q,k (floor)",
            }.get(name, name)
            lines.append(
                f"| {label} | {fmt_time(t)} | {nbytes / t / 1e9:.1f} | {ratio_cell(st, clone, guard)} | {speed} |"
            )
        for name, note in self.notes.items():
            lines.append(f"| {name} | {note} | | | |")
        if "add" in self.times:
            lines.append("")
            lines.append(
                f"decode: ours / (torch.add(q,q) + torch.add(k,k)) = "
                f"{ratio_cell(self.times['ours'], self.times['add'], guard)}"
            )
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Header


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except Exception:
        pass
    return platform.processor() or platform.machine()


def header(devices: Sequence[str], guard: LoadGuard) -> str:
    lines = [
        "## rotary benchmark",
        "",
        f"- machine: {platform.node()} {platform.machine()}, CPU `{cpu_model()}`"
        f" ({os.cpu_count()} logical CPUs), processor `{platform.processor() or '?'}`",
        f"- torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()},"
        f" default threads {torch.get_num_threads()}",
    ]
    lines.append(f"- {guard.header()}")
    if "cuda" in devices:
        p = torch.cuda.get_device_properties(0)
        lines.append(
            f"- GPU {torch.cuda.get_device_name(0)} ({p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
        )
    lines.append(
        "- times are medians of interleaved rounds (every impl once per round, seeded shuffle);"
        " GB/s counts q and k read + written;"
        " `ours speedup vs it` = peer time / our time (rotate_half peers vs interleaved=False);"
        " cpu/wall = process CPU time / wall of each side (~1.0: one busy thread, ~2.0: two)"
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# PNG


def write_png(results: List[Result], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # optional, but asked for: say it was not written
        print(f"--png {path}: not written ({type(e).__name__}: {e}); pip install matplotlib", file=sys.stderr)
        return
    peers = []
    for r in results:
        for name in r.times:
            if name not in peers:
                peers.append(name)
    labels = [f"{r.device} {r.case.name}\n{r.dtype}" + (f" t{r.threads}" if r.threads else "") for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(results)), 5))
    width = 0.8 / max(1, len(peers))
    for i, name in enumerate(peers):
        xs = [j + i * width for j in range(len(results))]
        ys = [r.times[name].median / r.times["clone"].median if name in r.times else float("nan")
              for r in results]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("time / clone (lower is better)")
    ax.set_title("rotary.apply_rope_qk vs peers")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote {path}")


# --------------------------------------------------------------------------
# Main


def pick_impls(fns: Dict[str, object], impls: str) -> Dict[str, object]:
    wanted = {n.strip() for n in impls.split(",") if n.strip()}
    if wanted - set(fns):
        raise SystemExit(f"unknown --impls {', '.join(sorted(wanted - set(fns)))}; choose from {', '.join(fns)}")
    wanted |= {"clone", "add"} | {ours_for(n) for n in wanted if not n.startswith("ours")}
    return {n: f for n, f in fns.items() if n in wanted}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                   help="all = cpu, plus cuda when torch.cuda.is_available() (default)")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32,bf16,fp16,fp64 (default fp32,bf16)")
    p.add_argument("--cuda-dtype", default="bf16,fp16,fp32",
                   help="dtypes of the GPU cases, comma list (default bf16,fp16,fp32)")
    p.add_argument("--cases", default="prefill,prefill_hf,training,decode", help="comma list of case names")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds per case (default 9 CPU, 25 CUDA)")
    p.add_argument("--quick", action="store_true",
                   help="one tiny CPU case, few rounds, no torch.compile: a smoke run for CI")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    p.add_argument("--impls", default=None,
                   help="comma list of the implementations to time, e.g. ours,ours_half,ours_ (CPU; clone, and "
                        "add at decode, are always timed; a peer brings the ours it is compared with): fewer "
                        "cache-flushing peers between our calls, for an A/B of two builds")
    p.add_argument("--reuse-heap", action="store_true", help="deprecated: --heap reuse")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables to PATH")
    p.add_argument("--png", metavar="PATH", help="bar chart of time/clone per peer (needs matplotlib)")
    add_protocol_args(p)
    args = p.parse_args(argv)
    if args.reuse_heap:
        args.heap = "reuse"
    return args


def run(args: argparse.Namespace) -> List[Result]:
    guard = check_load(args)
    import rotary  # noqa: F401

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown --dtype {d!r}; choose from {', '.join(DTYPES)}")
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    known = {c.name for c in CPU_CASES + CUDA_CASES}
    if wanted - known:  # a typo would time nothing and exit 0
        raise SystemExit(f"unknown --cases {', '.join(sorted(wanted - known))}; choose from {', '.join(sorted(known))}")
    devices = []
    if args.device in ("cpu", "all"):
        devices.append("cpu")
    if args.device in ("cuda", "all"):
        if torch.cuda.is_available():
            devices.append("cuda")
        elif args.device == "cuda":
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    compile_refs = not (args.no_compile or args.quick)

    results: List[Result] = []
    out_text = [header(devices, guard)]
    print(out_text[0], flush=True)

    def emit(res: Result) -> None:
        md = res.markdown(guard)
        print(md, flush=True)
        out_text.append(md)
        results.append(res)

    for device in devices:
        timer = Timer(device)
        if device == "cuda" and not args.quick:
            from bench_cuda import run_cuda

            run_cuda(args, timer, wanted, compile_refs, out_text, guard)
            continue
        if args.quick:
            cases = [QUICK_CASE]
        else:
            cases = [c for c in (CPU_CASES if device == "cpu" else CUDA_CASES) if c.name in wanted]
        repeat = args.repeat or (3 if args.quick else (9 if device == "cpu" else 25))
        # ~10 ms samples (CPU decode runs ~hundreds of calls per sample);
        # large cases take one call per sample.
        target_s = 0.002 if args.quick else (0.01 if device == "cpu" else 0.002)
        for nt in thread_passes(args.threads if device == "cpu" else [None], reset_compiled=compile_refs):
            for dname in dtypes:
                dtype = DTYPES[dname]
                for case in cases:
                    progress = f"[{device} {case.name} {dname}" + (f" threads={nt}]" if nt else "]")
                    log(f"{progress} building peers")
                    fns, notes = build_peers(case, dtype, device, compile_refs)
                    if args.impls:
                        fns = pick_impls(fns, args.impls)
                    times = time_interleaved(fns, repeat, target_s=target_s, seed=args.seed, sync=timer.sync,
                                             progress=progress)
                    emit(Result(device, case, dname, nt, times, notes))
                    del fns
                    if device == "cuda":
                        torch.cuda.empty_cache()

    footer = guard.finish()
    print(footer, flush=True)
    out_text.append(footer + "\n")

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out_text))
        log(f"wrote {args.markdown}")
    if args.png:
        write_png(results, args.png)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
