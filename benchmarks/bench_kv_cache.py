"""Fused RoPE + KV-cache write against its baselines, all timed in one run.

Per shape, the median time of one step of:
  fused     rotary.apply_rope_with_kv_cache_ (q, k rotated in place; k, v into the cache)
  unfused   rotary.apply_rope_qk_ + two index_copy_ into the cache
  compiled  torch.compile(fullgraph=True) of the eager formula (rotate_half
            on a cos/sin table, in place) + two index_copy_
  compiled put  the same with index_put_ (cache[slots] = rows) instead, which
            Inductor writes in place (with index_copy_, a decode step here
            costs about as much as copying both caches)
  floor     the copy floor: copy_ of q+k+v bytes and of k bytes (reads and
            writes q + 2k + v, what the step must move at least)
  prologue  rotary.apply_qk_norm_rope_with_kv_cache_ (q/k RMSNorm, RoPE and
            the cache write: one launch on CUDA), against
  prologue unfused  rotary.apply_qk_norm_rope_ + the same two index_copy_
  flashinfer  FlashInfer's fused RoPE + paged append (RopeQuantizeAppendPagedKVCache,
            scale 1, q to its own buffer), paged shapes on CUDA, when
            benchmarks/peers/build_flashinfer.py built it
  fp8       the fused call into float8_e4m3fn caches (per-tensor k_scale and
            v_scale), against rotary.apply_rope_qk_ + torch's
            (x / scale).clamp(-448, 448).to(float8_e4m3fn) of k and v + the
            two index_copy_ (of the bytes)
  rows copy  (CUDA) the fused launch with its copy blocks switched off
            (rotary._C._cuda_set_copy_blocks): the rope rows copy v after
            their rotation, as before copy blocks (a decode step's A/B)
q, k, v are token-major ([batch, seq, heads, head_dim], layout BSHD), as a
projection leaves them. Shapes: decode B=64, 32/8 heads, D=128, paged NHD
block 16 (one slot per sequence); prefill one sequence of S tokens into a
paged NHD cache and into a contiguous BHSD one.
Timed with benchmarks/protocol.py: every variant once per round in a seeded
shuffled order, medians, CPU time / wall next to each ratio, one pass per
--threads count (CPU), refused on a loaded machine. On CUDA, --graph
captures each variant's calls of a sample in one CUDA graph and times its
replay: GPU time, without the host's launch path (a decode step's GPU work
is far shorter than it). A variant that cannot be captured is left out and
named.

    PYTHONPATH=python .venv/bin/python benchmarks/bench_kv_cache.py [--threads 1,2] [--dtype bfloat16]
        [--device cpu] [--no-compile] [--quick] [--graph]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import flashinfer_ops, flashinfer_table, without_copy_blocks  # noqa: E402
from protocol import add_protocol_args, check_load, ratio_cell, thread_passes, time_interleaved  # noqa: E402

import torch  # noqa: E402

import rotary  # noqa: E402


def make(device, dtype, B, S, Hq, Hk, D, kv_layout, block, start):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(B, S, Hk, D, generator=g).to(device, dtype)
    v = torch.randn(B, S, Hk, D, generator=g).to(device, dtype)
    if kv_layout == "NHD":
        blocks = B * ((start + S + block - 1) // block) + 8
        kc = torch.zeros(blocks, block, Hk, D, dtype=dtype, device=device)
        # each sequence owns a run of blocks; its tokens go at start .. start+S-1 within them
        per = (start + S + block - 1) // block
        slots = torch.stack([b * per * block + start + torch.arange(S) for b in range(B)]).reshape(-1).to(device)
        extra = dict(slot_mapping=slots, kv_layout="NHD")
    else:
        kc = torch.zeros(B, Hk, start + S, D, dtype=dtype, device=device)
        slots = torch.arange(start, start + S, device=device)
        extra = dict(kv_layout="BHSD")
    return q, k, v, kc, kc.clone(), slots, extra


def cases(device, dtype, B, S, Hq, Hk, D, kv_layout, block=16, start=100, compile_=True):
    q, k, v, kc, vc, slots, extra = make(device, dtype, B, S, Hq, Hk, D, kv_layout, block, start)
    f = rotary.freqs_table(D, start + S + 1).to(device)
    cos, sin = f.real.contiguous(), f.imag.contiguous()
    pos = torch.arange(start, start + S, device=device)

    def write_put(kc, vc, k, v):  # index_put_: Inductor writes it in place
        if kv_layout == "NHD":
            kc.view(-1, Hk, D)[slots] = k.reshape(-1, Hk, D)
            vc.view(-1, Hk, D)[slots] = v.reshape(-1, Hk, D)
        else:
            kc[:, :, slots] = k.transpose(1, 2)
            vc[:, :, slots] = v.transpose(1, 2)

    def write(kc, vc, k, v):
        if kv_layout == "NHD":
            kc.view(-1, Hk, D).index_copy_(0, slots, k.reshape(-1, Hk, D))
            vc.view(-1, Hk, D).index_copy_(0, slots, v.reshape(-1, Hk, D))
        else:
            kc.index_copy_(2, slots, k.transpose(1, 2))
            vc.index_copy_(2, slots, v.transpose(1, 2))

    def fused():
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, start, False, layout="BSHD", **extra)

    def unfused():
        rotary.apply_rope_qk_(q, k, f, start, False, layout="BSHD")
        write(kc, vc, k, v)

    def eager(q, k, v, kc, vc, put=False):
        c = cos[pos][None, :, None, :]
        s = sin[pos][None, :, None, :]
        for x in (q, k):
            x1, x2 = x[..., : D // 2].float(), x[..., D // 2 :].float()
            x.copy_(torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1))
        (write_put if put else write)(kc, vc, k, v)

    # The prologue rows run in place on their own q and k, each call on the
    # last one's output, so with unit weights: a weight below 1 would shrink
    # its dims every call, into subnormals (which slowed every variant that
    # shared q and k about 20x on the CPU) and zeros.
    qp, kp = q.clone(), k.clone()
    qw = kw = torch.ones(D, dtype=dtype, device=device)

    def prologue():
        rotary.apply_qk_norm_rope_with_kv_cache_(qp, kp, v, kc, vc, f, start, False, layout="BSHD", q_weight=qw,
                                                 k_weight=kw, **extra)

    def prologue_unfused():
        rotary.apply_qk_norm_rope_(qp, kp, f, start, False, layout="BSHD", q_weight=qw, k_weight=kw)
        write(kc, vc, kp, v)

    kc8, vc8 = (torch.zeros_like(kc, dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)

    def fused_fp8():
        rotary.apply_rope_with_kv_cache_(q, k, v, kc8, vc8, f, start, False, layout="BSHD", k_scale=ks, v_scale=vs,
                                         **extra)

    def unfused_fp8():
        rotary.apply_rope_qk_(q, k, f, start, False, layout="BSHD")
        k8, v8 = ((x / sc).clamp(-448, 448).to(torch.float8_e4m3fn) for x, sc in ((k, ks), (v, vs)))
        write(kc8.view(torch.uint8), vc8.view(torch.uint8), k8.view(torch.uint8), v8.view(torch.uint8))

    fns = {"fused": fused, "unfused": unfused, "prologue": prologue, "prologue_unfused": prologue_unfused,
           "fused_fp8": fused_fp8, "unfused_fp8": unfused_fp8}
    if compile_:
        compiled_fn = torch.compile(eager, fullgraph=True, dynamic=False)
        compiled_put = torch.compile(lambda *a: eager(*a, put=True), fullgraph=True, dynamic=False)
        fns["compiled"] = lambda: compiled_fn(q, k, v, kc, vc)
        fns["compiled_put"] = lambda: compiled_put(q, k, v, kc, vc)
    # Written sources: an untouched CPU allocation reads the kernel's one zero page.
    src = torch.randn(q.numel() + 2 * k.numel(), device=device).to(dtype)
    dst, src_k, dst_k = torch.empty_like(src), torch.randn_like(k), torch.empty_like(k)

    def floor():
        dst.copy_(src)
        dst_k.copy_(src_k)

    fns["floor"] = floor
    if device == "cuda":
        fns["rows_copy"] = without_copy_blocks(fused)
    if kv_layout == "NHD" and device == "cuda":
        add_flashinfer(fns, q, k, v, kc, vc, f, start, block, extra)
    state = {"q": q, "k": k, "kc": kc, "vc": vc, "qp": qp, "kp": kp, "kc8": kc8, "vc8": vc8}
    return fns, {"q": q, "k": k, "prologue's q": qp, "prologue's k": kp}, state


def check_fused(device, dtype, kw):
    """Before anything is timed: each fused call leaves q, k and both caches
    as its unfused partner does, from fresh inputs each (fp8: one fp8 step
    apart at most, since the unfused row rounds twice, to dtype then fp8)."""
    pairs = (("fused", "unfused", ("q", "k", "kc", "vc")), ("prologue", "prologue_unfused", ("qp", "kp", "kc", "vc")),
             ("fused_fp8", "unfused_fp8", ("q", "k", "kc8", "vc8")))
    for a, b, names in pairs:
        outs = []
        for name in (a, b):
            fns, _, state = cases(device, dtype, Hq=32, Hk=8, D=128, compile_=False, **kw)
            fns[name]()
            outs.append([state[n] for n in names])
        for n, x, y in zip(names, *outs):
            if x.dtype == torch.float8_e4m3fn:
                torch.testing.assert_close(x.float(), y.float(), rtol=0.125, atol=2**-9, msg=f"{a} vs {b}: {n}")
            else:
                assert torch.equal(x, y), f"{a} vs {b}: {n} differs"


def check_inputs(title, tensors):
    """Refuse a row whose in-place inputs left the normal range during the
    timed calls (subnormals, zeros, inf or NaN): it would time the slow path
    of denormal arithmetic, not the op."""
    for name, x in tensors.items():
        xf = x.float()
        frac = ((~torch.isfinite(xf)) | (xf.abs() < torch.finfo(x.dtype).tiny)).float().mean().item()
        if frac > 1e-3:
            raise SystemExit(f"{title}: {frac:.1%} of {name} is subnormal, zero or not finite after the timed calls")


def add_flashinfer(fns, q, k, v, kc, vc, f, start, block, extra):
    """FlashInfer's fused step (RoPE on q and k, k and v appended to the paged
    cache; q to a second buffer, where ours rotates it in place), after a
    check that it fills the cache and q as ours does."""
    ops, why = flashinfer_ops()
    if ops is None:
        print(f"  flashinfer: {why}; left out")
        return
    B, S, Hq, D = q.shape
    dev = q.device
    per = (start + S + block - 1) // block  # pages per sequence, as make() lays them out
    indptr = (torch.arange(B + 1, device=dev) * per).int()
    indices = torch.arange(B * per, device=dev).int()
    batch = torch.arange(B, device=dev).repeat_interleave(S).int()
    positions = (start + torch.arange(S, device=dev)).repeat(B).int()
    pos_ids = positions.long()
    table = flashinfer_table(f)
    rows = lambda x: x.reshape(B * S, x.shape[2], D)  # noqa: E731 (token-major views)
    q_out = torch.empty_like(rows(q))

    def step(q, k, v, kc, vc, q_out):
        ops.flashinfer_rope_append_paged(rows(q), rows(k), rows(v), q_out, kc, vc, indptr, indices, batch, positions,
                                         table, pos_ids, False, 1.0, 1.0)

    mine = [t.clone() for t in (q, k, v, kc, vc)]
    # Ours with make()'s own slots: the check also holds FlashInfer's pages to them.
    rotary.apply_rope_with_kv_cache_(*mine, f, start, False, layout="BSHD", **extra)
    theirs = [t.clone() for t in (q, k, v, kc, vc)]
    theirs_q = torch.empty_like(q_out)
    step(*theirs, theirs_q)
    tol = dict(atol=2e-2, rtol=2e-2)
    try:
        torch.testing.assert_close(theirs_q, rows(mine[0]), **tol)
        torch.testing.assert_close(theirs[3], mine[3], **tol)
        torch.testing.assert_close(theirs[4], mine[4], **tol)
    except AssertionError as e:
        print(f"  flashinfer: differs from ours ({str(e).splitlines()[0][:120]}); left out")
        return
    fns["flashinfer"] = lambda: step(q, k, v, kc, vc, q_out)


def graphed(fns, calls):
    """Each variant as the replay of one CUDA graph of `calls` calls."""
    out = {}
    for name, fn in fns.items():
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture stream (compiles, allocations)
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
            out[name] = graph.replay
        except Exception as e:  # noqa: BLE001 (a peer's failure leaves it out, named)
            torch.cuda.synchronize()
            print(f"  {name}: not captured in a CUDA graph ({type(e).__name__}: {str(e)[:120]}); left out")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill", type=int, default=0, help="prefill tokens (default 2048 CPU, 8192 GPU)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--quick", action="store_true", help="S=64, 3 rounds, few calls, no compile: a smoke run")
    ap.add_argument("--graph", action="store_true", help="CUDA: time CUDA-graph replays (GPU time)")
    add_protocol_args(ap)
    a = ap.parse_args()
    if a.graph and a.device != "cuda":
        ap.error("--graph needs --device cuda")
    if a.quick:
        a.prefill, a.rounds, a.no_compile = a.prefill or 64, 3, True
    guard = check_load(a)
    dtype = getattr(torch, a.dtype)
    S = a.prefill or (8192 if a.device == "cuda" else 2048)
    few = 10 if a.quick else 1  # calls per sample: fewer decode calls, more of the tiny prefill
    shapes = [
        ("decode B=64 S=1 32/8 heads D=128, paged NHD 16", dict(B=64, S=1, kv_layout="NHD"), 200 // few),
        (f"prefill B=1 S={S} 32/8 heads D=128, paged NHD 16", dict(B=1, S=S, kv_layout="NHD"), 5 * few),
        (f"prefill B=1 S={S} 32/8 heads D=128, contiguous BHSD", dict(B=1, S=S, kv_layout="BHSD"), 5 * few),
    ]
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    print(guard.header())
    cols = ("unfused", "compiled", "compiled_put", "floor", "flashinfer", "rows_copy")
    for nt in thread_passes([None] if cuda else a.threads, reset_compiled=not a.no_compile):
        where = f"{a.device}" + (f", {torch.cuda.get_device_name()}" if cuda else f", {nt} thread(s)")
        print(f"\n{a.dtype}, {where}, median of {a.rounds} interleaved rounds{guard.marker()}\n")
        print("| shape | fused us | unfused us | compiled us | compiled put us | floor us | FlashInfer us "
              "| rows copy us | fused/unfused | fused/compiled | fused/compiled put | fused/floor | fused/FlashInfer "
              "| fused/rows copy | prologue us | prologue unfused us | prologue/unfused | fp8 fused us "
              "| fp8 unfused us | fp8 fused/unfused |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for title, kw, calls in shapes:
            check_fused(a.device, dtype, kw)
            fns, inputs, _ = cases(a.device, dtype, Hq=32, Hk=8, D=128, compile_=not a.no_compile, **kw)
            per = 1
            if a.graph:
                fns, per, calls = graphed(fns, calls), calls, 1
            t = time_interleaved(fns, a.rounds, calls=calls, warmup=3, seed=a.seed, sync=sync)
            check_inputs(title, inputs)
            us = " | ".join(f"{t[n].median * 1e6 / per:.1f}" if n in t else "-" for n in ("fused",) + cols)
            ratios = " | ".join(ratio_cell(t["fused"], t[n], guard) if n in t else "-" for n in cols)
            pro = " | ".join(f"{t[n].median * 1e6 / per:.1f}" if n in t else "-" for n in ("prologue", "prologue_unfused"))
            pro_ratio = ratio_cell(t["prologue"], t["prologue_unfused"], guard) if "prologue" in t else "-"
            fp8 = " | ".join(f"{t[n].median * 1e6 / per:.1f}" if n in t else "-" for n in ("fused_fp8", "unfused_fp8"))
            fp8_ratio = ratio_cell(t["fused_fp8"], t["unfused_fp8"], guard) if "fused_fp8" in t else "-"
            print(f"| {title} | {us} | {ratios} | {pro} | {pro_ratio} | {fp8} | {fp8_ratio} |")
    print("\n" + guard.finish())


if __name__ == "__main__":
    main()
