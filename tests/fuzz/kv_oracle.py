"""What the KV-cache fuzz cases (kv_cases.py, kv_module_cases.py) expect of
a cache write: the fp8 dtype and torch's quantization expression, the
canonical [B, H, S, D] view of each cache layout, the scales that must be
refused, and a stand-in for arg_draw.Draw where only the rotary width
matters. Split from kv_cases.py."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn

KV_LAYOUTS = ["BHSD", "BSHD", "NHD", "HND"]
BAD_SCALES = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), -0.5, -1e-30]


def cache_canon(c, kv_layout):
    return c.transpose(1, 2) if kv_layout in ("BSHD", "NHD") else c


def quantize(rows, scale, dtype):
    """torch's expression, divided in float32 (float64 for float64 k)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.ones(()) if scale is None else scale.detach().resolve_neg().cpu()
    s = s.to(work)
    if s.dim() == 1 and s.numel() > 1:
        s = s.reshape(-1, 1)  # per head: rows are [H, D]
    return (rows.to(work) / s).clamp(-448, 448).to(FP8)


def logical_copy(t):
    return t.detach().resolve_neg().clone()


class _Shape:
    def __init__(self, rd):
        self.rd, self.inv = rd, None
