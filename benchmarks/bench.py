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

On the GPU (run_cuda), each large case runs in the Hugging Face layout and
contiguous BHSD, both pairings, out of place (the module call) and in place,
with torch.compile(fullgraph) of the HF formula and Liger as peers; decode is
timed against one torch.add launch, with the module's host overhead.

Usage:  PYTHONPATH=python python benchmarks/bench.py [--device cpu|cuda|all]
        [--dtype fp32,bf16] [--cuda-dtype bf16,fp16,fp32] [--threads 1,2] [--repeat N] [--quick]
        [--heap default|fresh|reuse] [--markdown PATH] [--png PATH] [--max-load 0.5] [--allow-load] [--wait-load S]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import (LoadGuard, Stats, add_protocol_args, check_load, ratio_cell,  # noqa: E402
                      thread_passes, time_interleaved)

import torch  # noqa: E402

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_shape: Tuple[int, int, int, int]
    k_shape: Tuple[int, int, int, int]
    decode: bool = False


CPU_CASES = [
    Case("prefill", (1, 32, 4096, 128), (1, 8, 4096, 128)),
    Case("training", (4, 32, 1024, 128), (4, 32, 1024, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
]
# GPU: the large cases run in both layouts, both pairings, out of place and in
# place (see run_cuda); decode is timed against one torch.add launch.
CUDA_CASES = [
    Case("prefill", (1, 32, 8192, 128), (1, 8, 8192, 128)),
    Case("training", (8, 32, 2048, 128), (8, 32, 2048, 128)),
    Case("long", (1, 64, 32768, 128), (1, 8, 32768, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
]
QUICK_CASE = Case("quick", (1, 4, 64, 64), (1, 2, 64, 64))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# References (the peers). They take the complex64 table `freqs` [max_seq, D/2].


def reference_rope(x: torch.Tensor, freqs: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """The reference formula: complex multiply via view_as_complex, fp32 math."""
    batch, n_head, seq_len, head_dim = x.shape
    seq_freqs = freqs[start_pos : start_pos + seq_len]
    x_complex = torch.view_as_complex(x.float().reshape(batch, n_head, seq_len, -1, 2))
    x_rotated = x_complex * seq_freqs.unsqueeze(0).unsqueeze(0)
    return torch.view_as_real(x_rotated).reshape(batch, n_head, seq_len, head_dim).type_as(x)


def reference_rope_qk(q, k, freqs, start_pos: int = 0):
    return reference_rope(q, freqs, start_pos), reference_rope(k, freqs, start_pos)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope_qk(q, k, cos, sin):
    """Hugging Face apply_rotary_pos_emb with cos/sin [S, D] in x's dtype."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_tables(freqs: torch.Tensor, seq: int, dtype: torch.dtype, start_pos: int = 0):
    f = freqs[start_pos : start_pos + seq]
    cos = torch.cat((f.real, f.real), dim=-1).to(dtype).contiguous()
    sin = torch.cat((f.imag, f.imag), dim=-1).to(dtype).contiguous()
    return cos, sin


# --------------------------------------------------------------------------
# Timing


class Timer:
    """The device's sync, for the protocol's wall-clock samples."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# --------------------------------------------------------------------------
# Peers for one case


def try_compile(fn, device: str):
    try:
        import torch._dynamo  # noqa: F401

        return torch.compile(fn, dynamic=False, fullgraph=False)
    except Exception as e:  # pragma: no cover - depends on the toolchain
        log(f"  torch.compile unavailable: {e!r}")
        return None


def liger_fn():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:
        return None
    return liger_rotary_pos_emb


def build_peers(
    case: Case, dtype: torch.dtype, device: str, compile_refs: bool
) -> Tuple[Dict[str, Callable[[], object]], Dict[str, str]]:
    """Returns ({name: fn}, {name: note}). Also checks that ours agrees with
    the references, so a wrong kernel can never post a good time."""
    import rotary  # noqa: F401  (registers torch.ops.rotary)

    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(case.q_shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    k = torch.randn(case.k_shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    seq, head_dim = case.q_shape[2], case.q_shape[3]
    start_pos = 7 if case.decode else 0
    freqs = rotary.freqs_table(head_dim, start_pos + seq).to(device)
    cos, sin = hf_tables(freqs, seq, dtype, start_pos)
    op = torch.ops.rotary.apply_rope_qk

    fns: Dict[str, Callable[[], object]] = {}
    notes: Dict[str, str] = {}
    fns["clone"] = lambda: (q.clone(), k.clone())
    if case.decode:
        fns["add"] = lambda: (torch.add(q, q), torch.add(k, k))
    fns["ours"] = lambda: op(q, k, freqs, start_pos, True)
    fns["ours_half"] = lambda: op(q, k, freqs, start_pos, False)
    # In place rotates q and k again on every call; a rotation keeps their norms.
    qi, ki = q.clone(), k.clone()
    fns["ours_"] = lambda: torch.ops.rotary.apply_rope_qk_(qi, ki, freqs, start_pos, True)
    fns["reference"] = lambda: reference_rope_qk(q, k, freqs, start_pos)
    fns["rotate_half"] = lambda: hf_rope_qk(q, k, cos, sin)

    # Correctness first (bf16 tolerances cover the peers' bf16 math).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype in (torch.float32, torch.float64) else dict(atol=5e-2, rtol=2e-2)
    ref = reference_rope_qk(q, k, freqs, start_pos)
    for got, want in zip(fns["ours"](), ref):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(fns["ours_half"](), hf_rope_qk(q, k, cos, sin)):
        torch.testing.assert_close(got, want, **tol)
    fns["ours_"]()  # the first in-place call must give exactly the out-of-place result
    for got, want in zip((qi, ki), fns["ours"]()):
        assert torch.equal(got, want), "apply_rope_qk_ differs from apply_rope_qk"

    if compile_refs:
        c_reference = try_compile(reference_rope_qk, device)
        c_hf = try_compile(hf_rope_qk, device)
        for name, cfn, args, want in (
            ("compile(reference)", c_reference, (q, k, freqs, start_pos), ref),
            ("compile(rotate_half)", c_hf, (q, k, cos, sin), None),
        ):
            if cfn is None:
                continue
            log(f"  compiling {name} ...")
            t0 = time.perf_counter()
            try:
                out = cfn(*args)
                if want is not None:
                    for got, w in zip(out, want):
                        torch.testing.assert_close(got, w, **tol)
            except Exception as e:  # pragma: no cover - depends on the toolchain
                log(f"  {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                notes[name] = "failed"
                continue
            log(f"  compiled {name} in {time.perf_counter() - t0:.1f} s")
            fns[name] = (lambda f=cfn, a=args: f(*a))

    if device == "cuda":
        liger = liger_fn()
        if liger is not None:
            # Liger wants cos/sin [1, S, D]; it rotates half (NeoX) pairs.
            lc, ls = cos.unsqueeze(0), sin.unsqueeze(0)
            fns["liger"] = lambda: liger(q, k, lc, ls)
    return fns, notes


# --------------------------------------------------------------------------
# Tables

# Peers compared with ours interleaved / ours half (same pairing convention).
HALF_PEERS = ("rotate_half", "compile(rotate_half)", "liger")


def case_bytes(case: Case, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in case.q_shape:
        n *= s
    m = 1
    for s in case.k_shape:
        m *= s
    return 2 * (n + m) * elem


def fmt_time(s: float) -> str:
    if s >= 1e-1:
        return f"{s * 1e3:.1f} ms"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


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
        return f"{self.device} {self.case.name} {self.dtype}{t}: q {list(q)} k {list(k)}"

    def ours_for(self, peer: str) -> str:
        return "ours_half" if peer in HALF_PEERS else "ours"

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
                speed = f"{ratio_cell(st, self.times[self.ours_for(name)], guard)} (vs {self.ours_for(name)})"
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
    except Exception:
        return  # optional: skip silently
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
# GPU matrix: every large case in the Hugging Face layout ([B, S, H, D] viewed
# as [B, H, S, D]) and contiguous BHSD, both pairings, ours out of place (the
# RotaryEmbedding module call) and in place (apply_rope_qk_), against clone,
# torch.compile(fullgraph) of the HF rotate_half formula and Liger, all timed
# in one round-robin group per (case, dtype, layout).

CUDA_LAYOUTS = ("hf", "bhsd")
CUDA_COLUMNS = (
    ("ours", "ours"),
    ("ours_half", "ours half"),
    ("ours_", "ours in place"),
    ("ours_half_", "ours half in place"),
    ("compile(hf)", "compile(HF)"),
    ("liger", "Liger"),
)


def cuda_heads(shape, layout: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    b, h, s, d = shape
    if layout == "hf":
        return torch.randn((b, s, h, d), generator=gen, device=gen.device, dtype=dtype).transpose(1, 2)
    return torch.randn((b, h, s, d), generator=gen, device=gen.device, dtype=dtype)


def cuda_group(case: Case, dtype: torch.dtype, layout: str, compile_refs: bool, device: str = "cuda"):
    """({name: fn}, {name: note}) for one row; checks ours against the eager
    references first, so a wrong kernel can never post a good time."""
    import rotary

    gen = torch.Generator(device=device).manual_seed(0)
    q = cuda_heads(case.q_shape, layout, dtype, gen)
    k = cuda_heads(case.k_shape, layout, dtype, gen)
    seq, head_dim = case.q_shape[2], case.q_shape[3]
    rope_i = rotary.RotaryEmbedding(head_dim, seq, interleaved=True).to(device)
    rope_h = rotary.RotaryEmbedding(head_dim, seq, interleaved=False).to(device)
    freqs = rope_i.freqs
    cos, sin = hf_tables(freqs, seq, dtype)
    inplace = torch.ops.rotary.apply_rope_qk_
    qi, ki = q.clone(), k.clone()  # clone keeps the layout (preserve_format)
    fns: Dict[str, Callable[[], object]] = {"clone": lambda: (q.clone(), k.clone())}
    notes: Dict[str, str] = {}
    fns["ours"] = lambda: rope_i(q, k)
    fns["ours_half"] = lambda: rope_h(q, k)
    fns["ours_"] = lambda: inplace(qi, ki, freqs, 0, True)
    fns["ours_half_"] = lambda: inplace(qi, ki, freqs, 0, False)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for got, want in zip(fns["ours"](), reference_rope_qk(q, k, freqs)):
        torch.testing.assert_close(got, want, **tol)
    hf_out = hf_rope_qk(q, k, cos, sin)
    for got, want in zip(fns["ours_half"](), hf_out):
        torch.testing.assert_close(got, want, **tol)
    fns["ours_"]()
    for got, want in zip((qi, ki), fns["ours"]()):
        assert torch.equal(got, want), "apply_rope_qk_ differs from apply_rope_qk"

    if compile_refs:
        torch._dynamo.reset()  # one static graph per row; never hit the recompile limit
        t0 = time.perf_counter()
        try:
            c_hf = torch.compile(hf_rope_qk, dynamic=False, fullgraph=True)
            for got, want in zip(c_hf(q, k, cos, sin), hf_out):
                torch.testing.assert_close(got, want, **tol)
            fns["compile(hf)"] = lambda: c_hf(q, k, cos, sin)
            log(f"  compiled the HF formula in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # pragma: no cover - depends on the toolchain
            notes["compile(hf)"] = f"failed: {type(e).__name__}"
    liger = liger_fn() if device == "cuda" else None
    if liger is None:
        notes["liger"] = "not installed"
    else:
        # Liger rotates half pairs in place of its (transposed) inputs: own copies.
        ql, kl = q.clone(), k.clone()
        lc, ls = cos.unsqueeze(0), sin.unsqueeze(0)
        fns["liger"] = lambda: liger(ql, kl, lc, ls)
    del hf_out
    return fns, notes


def host_us_per_call(timer: Timer, fn: Callable[[], object], calls: int = 2000) -> float:
    """Host time of one call: a loop of launches, one sync at the end (the
    GPU work of a decode call is far shorter than its host path)."""
    for _ in range(50):
        fn()
    timer.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    timer.sync()
    return t / calls * 1e6


def cuda_decode(case: Case, dtype: torch.dtype, repeat: int, timer: Timer, guard: LoadGuard, seed: int) -> str:
    import rotary

    gen = torch.Generator(device="cuda" if timer.cuda else "cpu").manual_seed(0)
    q = cuda_heads(case.q_shape, "bhsd", dtype, gen)
    k = cuda_heads(case.k_shape, "bhsd", dtype, gen)
    head_dim = case.q_shape[3]
    rope = rotary.RotaryEmbedding(head_dim, 64, interleaved=True).to(gen.device)
    freqs = rope.freqs
    op = torch.ops.rotary.apply_rope_qk
    fns = {
        "add": lambda: torch.add(q, q),
        "op": lambda: op(q, k, freqs, 7, True),
        "op_": lambda: torch.ops.rotary.apply_rope_qk_(q, k, freqs, 7, True),
        "module": lambda: rope(q, k, 7),
    }
    for got, want in zip(fns["op"](), reference_rope_qk(q, k, freqs, 7)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
    times = time_interleaved(fns, repeat, target_s=0.002, seed=seed, sync=timer.sync, progress=f"[cuda decode {dtype}]")
    host = {name: host_us_per_call(timer, fns[name]) for name in ("add", "op", "module")}
    lines = [
        f"#### cuda decode {str(dtype).replace('torch.', '')}: q {list(case.q_shape)} k {list(case.k_shape)}"
        f"{guard.marker()}",
        "",
        "| call | median per call | / torch.add | host us per call |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, label in (("add", "torch.add(q, q)"), ("op", "apply_rope_qk"), ("op_", "apply_rope_qk_"),
                        ("module", "RotaryEmbedding(q, k)")):
        h = f"{host[name]:.1f}" if name in host else "-"
        cell = ratio_cell(times[name], times["add"], guard)
        lines.append(f"| {label} | {fmt_time(times[name].median)} | {cell} | {h} |")
    lines.append("")
    lines.append(f"module host overhead over the op: {host['module'] - host['op']:.1f} us per call")
    return "\n".join(lines) + "\n"


def run_cuda(args: argparse.Namespace, timer: Timer, wanted, compile_refs: bool, out_text: List[str],
             guard: LoadGuard, cases: Sequence[Case] = CUDA_CASES) -> None:
    dtypes = [d.strip() for d in args.cuda_dtype.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown --cuda-dtype {d!r}; choose from {', '.join(DTYPES)}")
    repeat = args.repeat or 25
    summary = []

    def emit(md: str) -> None:
        print(md, flush=True)
        out_text.append(md)

    device = "cuda" if timer.cuda else "cpu"  # cpu: a smoke run of this code only
    for case in cases:
        if case.name not in wanted:
            continue
        for dname in dtypes:
            dtype = DTYPES[dname]
            if case.decode:
                emit(cuda_decode(case, dtype, repeat, timer, guard, args.seed))
                continue
            nbytes = case_bytes(case, dtype)
            lines = [
                f"#### cuda {case.name} {dname}: q {list(case.q_shape)} k {list(case.k_shape)} (time / clone)"
                f"{guard.marker()}",
                "",
                "| layout | clone | clone GB/s | " + " | ".join(label for _, label in CUDA_COLUMNS) + " |",
                "| --- | ---: | ---: |" + " ---: |" * len(CUDA_COLUMNS),
            ]
            for layout in CUDA_LAYOUTS:
                progress = f"[cuda {case.name} {dname} {layout}]"
                log(f"{progress} building peers")
                fns, notes = cuda_group(case, dtype, layout, compile_refs, device)
                times = time_interleaved(fns, repeat, target_s=0.002, seed=args.seed, sync=timer.sync,
                                         progress=progress)
                del fns
                if timer.cuda:
                    torch.cuda.empty_cache()
                clone = times["clone"]
                cells = []
                for name, _ in CUDA_COLUMNS:
                    cells.append(ratio_cell(times[name], clone, guard) if name in times else notes.get(name, "-"))
                lines.append(f"| {layout} | {fmt_time(clone.median)} | {nbytes / clone.median / 1e9:.0f} | "
                             + " | ".join(cells) + " |")
                ours = max(times[n].median for n in ("ours", "ours_half", "ours_", "ours_half_")) / clone.median
                peers = [times[n].median / clone.median for n in ("compile(hf)", "liger") if n in times]
                summary.append((f"{case.name} {dname} {layout}", ours, min(peers) if peers else None))
            emit("\n".join(lines) + "\n")
    if summary:
        lines = [f"#### cuda summary: our slowest column vs the fastest peer (time / clone){guard.marker()}", "",
                 "| row | ours (worst of 4) | best peer | ours <= 1.05 | ours faster than every peer |",
                 "| --- | ---: | ---: | :---: | :---: |"]
        for row, ours, peer in summary:
            st = guard.star()
            p = f"{st}{peer:.2f}" if peer is not None else "-"
            beat = "-" if peer is None else ("yes" if ours < peer else "no")
            lines.append(f"| {row} | {st}{ours:.2f} | {p} | {'yes' if ours <= 1.05 else 'no'} | {beat} |")
        emit("\n".join(lines) + "\n")


# --------------------------------------------------------------------------
# Main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                   help="all = cpu, plus cuda when torch.cuda.is_available() (default)")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32,bf16,fp16,fp64 (default fp32,bf16)")
    p.add_argument("--cuda-dtype", default="bf16,fp16,fp32",
                   help="dtypes of the GPU cases, comma list (default bf16,fp16,fp32)")
    p.add_argument("--cases", default="prefill,training,decode", help="comma list of case names")
    p.add_argument("--repeat", type=int, default=None, help="timed rounds per case (default 9 CPU, 25 CUDA)")
    p.add_argument("--quick", action="store_true",
                   help="one tiny CPU case, few rounds, no torch.compile: a smoke run for CI")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
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
