"""The GPU half of benchmarks/bench.py (run_cuda): each large case in the
Hugging Face layout and contiguous BHSD, both pairings, out of place and in
place, against clone, torch.compile(fullgraph) of the HF formula, Liger and
FlashInfer when present; decode against one torch.add launch, with the
module's host overhead. Every peer is checked against the eager references
before it is timed, so a wrong kernel can never post a good time."""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List, Sequence

import torch

from bench_common import (CUDA_CASES, DTYPES, Case, Timer, case_bytes, flashinfer_ops, flashinfer_table, fmt_time,
                          hf_rope_qk, hf_tables, liger_fn, log, reference_rope_qk, without_l2_prefetch)
from protocol import LoadGuard, ratio_cell, time_interleaved

CUDA_LAYOUTS = ("hf", "bhsd")
CUDA_COLUMNS = (
    ("ours", "ours"),
    ("ours_half", "ours half"),
    ("ours_", "ours in place"),
    ("ours_half_", "ours half in place"),
    ("ours_nopf", "ours, no L2 prefetch"),
    ("ours_half_nopf", "ours half, no L2 prefetch"),
    ("compile(hf)", "compile(HF)"),
    ("liger", "Liger"),
    ("flashinfer", "FlashInfer half"),
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
    fns["ours_nopf"] = without_l2_prefetch(fns["ours"])
    fns["ours_half_nopf"] = without_l2_prefetch(fns["ours_half"])

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for got, want in zip(fns["ours"](), reference_rope_qk(q, k, freqs)):
        torch.testing.assert_close(got, want, **tol)
    hf_out = hf_rope_qk(q, k, cos, sin)
    for got, want in zip(fns["ours_half"](), hf_out):
        torch.testing.assert_close(got, want, **tol)
    fns["ours_"]()
    for got, want in zip((qi, ki), fns["ours"]()):
        assert torch.equal(got, want), "apply_rope_qk_ differs from apply_rope_qk"
    for name, plain in (("ours_nopf", "ours"), ("ours_half_nopf", "ours_half")):
        for got, want in zip(fns[name](), fns[plain]()):
            assert torch.equal(got, want), f"{name} differs from {plain}"

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
    liger, why = liger_fn() if device == "cuda" else (None, "not installed")
    if liger is None:
        notes["liger"] = why
    else:
        # Liger rotates half pairs in place of its (transposed) inputs: own copies.
        ql, kl = q.clone(), k.clone()
        lc, ls = cos.unsqueeze(0), sin.unsqueeze(0)
        fns["liger"] = lambda: liger(ql, kl, lc, ls)
    add_flashinfer(fns, notes, q, k, freqs, hf_out, tol, device)
    del hf_out
    return fns, notes


def token_major(q: torch.Tensor, k: torch.Tensor):
    """q and k [B, H, S, D] as [B * S, H, D] views (FlashInfer's rows: one
    stride per token), or None where they are no such view (BHSD, B > 1)."""
    out = []
    for x in (q, k):
        b, h, s, d = x.shape
        t = x.transpose(1, 2)
        if b > 1 and not t.is_contiguous():
            return None
        out.append(t.view(b * s, h, d))
    return out


def add_flashinfer(fns, notes, q, k, freqs, want, tol, device: str) -> None:
    """FlashInfer's apply_rope_with_cos_sin_cache kernel, half pairs, out of
    place (new outputs per call, as its Python API), on token-major views of
    q and k: the HF layout, or BHSD with one sequence."""
    ops, why = flashinfer_ops() if device == "cuda" else (None, "CUDA only")
    if ops is None:
        notes["flashinfer"] = why
        return
    if q.dtype not in (torch.float16, torch.bfloat16):  # its kernels are instantiated for these alone
        notes["flashinfer"] = "16-bit data only"
        return
    views = token_major(q, k)
    if views is None:
        notes["flashinfer"] = "needs token-major rows"
        return
    qt, kt = views
    b, h, s, d = q.shape
    table = flashinfer_table(freqs)
    pos = torch.arange(s, device=q.device).repeat(b)

    def run():
        q_out, k_out = torch.empty_like(qt), torch.empty_like(kt)
        ops.flashinfer_rope(qt, kt, q_out, k_out, table, pos, False)
        return q_out, k_out

    for got, w in zip(run(), want):
        try:
            torch.testing.assert_close(got.view(b, s, -1, d).transpose(1, 2), w, **tol)
        except AssertionError as e:
            notes["flashinfer"] = "wrong result"
            log(f"  FlashInfer differs from the HF formula: {str(e).splitlines()[0][:160]}")
            return
    fns["flashinfer"] = run


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
                peers = [times[n].median / clone.median for n in ("compile(hf)", "liger", "flashinfer") if n in times]
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


