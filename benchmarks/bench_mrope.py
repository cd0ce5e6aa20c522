#!/usr/bin/env python3
"""M-RoPE (Qwen2-VL sections, N-D positions) against our 1-D op on the same
tensors, and against the eager transformers path and torch.compile of it,
all timed in one run with benchmarks/protocol.py (every case once per round
in a seeded shuffled order, medians, CPU time / wall next to each ratio, one
pass per --threads count, refused on a loaded machine):

  clone      q.clone() + k.clone(): the memory floor
  ours_1d    rotary.apply_rope_qk with [batch, seq] position ids
  ours_mrope the same call with [3, batch, seq] ids and pair_axes
  hf_eager   Qwen2VLRotaryEmbedding (cos/sin from the 3-D ids, sections
             recomposed) + apply_rotary_pos_emb, as the model runs it
  hf_compile torch.compile(fullgraph=True) of hf_eager

Tensors are Qwen2-VL's: q/k projected as [batch, seq, heads, head_dim] and
viewed as [batch, heads, seq, head_dim] (as the attention does), rotate_half
pairing, positions an image grid inside text.

Usage: PYTHONPATH=python python benchmarks/bench_mrope.py [--device cpu|cuda]
       [--seq 8192] [--heads 28,4] [--dim 128] [--dtype bf16] [--repeat 21] [--threads 1,2] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import add_protocol_args, check_load, ratio_cell, thread_passes, time_interleaved  # noqa: E402

import torch  # noqa: E402

import rotary  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SECTIONS = [16, 24, 24]


def grid_positions(seq: int, device) -> torch.Tensor:
    """[3, 1, seq]: text, then a square image grid, then text (get_rope_index's pattern)."""
    side = max(1, int((seq // 2) ** 0.5))
    n_img, n_pre = side * side, (seq - side * side) // 2
    t, h, w = [], [], []
    for i in range(n_pre):
        t.append(i), h.append(i), w.append(i)
    for i in range(n_img):
        t.append(n_pre), h.append(n_pre + i // side), w.append(n_pre + i % side)
    nxt = n_pre + side
    for i in range(seq - n_pre - n_img):
        t.append(nxt + i), h.append(nxt + i), w.append(nxt + i)
    return torch.tensor([t, h, w], dtype=torch.long, device=device)[:, None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", default="28,4")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--repeat", type=int, default=21)  # odd: the median is a sample
    ap.add_argument("--quick", action="store_true", help="one tiny case, no timing claims")
    add_protocol_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.heads, args.dim, args.repeat = 64, "4,2", 32, 2
    guard = check_load(args)
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    hq, hk = (int(v) for v in args.heads.split(","))
    S, D = args.seq, args.dim
    sections = SECTIONS if D == 128 else [D // 8, 3 * D // 16, D // 2 - D // 8 - 3 * D // 16]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, S, hq, D, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(1, S, hk, D, generator=gen).to(device, dtype).transpose(1, 2)
    pos3 = grid_positions(S, device)
    pos1 = pos3[0]
    cfg = Qwen2VLTextConfig(hidden_size=hq * D, num_attention_heads=hq, num_key_value_heads=hk, head_dim=D,
                            max_position_embeddings=max(2 * S, 4096),
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections})
    rope = rotary.RotaryEmbedding.from_hf_config(cfg).to(device)
    hf_emb = Qwen2VLRotaryEmbedding(cfg).to(device)

    def hf_eager():
        cos, sin = hf_emb(q, pos3)
        return apply_rotary_pos_emb(q, k, cos, sin)

    hf_compiled = torch.compile(hf_eager, fullgraph=True)
    cases = {
        "clone": lambda: (q.clone(), k.clone()),
        "ours_1d": lambda: rope(q, k, position_ids=pos1),
        "ours_mrope": lambda: rope(q, k, position_ids=pos3),
        "hf_eager": hf_eager,
        "hf_compile": hf_compiled,
    }
    # Same results first (the speed of a wrong answer is not a number): each
    # timed rotation, q and k, against transformers' own code. The 1-D call is
    # transformers' with every axis at the text position.
    def hf_1d():
        cos, sin = hf_emb(q, pos1.expand(3, *pos1.shape))
        return apply_rotary_pos_emb(q, k, cos, sin)

    tol = 2e-2 if dtype != torch.float32 else 1e-4
    for name, want in (("ours_mrope", hf_eager), ("hf_compile", hf_eager), ("ours_1d", hf_1d)):
        for part, got, ref in zip("qk", cases[name](), want()):
            try:
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
            except AssertionError as e:
                raise SystemExit(f"bench_mrope: {name} ({part}) differs from transformers': {e}") from None
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    print(guard.header())
    for nt in thread_passes([None] if device.type == "cuda" else args.threads, reset_compiled=True):
        # warm-up (and compile, again after each thread change) inside
        st = time_interleaved(cases, args.repeat, warmup=2, seed=args.seed, sync=sync)
        print(f"\n# M-RoPE, {device.type}, {args.dtype}, S={S}, heads {hq}/{hk}, D={D}, sections {sections}, "
              f"threads {torch.get_num_threads()}, {args.repeat} rounds, torch {torch.__version__}{guard.marker()}")
        print(f"{'case':<12}{'median ms':>12}{'GB/s':>10} {'x clone':>30} {'x ours_1d':>30}")
        for name, s in st.items():
            print(f"{name:<12}{s.median * 1e3:>12.3f}{nbytes / s.median / 1e9:>10.1f}"
                  f" {ratio_cell(s, st['clone'], guard):>30} {ratio_cell(s, st['ours_1d'], guard):>30}")
        mr = st["ours_mrope"]
        print(f"mrope / 1d = {ratio_cell(mr, st['ours_1d'], guard, 3)}; "
              f"hf_eager / mrope = {ratio_cell(st['hf_eager'], mr, guard)}; "
              f"hf_compile / mrope = {ratio_cell(st['hf_compile'], mr, guard)}")
    print("\n" + guard.finish())


if __name__ == "__main__":
    main()
