"""Errors of the variants (cu_seqlens, layouts, freqs width, inv_freq,
positions): the type and a message naming the argument, for all four
ops, and the same shape checks on the meta device."""

import re

import pytest
import torch

import rotary
from rotary_testing.rope_testing import (
    Snapshot,
    randn,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# Errors: type and a message naming the argument, for all four ops
# ---------------------------------------------------------------------------
def _x3(T=5, H=2, D=8):
    return randn((T, H, D), seed=120)


def _x4(*shape):
    return randn(shape or (2, 2, 3, 8), seed=121)


# id, exception, message regex ({op}: op name, {x}: "x" or "q"), input builder,
# keyword arguments. Each runs through all four ops.
ERRORS = [
    ("cu-not-starting-at-0", ValueError, r"{op}: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[1, 2, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([1, 2, 5]))),
    ("cu-decreasing", ValueError, r"{op}: cu_seqlens must start at 0, never decrease.*got \[0, 3, 2, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 3, 2, 5]))),
    ("cu-not-ending-at-T", ValueError, r"{op}: cu_seqlens .*end at total_tokens = 5; got \[0, 2, 4\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))),
    ("cu-past-T", ValueError, r"end at total_tokens = 5; got \[0, 6\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 6]))),
    ("cu-float", TypeError, r"{op}: cu_seqlens must be int32 or int64, got Float",
     _x3, dict(cu_seqlens=torch.tensor([0.0, 5.0]))),
    ("cu-int16", TypeError, r"{op}: cu_seqlens must be int32 or int64, got Short",
     _x3, dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int16))),
    ("cu-2d", ValueError, r"{op}: cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[1, 3\]",
     _x3, dict(cu_seqlens=torch.tensor([[0, 2, 5]]))),
    ("cu-empty", ValueError, r"{op}: cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[0\]",
     _x3, dict(cu_seqlens=torch.zeros(0, dtype=torch.int64))),
    ("cu-no-sequence", ValueError, r"end at total_tokens = 5; got \[0\]",
     _x3, dict(cu_seqlens=torch.tensor([0]))),
    ("4d-with-cu", ValueError, r"{op}: with cu_seqlens, {x} must be 3-D \[total_tokens, heads, head_dim\], got shape \[2, 2, 3, 8\]",
     _x4, dict(cu_seqlens=torch.tensor([0, 5]))),
    ("3d-without-cu", ValueError,
     r"{op}: {x} must be 4-D \[batch, heads, seq_len, head_dim\], got shape \[5, 2, 8\] \(layout BHSD\); "
     r"a 3-D \[total_tokens, heads, head_dim\] input needs cu_seqlens",
     _x3, {}),
    ("3d-without-cu-bshd", ValueError,
     r"{op}: {x} must be 4-D \[batch, seq_len, heads, head_dim\], got shape \[5, 2, 8\] \(layout BSHD\); .*needs cu_seqlens",
     _x3, dict(layout="BSHD")),
    ("layout-unknown", ValueError, r"{op}: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'",
     _x4, dict(layout="BHDS")),
    ("layout-lowercase", ValueError, r"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'bshd'",
     _x4, dict(layout="bshd")),
    ("layout-thd-without-cu", ValueError, r"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'THD'",
     _x4, dict(layout="THD")),
    ("layout-with-cu", ValueError, r"{op}: with cu_seqlens the layout is 'THD', got 'SBHD'",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), layout="SBHD")),
    ("freqs-wider-than-head-dim", ValueError,
     r"{op}: freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 8 \(full rotation: \[\*, 4\]\), got \[16, 5\]",
     _x4, dict(freqs=rotary.freqs_table(10, 16))),
    ("freqs-wider-varlen", ValueError, r"{op}: freqs must have shape .*head_dim = 8.*got \[16, 8\]",
     _x3, dict(freqs=rotary.freqs_table(16, 16), cu_seqlens=torch.tensor([0, 5]))),
    ("freqs-zero-width", ValueError, r"{op}: freqs must have shape .*got \[16, 0\]",
     _x4, dict(freqs=torch.zeros(16, 0, dtype=torch.complex64))),
    ("inv-freq-float32", TypeError, r"{op}: inv_freq must be float64, got Float",
     _x4, dict(inv_freq=torch.ones(4))),
    ("inv-freq-wrong-length", ValueError, r"{op}: inv_freq must have shape \[rotary_dim / 2\] = \[4\] to match freqs, got \[8\]",
     _x4, dict(inv_freq=torch.ones(8, dtype=torch.float64))),
    ("inv-freq-partial-length", ValueError, r"inv_freq must have shape \[rotary_dim / 2\] = \[2\] to match freqs, got \[4\]",
     _x4, dict(inv_freq=torch.ones(4, dtype=torch.float64), freqs=rotary.freqs_table(4, 16))),
    ("inv-freq-2d", ValueError, r"{op}: inv_freq must have shape \[rotary_dim / 2\] = \[4\].*got \[1, 4\]",
     _x4, dict(inv_freq=torch.ones(1, 4, dtype=torch.float64))),
    ("varlen-ids-2d", ValueError,
     r"{op}: with cu_seqlens, position_ids must have shape \[total_tokens\] = \[5\] .*; got \[1, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), position_ids=torch.zeros(1, 5, dtype=torch.int64))),
    ("varlen-offsets-per-token", ValueError,
     r"{op}: with cu_seqlens, offsets must have shape \[\] or \[num_seqs\] = \[2\] .*got \[5\]; for one absolute "
     r"position per token pass position_ids",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 5]), offsets=torch.arange(5))),
    ("varlen-offsets-2d", ValueError, r"{op}: with cu_seqlens, offsets must have shape \[\] or \[num_seqs\] = \[1\] .*got \[1, 1\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), offsets=torch.zeros(1, 1, dtype=torch.int64))),
    ("varlen-ids-float", TypeError, r"{op}: position_ids must have an integer dtype .*got Float",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), position_ids=torch.zeros(5))),
    ("bshd-offsets-batch", ValueError, r"{op}: offsets must have shape .*batch = 2; got \[3\]; for absolute ids",
     lambda: _x4(2, 3, 2, 8), dict(layout="BSHD", offsets=torch.tensor([0, 1, 2]))),
    ("sbhd-ids-transposed", ValueError, r"{op}: position_ids must have shape .*batch = 2, seq_len = 3; got \[3, 2\]",
     lambda: _x4(3, 2, 2, 8), dict(layout="SBHD", position_ids=torch.zeros(3, 2, dtype=torch.int64))),
    ("varlen-negative", ValueError, r"{op}: token 0 \(sequence 0, index 0\) has negative position -2 \(start_pos 0 \+ offsets \+ s\)",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 5]), offsets=torch.tensor(-2))),
    ("varlen-past-table", IndexError, r"{op}: token 4 \(sequence 0, index 4\) has position 16 .*outside the freqs table \[0, 16\)",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), start=12)),
    ("past-table-with-partial", IndexError, r"{op}: start_pos \+ seq_len = 15 \+ 3 = 18 exceeds",
     _x4, dict(freqs=rotary.freqs_table(4, 16), start=15)),
]


