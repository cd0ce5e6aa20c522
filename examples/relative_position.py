"""The seeds' proofs, run through the rotary extension.

1. Under RoPE the q.k score for a fixed offset is the same wherever the pair
   sits in the sequence.
2. Adding a sinusoidal vector instead leaks absolute position: the score drifts.
3. The RoPE score still depends on the offset itself.
"""

import math
import sys

import torch

import rotary

DIM, BASE, OFFSET = 64, 10000.0, 2
STARTS = [2, 5, 9, 14, 20, 1000, 4000]


def sinusoidal(pos: int, dim: int) -> torch.Tensor:
    i = torch.arange(dim // 2, dtype=torch.float64)
    angle = pos * BASE ** (-2.0 * i / dim)
    pe = torch.empty(dim, dtype=torch.float64)
    pe[0::2], pe[1::2] = torch.sin(angle), torch.cos(angle)
    return pe


def main() -> int:
    torch.manual_seed(7)
    rope = rotary.RotaryEmbedding(DIM, max_seq_len=4096, theta=BASE)
    q = torch.randn(DIM, dtype=torch.float64)
    k = torch.randn(DIM, dtype=torch.float64)

    def rotated(v: torch.Tensor, pos: int) -> torch.Tensor:
        return rope(v.view(1, 1, 1, DIM), start_pos=pos).view(DIM)

    print(f"RoPE (rotary.RotaryEmbedding, dim {DIM}) vs sinusoidal-add, offset fixed at {OFFSET}")
    print(f"{'m':>6} {'n':>6} {'RoPE score':>14} {'sinusoidal-add':>16}")
    rope_scores, add_scores = [], []
    for m in STARTS:
        n = m - OFFSET
        rope_scores.append(torch.dot(rotated(q, m), rotated(k, n)).item())
        add_scores.append(torch.dot(q + sinusoidal(m, DIM), k + sinusoidal(n, DIM)).item())
        print(f"{m:>6} {n:>6} {rope_scores[-1]:>14.8f} {add_scores[-1]:>16.8f}")

    by_offset = [torch.dot(rotated(q, 10 + d), rotated(k, 10)).item() for d in (0, 1, 3, 6)]
    rope_spread = max(rope_scores) - min(rope_scores)
    add_spread = max(add_scores) - min(add_scores)
    offset_spread = max(by_offset) - min(by_offset)
    print(f"RoPE spread at a fixed offset:           {rope_spread:.2e}  (float32 table rounding)")
    print(f"sinusoidal-add spread at a fixed offset: {add_spread:.4f}  (absolute position leaks)")
    print("RoPE score by offset 0, 1, 3, 6:         " + ", ".join(f"{s:.4f}" for s in by_offset))

    ok = rope_spread < 1e-5 and add_spread > 1e-3 and offset_spread > 1e-3 and math.isfinite(rope_spread)
    print("ROPE IS RELATIVE-POSITION INVARIANT:", "YES" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
