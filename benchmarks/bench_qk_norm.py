"""The attention prologue on the CPU: q/k RMSNorm + RoPE, fused against unfused.

q [B, S, Hq, D] and k [B, S, Hk, D] as a projection writes them (BSHD),
Qwen3's per-head norm with a weight, half-split pairs. Variants, in the same
interleaved rounds (benchmarks/protocol.py: seeded order, medians, CPU time /
wall, one pass per --threads count, refused on a loaded machine):

- copy floor: q.clone() and k.clone();
- unfused HF: transformers' RMSNorm code (float, pow, mean, rsqrt, cast,
  weight) on q and k, then rotary.apply_rope_qk;
- unfused F.rms_norm: torch.nn.functional.rms_norm, then rotary.apply_rope_qk;
- torch.compile of the model's own code (HF norm, then rotate_half RoPE);
- fused: rotary.apply_qk_norm_rope (out of place) and apply_qk_norm_rope_;
- q as fp8 (a per-head scale): the fused call with q_fp8_scale, against the
  fused call followed by torch's (q / scale).clamp(-448, 448).to(fp8);
- OLMo2's norm over all heads of a token (norm="heads"), unfused (HF's
  RMSNorm over the flattened heads, then rotary.apply_rope_qk) and fused;
- the fused call with Qwen3-VL's interleaved M-RoPE positions (N-D ids).

    PYTHONPATH=python .venv/bin/python benchmarks/bench_qk_norm.py [--dtype bfloat16] [--quick]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import without_l2_prefetch  # noqa: E402
from protocol import add_protocol_args, check_load, ratio_cell, thread_passes, time_interleaved  # noqa: E402

import torch  # noqa: E402

import rotary  # noqa: E402


# (name, B, S, Hq, Hk, D); benchmarks/launch_model.py models the CUDA ones.
CPU_SHAPES = [("prefill", 1, 2048, 16, 8, 128), ("decode", 64, 1, 16, 8, 128)]
CUDA_SHAPES = [("prefill", 1, 8192, 32, 8, 128), ("decode", 64, 1, 16, 8, 128)]


def hf_norm(x, w, eps=1e-6):  # transformers' Qwen3RMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def model_code(q, k, qw, kw, cos, sin):  # norm, transpose, rotate_half RoPE, as the model runs it
    q, k = hf_norm(q, qw).transpose(1, 2), hf_norm(k, kw).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def cases(B, S, Hq, Hk, D, dtype, compiled, device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(B, S, Hk, D, generator=g).to(device, dtype)
    qw = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    start = 7
    freqs = rotary.freqs_table(D, start + S + 1).to(device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([torch.arange(start, start + S, dtype=torch.float32)[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(device, dtype)[None, None], emb.sin().to(device, dtype)[None, None]
    rope = dict(interleaved=False, layout="BSHD")
    qi, ki, ones = q.clone(), k.clone(), torch.ones(D, dtype=dtype, device=device)
    out = {
        "copy floor (2x clone)": lambda: (q.clone(), k.clone()),
        "unfused HF norm + rotary": lambda: rotary.apply_rope_qk(hf_norm(q, qw), hf_norm(k, kw), freqs, start, **rope),
        "unfused F.rms_norm + rotary": lambda: rotary.apply_rope_qk(
            torch.nn.functional.rms_norm(q, (D,), qw, 1e-6), torch.nn.functional.rms_norm(k, (D,), kw, 1e-6),
            freqs, start, **rope),
        "fused apply_qk_norm_rope": lambda: rotary.apply_qk_norm_rope(
            q, k, freqs, start, q_weight=qw, k_weight=kw, **rope),
        # On its own output each call, so with unit weights: a weight < 1 would
        # shrink that dim every call, into subnormals.
        "fused apply_qk_norm_rope_ (in place)": lambda: rotary.apply_qk_norm_rope_(
            qi, ki, freqs, start, q_weight=ones, k_weight=ones, **rope),
    }
    scale = torch.linspace(0.01, 0.02, Hq, device=device).view(Hq, 1)
    out["fused, then torch's fp8 quantization of q"] = lambda: (
        (rotary.apply_qk_norm_rope(q, k, freqs, start, q_weight=qw, k_weight=kw, **rope)[0] / scale)
        .clamp(-448, 448).to(torch.float8_e4m3fn))
    out["fused apply_qk_norm_rope, fp8 q"] = lambda: rotary.apply_qk_norm_rope(
        q, k, freqs, start, q_weight=qw, k_weight=kw, q_fp8_scale=scale.view(Hq), **rope)
    # OLMo2's norm over all heads of a token (weights [heads * D]), unfused and fused.
    qhw = (1 + 0.1 * torch.randn(Hq * D, generator=g)).to(device, dtype)
    khw = (1 + 0.1 * torch.randn(Hk * D, generator=g)).to(device, dtype)
    out["unfused HF norm over heads + rotary"] = lambda: rotary.apply_rope_qk(
        hf_norm(q.flatten(2), qhw).view(q.shape), hf_norm(k.flatten(2), khw).view(k.shape), freqs, start, **rope)
    out["fused apply_qk_norm_rope, norm heads"] = lambda: rotary.apply_qk_norm_rope(
        q, k, freqs, start, q_weight=qhw, k_weight=khw, norm="heads", **rope)
    # Qwen3-VL's interleaved M-RoPE: N-D ids [3, B, S] (t, h, w), pair j on axis j % 3.
    ids = (start + torch.arange(S, device=device)).expand(3, B, S).contiguous()
    ids[1:] //= 2
    axes = [j % 3 for j in range(D // 2)]
    out["fused apply_qk_norm_rope, M-RoPE ids"] = lambda: rotary.apply_qk_norm_rope(
        q, k, freqs, q_weight=qw, k_weight=kw, position_ids=ids, pair_axes=axes, **rope)
    if torch.device(device).type == "cuda":  # the A/B of the vector path's L2 prefetch of next rows
        out["fused apply_qk_norm_rope, no L2 prefetch"] = without_l2_prefetch(out["fused apply_qk_norm_rope"])
    if compiled:
        fn = torch.compile(model_code, fullgraph=True)
        out["torch.compile(model code)"] = lambda: fn(q, k, qw, kw, cos, sin)
    return out


def check_variants(fns, B, S, Hq, Hk, D, dtype, device) -> None:
    """Before anything is timed: the norm + RoPE variants against the model
    code in float64 (the same seeded inputs as cases), the fused norm over
    heads against its unfused partner, and fp8 q against torch's quantization
    of the fused q (one fp8 step apart at most: that row rounds twice)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, S, Hq, D, generator=g).to(dtype), torch.randn(B, S, Hk, D, generator=g).to(dtype)
    qw, kw = ((1 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2))
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    emb = torch.cat([torch.arange(7, 7 + S, dtype=torch.float64)[:, None] * inv] * 2, dim=-1)
    want = model_code(q.double(), k.double(), qw.double(), kw.double(), emb.cos()[None, None], emb.sin()[None, None])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2**-6)
    for name in ("unfused HF norm + rotary", "unfused F.rms_norm + rotary", "fused apply_qk_norm_rope",
                 "torch.compile(model code)"):
        if name in fns:
            for got, w in zip(fns[name](), want):  # ours are BSHD, the model code's BHSD
                got = got if name.startswith("torch.compile") else got.transpose(1, 2)
                torch.testing.assert_close(got.cpu().double(), w, **tol, msg=name)
    for got, w in zip(fns["fused apply_qk_norm_rope, norm heads"](), fns["unfused HF norm over heads + rotary"]()):
        torch.testing.assert_close(got.float(), w.float(), **tol, msg="norm heads")
    got, w = fns["fused apply_qk_norm_rope, fp8 q"]()[0], fns["fused, then torch's fp8 quantization of q"]()
    torch.testing.assert_close(got.float(), w.float(), rtol=0.125, atol=2**-9, msg="fp8 q")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CUDA: synchronized around every sample)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke run")
    add_protocol_args(ap)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.no_compile = 2, True
    guard = check_load(a)
    dtype = getattr(torch, a.dtype)
    shapes = list(CUDA_SHAPES if a.device.startswith("cuda") else CPU_SHAPES)
    if a.quick:
        shapes = [("prefill", 1, 16, 4, 2, 64), ("decode", 4, 1, 4, 2, 64)]
    print(guard.header())
    for nt in thread_passes(a.threads, reset_compiled=True):
        for name, B, S, Hq, Hk, D in shapes:
            sync = torch.cuda.synchronize if a.device.startswith("cuda") else None
            fns = cases(B, S, Hq, Hk, D, dtype, not a.no_compile, a.device)
            check_variants(fns, B, S, Hq, Hk, D, dtype, a.device)
            st = time_interleaved(fns, a.rounds, seed=a.seed, sync=sync)
            base = st["unfused HF norm + rotary"]
            floor = st["copy floor (2x clone)"]
            print(f"\n{name} {a.dtype} q [{B}, {S}, {Hq}, {D}] k [{B}, {S}, {Hk}, {D}], {nt} thread(s), median of "
                  f"{a.rounds} interleaved rounds{guard.marker()}\n")
            print("| variant | us | / unfused HF (cpu/wall) | / copy floor (cpu/wall) |\n|---|--:|--:|--:|")
            for n, s in st.items():
                print(f"| {n} | {s.median * 1e6:.1f} | {ratio_cell(s, base, guard)} | {ratio_cell(s, floor, guard)} |")
    print("\n" + guard.finish())


if __name__ == "__main__":
    main()