def _run_op(op, x, f, start, kw):
    if op in ("apply_rope", "apply_rope_"):
        return getattr(rotary, op)(x, f, start, **kw)
    k = x[..., :1, :].clone() if x.dim() == 3 or kw.get("layout") in ("BSHD", "SBHD") else x[:, :1].clone()
    return getattr(rotary, op)(x, k, f, start, **kw)


@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_"])
@pytest.mark.parametrize("exc,pattern,make,kw", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_messages(op, exc, pattern, make, kw):
    kw = dict(kw)
    f = kw.pop("freqs", rotary.freqs_table(8, 16))
    start = kw.pop("start", 0)
    x = make()
    snap = Snapshot(x, f, *[v for v in kw.values() if isinstance(v, torch.Tensor)])
    name = "q" if op.startswith("apply_rope_qk") else "x"
    with pytest.raises(exc, match=pattern.format(op=re.escape(op), x=name)):
        _run_op(op, x, f, start, kw)
    snap.check()


def test_k_named_in_varlen_errors():
    f = rotary.freqs_table(8, 16)
    cu = torch.tensor([0, 5])
    with pytest.raises(ValueError, match=r"apply_rope_qk: with cu_seqlens, k must be 3-D .*got shape \[1, 5, 1, 8\]"):
        rotary.apply_rope_qk(_x3(), _x3()[None, :, :1], f, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"apply_rope_qk: k must match q .*q has shape \[5, 2, 8\], k has shape \[4, 1, 8\]"):
        rotary.apply_rope_qk(_x3(), _x3(4, 1), f, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"apply_rope_qk: k must match q"):
        # same token count in BSHD, but k's heads/seq are swapped
        rotary.apply_rope_qk(_x4(2, 3, 2, 8), _x4(2, 2, 3, 8), f, layout="BSHD")


def test_meta_kernel_checks_variants():
    """torch.compile / export see the same shape errors (no values on meta)."""
    f = rotary.freqs_table(8, 16).to("meta")
    cu = torch.tensor([0, 5], device="meta")
    with pytest.raises(ValueError, match=r"a 3-D \[total_tokens, heads, head_dim\] input needs cu_seqlens"):
        rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f)
    with pytest.raises(ValueError, match=r"layout must be"):
        rotary.apply_rope(torch.empty(1, 2, 3, 8, device="meta"), f, layout="HBSD")
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64"):
        rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f, cu_seqlens=cu.float())
    with pytest.raises(TypeError, match=r"inv_freq must be float64"):
        rotary.apply_rope(torch.empty(1, 2, 3, 8, device="meta"), f, inv_freq=torch.empty(4, device="meta"))
    out = rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f, cu_seqlens=cu)
    assert out.shape == (5, 2, 8)
    x = torch.empty(3, 2, 4, 8, device="meta")  # SBHD
    assert rotary.apply_rope(x, f, layout="SBHD").stride() == x.stride()


