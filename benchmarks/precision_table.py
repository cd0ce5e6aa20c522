"""Measured phase error of RoPE tables, float64 angles vs float32 angles.

    PYTHONPATH=python .venv/bin/python benchmarks/precision_table.py

For windows of positions ending at ~4K, 128K, 1M and 2^22, over every pair of
a dim-128 head (theta 10000), it prints:

* angle err: max |angle used - exact angle| in radians, before cos/sin. The
  exact angle is the real product p * inv_freq[j] (inv_freq the float64
  frequency), evaluated in long double (64-bit mantissa).
* phase err: max |arg(entry * conj(exact))|, the rotation actually applied
  against the exact one, after the entry is rounded to complex64.
* cos/sin err: max |entry - exp(i * exact angle)| over cos and sin.

Columns: ours with angle_dtype="float64" (the default), ours with
angle_dtype="float32", and transformers' own formula in torch
(inv_freq = 1 / base ** (arange.float() / dim) in float32, angles
inv_freq.float() @ positions.float(), float32 cos/sin): the last two show how
closely the compatibility mode reproduces it.

Then the output error of apply_rope on random q (float32 / float16 /
bfloat16, 2 x 4 heads x 256 tokens x 128, positions up to 2^22) against the
float64 reference of tests/rotary_testing/reference.py.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # a script: the helpers package beside it

import rotary  # noqa: E402
from rotary_testing.reference import inv_freq as ref_inv_freq  # noqa: E402
from rotary_testing.reference import rope_reference  # noqa: E402

DIM, THETA, WINDOW = 128, 10000.0, 512
ENDS = [("4K", 4096), ("128K", 131072), ("1M", 2**20), ("2^22", 2**22)]


def exact(positions: np.ndarray, inv: np.ndarray):
    """(angle, cos, sin) in long double of the real product p * inv."""
    a = positions.astype(np.longdouble)[:, None] * inv.astype(np.longdouble)[None, :]
    return a, np.cos(a), np.sin(a)


def errors(used_angle, entries, ex):
    a, c, s = ex
    # float64 mode reduces the exact product inside the library (no angle to read back)
    angle_err = None if used_angle is None else float(np.abs(used_angle.astype(np.longdouble) - a).max())
    e = entries.astype(np.complex128)
    ex_c = (c.astype(np.float64) + 1j * s.astype(np.float64))
    phase = float(np.abs(np.angle(e * np.conj(ex_c))).max())
    cs = float(max(np.abs(e.real - c).max(), np.abs(e.imag - s).max()))
    return angle_err, phase, cs


def hf_formula(positions: np.ndarray):
    inv = 1.0 / (THETA ** (torch.arange(0, DIM, 2, dtype=torch.int64).float() / DIM))
    ang = inv[:, None].float() @ torch.from_numpy(positions)[None, :].float()  # [pairs, n]
    ang = ang.t()
    return ang.double().numpy(), torch.complex(ang.cos(), ang.sin()).numpy()


def phase_table():
    inv = ref_inv_freq(DIM, THETA)
    inv32 = inv.astype(np.float32)
    rows = []
    for name, end in ENDS:
        pos = np.arange(end - WINDOW + 1, end + 1, dtype=np.int64)
        ex = exact(pos, inv)
        t = torch.from_numpy(pos)
        f64 = rotary._C.rope_freqs_at(DIM, t, THETA).numpy()
        f32 = rotary._C.rope_freqs_at(DIM, t, THETA, angle_dtype="float32").numpy()
        a32 = (pos.astype(np.float32)[:, None] * inv32[None, :]).astype(np.float64)
        hf_a, hf_e = hf_formula(pos)
        vs_hf = float(np.abs(f32.astype(np.complex128) - hf_e).max())
        rows.append((name, errors(None, f64, ex), errors(a32, f32, ex), errors(hf_a, hf_e, ex), vs_hf))
    return rows


def output_table():
    g = torch.Generator().manual_seed(0)
    B, H, S = 2, 4, 256
    ids = torch.randint(0, 2**22 + 1, (B, S), generator=g)
    ids[0, :3] = torch.tensor([0, 2**22 - 1, 2**22])
    rope = rotary.RotaryEmbedding(DIM, 4096)
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(B, H, S, DIM, generator=g).to(dtype)
        y = rope(x, position_ids=ids).double()
        ref = rope_reference(x, 0, True, ids)
        xd = x.double()
        pair_err = (y - ref).reshape(B, H, S, DIM // 2, 2).norm(dim=-1)
        pair_norm = xd.reshape(B, H, S, DIM // 2, 2).norm(dim=-1)
        rel = float((pair_err / pair_norm).max())
        if dtype == torch.float32:
            out.append(("float32", f"max ||err|| / ||x|| per pair = {rel:.2e}"))
        else:
            mant = 10 if dtype == torch.float16 else 7
            e = ref.numpy()
            ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(e), torch.finfo(dtype).tiny))) - mant)
            norm = pair_norm.repeat_interleave(2, dim=-1).numpy()
            excess = float(max(((np.abs(y.numpy() - e) - 0.5 * ulp) / norm).max(), 0.0))
            cr = float((ref.to(dtype).double() == y).double().mean()) * 100
            out.append((
                str(dtype).replace("torch.", ""),
                f"|err| <= 0.5 ulp + {excess:.1e} * ||x pair||; {cr:.3f}% of elements correctly rounded",
            ))
    return out


def main():
    rows = phase_table()
    print(f"dim {DIM}, theta {THETA:g}, windows of {WINDOW} positions ending at each position, all {DIM // 2} pairs")
    print("| positions | float64 (default): angle / phase / cos,sin err | float32 mode: angle / phase / cos,sin err "
          "| transformers fp32 formula: angle / phase / cos,sin err |")
    print("|---|---|---|---|")
    for name, a, b, c, _ in rows:
        cells = [" / ".join("-" if v is None else f"{v:.1e}" for v in cell) for cell in (a, b, c)]
        print(f"| ~{name} | " + " | ".join(cells) + " |")
    print()
    print("float32 mode vs the transformers formula, max |entry difference|: "
          + ", ".join(f"~{name} {d:.1e}" for name, *_, d in rows))
    print()
    print("apply_rope outputs vs the float64 reference (positions up to 2^22):")
    for name, text in output_table():
        print(f"  {name}: {text}")


if __name__ == "__main__":
    main()