def _compiled_error(fn, *args):
    """The message of the error a dynamic-shape compile of fn raises."""
    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(Exception) as info:
        compiled(*args)
    return str(info.value)


def test_dynamic_shape_errors_name_numbers():
    """Under dynamic shapes the meta kernel sees symbols (s0, s27); a failed
    check is rerun at their hints, so the message names the numbers the
    call was made with, as the eager op's does, for every op family."""
    f = rotary.freqs_table(8, 16)
    ids = torch.arange(5).expand(2, 5)
    w = torch.ones(6)
    cases = [
        (lambda x: rotary.apply_rope(x, f, layout="BSHD"), (_x4(1, 4, 2, 7),),
         "head_dim) must be even and > 0, got 7 (shape [1, 4, 2, 7])"),
        (lambda x: rotary.apply_rope(x, f, layout="BSHD"), (_x4(1, 4, 2, 8)[..., None],),
         "must be 4-D [batch, seq_len, heads, head_dim], got shape [1, 4, 2, 8, 1]"),
        (lambda q, k, p: rotary.apply_rope_qk(q, k, f, position_ids=p, layout="BSHD"),
         (_x4(2, 6, 4, 8), _x4(2, 6, 2, 8), ids), "with batch = 2, seq_len = 6; got [2, 5]"),
        (lambda q, k, w: rotary.apply_qk_norm_rope(q, k, f, q_weight=w, layout="BSHD"),
         (_x4(2, 3, 4, 8), _x4(2, 3, 2, 8), w),
         "q_weight must be 1-D [head_dim] = [8] for norm 'head' (q has 4 heads of head_dim 8), got shape [6]"),
        (lambda q, k, kc, p: rotary.apply_rope_with_kv_cache_(q, k, k, kc, kc.clone(), f, cache_positions=p),
         (_x4(2, 4, 3, 8), _x4(2, 2, 3, 8), torch.zeros(2, 2, 16, 8), torch.tensor([0, 5])),
         "cache_positions must have one entry per token, shape [batch, seq_len] = [2, 3] or [batch * seq_len] = [6], "
         "got [2]"),
        (lambda q, k, c, p: rotary.apply_rope_cos_sin(q, k, c, c, position_ids=p),
         (_x4(2, 4, 3, 8), _x4(2, 2, 3, 8), torch.ones(16, 8), torch.arange(5)[None]),
         "position_ids must be [seq] = [3] or [batch, seq] = [2, 3] (batch may be 1), got shape [1, 5]"),
    ]
    for fn, args, want in cases:
        message = _compiled_error(fn, *args)
        assert want in message, message
        assert not re.search(r"\bs\d+\b", message), message
