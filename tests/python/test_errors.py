"""Bad inputs: the right exception type, a message that names the argument
(and, where it helps, the shapes), and no input modified."""

import subprocess
import sys
import textwrap

import pytest
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import Snapshot, assert_close_ref, randn
from rotary_testing.rope_testing import op_positions
from rotary_testing.devices import needs_cuda

L = 16


def F(dim=8, n=L):
    return rotary.freqs_table(dim, n)


def X(*shape, dtype=torch.float32, seed=0):
    return randn(shape, dtype, seed)


def INV(dim=8):
    """float64 inv_freq [dim / 2] from the independent reference."""
    return torch.from_numpy(ref_inv_freq(dim))


def I(*shape, dtype=torch.int32):
    return torch.arange(1, 1 + int(torch.tensor(shape).prod().item()), dtype=dtype).reshape(shape)


def case(id, exc, match, build):
    """build() -> (callable taking the inputs, list of inputs)."""
    return pytest.param(build, exc, match, id=id)


def _rope(**kw):
    return lambda x, f, *rest: rotary.apply_rope(x, f, *rest, **kw)


def _qk(**kw):
    return lambda q, k, f, *rest: rotary.apply_rope_qk(q, k, f, *rest, **kw)


def _pos(pos, start=0, qk=False, kind="offsets"):
    """A call passing ``pos`` as ``offsets`` or ``position_ids`` (``kind``)."""
    if qk:
        return lambda q, k, f, p: rotary.apply_rope_qk(q, k, f, start, **{kind: p}), pos
    return lambda x, f, p: rotary.apply_rope(x, f, start, **{kind: p}), pos


def _ids(pos, start=0, qk=False):
    return _pos(pos, start, qk, kind="position_ids")


CASES = [
    # ---- apply_rope: x
    case("odd-head-dim", ValueError, r"apply_rope: x\.size\(-1\) \(head_dim\) must be even and > 0, got 7 \(shape \[2, 3, 4, 7\]\)",
         lambda: (_rope(), [X(2, 3, 4, 7), F(6)])),
    case("zero-head-dim", ValueError, r"head_dim\) must be even and > 0, got 0",
         lambda: (_rope(), [X(2, 3, 4, 0), F()])),
    case("3d-input", ValueError, r"apply_rope: x must be 4-D \[batch, heads, seq_len, head_dim\], got shape \[3, 4, 8\] \(layout BHSD\); a 3-D \[total_tokens, heads, head_dim\] input needs cu_seqlens$",
         lambda: (_rope(), [X(3, 4, 8), F()])),
    case("3d-input-bshd", ValueError, r"x must be 4-D \[batch, seq_len, heads, head_dim\], got shape \[3, 4, 8\] \(layout BSHD\); a 3-D .* needs cu_seqlens",
         lambda: (_rope(layout="BSHD"), [X(3, 4, 8), F()])),
    case("5d-input-sbhd", ValueError, r"x must be 4-D \[seq_len, batch, heads, head_dim\], got shape \[1, 2, 3, 4, 8\] \(layout SBHD\)$",
         lambda: (_rope(layout="SBHD"), [X(1, 2, 3, 4, 8), F()])),
    case("5d-input", ValueError, r"x must be 4-D.*got shape \[1, 2, 3, 4, 8\]",
         lambda: (_rope(), [X(1, 2, 3, 4, 8), F()])),
    case("int32-input", TypeError, r"x must be float32, float64, float16 or bfloat16, got Int",
         lambda: (_rope(), [I(1, 2, 3, 8), F()])),
    case("int64-input", TypeError, r"x must be float32.*got Long",
         lambda: (_rope(), [I(1, 2, 3, 8, dtype=torch.int64), F()])),
    case("complex-input", TypeError, r"x must be float32.*got ComplexFloat",
         lambda: (_rope(), [X(1, 2, 3, 8).to(torch.complex64), F()])),
    # ---- freqs
    case("freqs-complex128", TypeError, r"freqs must be complex64 .*got ComplexDouble",
         lambda: (_rope(), [X(1, 2, 3, 8), F().to(torch.complex128)])),
    case("freqs-float32", TypeError, r"freqs must be complex64.*got Float",
         lambda: (_rope(), [X(1, 2, 3, 8), torch.view_as_real(F()).flatten(1)])),
    # Narrower than head_dim / 2 is partial rotary (valid, see
    # test_partial_rotary_freqs); wider, or 0 wide, is an error.
    case("freqs-wrong-width", ValueError, r"apply_rope: freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 8 \(full rotation: \[\*, 4\]\), got \[16, 8\]",
         lambda: (_rope(), [X(1, 2, 3, 8), F(16)])),
    case("freqs-zero-width", ValueError, r"freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 8 .*got \[16, 0\]",
         lambda: (_rope(), [X(1, 2, 3, 8), F()[:, :0]])),
    case("freqs-1d", ValueError, r"freqs must have shape .*got \[4\]",
         lambda: (_rope(), [X(1, 2, 3, 8), F()[0]])),
    case("freqs-3d", ValueError, r"freqs must have shape .*got \[1, 16, 4\]",
         lambda: (_rope(), [X(1, 2, 3, 8), F()[None]])),
    # ---- start_pos
    case("start-pos-out-of-table", IndexError, r"start_pos \+ seq_len = 14 \+ 3 = 17 exceeds the freqs table length \(max_seq_len\) 16",
         lambda: (_rope(), [X(1, 2, 3, 8), F(), 14])),
    case("seq-longer-than-table", IndexError, r"start_pos \+ seq_len = 0 \+ 17 = 17 exceeds .*max_seq_len",
         lambda: (_rope(), [X(1, 2, 17, 8), F()])),
    case("negative-start-pos", ValueError, r"apply_rope: start_pos must be >= 0, got -1",
         lambda: (_rope(), [X(1, 2, 3, 8), F(), -1])),
    case("start-pos-below-2^60-past-the-last-position", IndexError, r"apply_rope: start_pos \+ seq_len = 1152921504606846975 \+ 3 reaches past the last position, 2\^60 - 1",
         lambda: (_rope(), [X(1, 2, 3, 8), F(), 2**60 - 1])),
    case("start-pos-below-2^60-out-of-table", IndexError, r"apply_rope: start_pos \+ seq_len = 1152921504606846972 \+ 3 = 1152921504606846975 exceeds the freqs table length \(max_seq_len\) 16",
         lambda: (_rope(), [X(1, 2, 3, 8), F(), 2**60 - 4])),
    case("start-pos-2^60-inv-freq", IndexError, r"apply_rope: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (_rope(inv_freq=INV()), [X(1, 2, 3, 8), F(), 2**60])),
    case("start-pos-2^60-offsets", IndexError, r"apply_rope: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (_rope(offsets=torch.tensor(0)), [X(1, 2, 3, 8), F(), 2**60])),
    case("qk-start-pos-2^60-inv-freq", IndexError, r"apply_rope_qk: start_pos must be < 2\^60, got 1152921504606846977",
         lambda: (_qk(inv_freq=INV()), [X(1, 2, 3, 8), X(1, 1, 3, 8), F(), 2**60 + 1])),
    case("qk-start-pos-out-of-table", IndexError, r"apply_rope_qk: start_pos \+ seq_len = 16 \+ 1 = 17",
         lambda: (_qk(), [X(1, 2, 1, 8), X(1, 2, 1, 8), F(), 16])),
    case("qk-negative-start-pos", ValueError, r"apply_rope_qk: start_pos must be >= 0",
         lambda: (_qk(), [X(1, 2, 3, 8), X(1, 2, 3, 8), F(), -3])),
    # ---- apply_rope_qk: q vs k
    case("qk-batch-mismatch", ValueError, r"k must match q in batch, seq_len and head_dim.*q has shape \[2, 4, 3, 8\], k has shape \[1, 2, 3, 8\]",
         lambda: (_qk(), [X(2, 4, 3, 8), X(1, 2, 3, 8), F()])),
    case("qk-seq-mismatch", ValueError, r"k must match q.*k has shape \[2, 2, 5, 8\]",
         lambda: (_qk(), [X(2, 4, 3, 8), X(2, 2, 5, 8), F()])),
    case("qk-head-dim-mismatch", ValueError, r"k must match q.*k has shape \[2, 4, 3, 6\]",
         lambda: (_qk(), [X(2, 4, 3, 8), X(2, 4, 3, 6), F()])),
    case("qk-dtype-mismatch", TypeError, r"k has dtype BFloat16 but q has dtype Float; q and k must share one dtype",
         lambda: (_qk(), [X(2, 4, 3, 8), X(2, 4, 3, 8, dtype=torch.bfloat16), F()])),
    case("qk-k-3d", ValueError, r"apply_rope_qk: k must be 4-D.*\[4, 3, 8\]",
         lambda: (_qk(), [X(2, 4, 3, 8), X(4, 3, 8), F()])),
    case("qk-q-odd-head-dim", ValueError, r"apply_rope_qk: q\.size\(-1\) \(head_dim\) must be even",
         lambda: (_qk(), [X(2, 4, 3, 5), X(2, 4, 3, 5), F()])),
    case("qk-k-int", TypeError, r"apply_rope_qk: k must be float32",
         lambda: (_qk(), [X(2, 4, 3, 8), I(2, 4, 3, 8), F()])),
    case("qk-freqs-wrong-width", ValueError, r"apply_rope_qk: freqs must have shape",
         lambda: (_qk(), [X(2, 4, 3, 8), X(2, 1, 3, 8), F(12)])),
    # ---- offsets / position_ids
    case("offsets-float", TypeError, r"apply_rope: offsets must have an integer dtype \(int64 or int32 are read without a copy\), got Float",
         lambda: _pos(torch.tensor([1.0, 2.0]))),
    case("ids-bool", TypeError, r"position_ids must have an integer dtype .*got Bool",
         lambda: _ids(torch.ones(2, 3, dtype=torch.bool))),
    case("offsets-wrong-batch", ValueError, r"offsets must have shape \[\] or \[batch\] \(position = start_pos \+ offsets\[b\] \+ s\) with batch = 2; got \[3\]; for absolute ids \[seq_len\] or \[batch, seq_len\] pass position_ids",
         lambda: _pos(torch.tensor([1, 2, 3]))),
    case("offsets-2d", ValueError, r"offsets must have shape .*got \[2, 3\]; for absolute ids .*pass position_ids",
         lambda: _pos(torch.zeros(2, 3, dtype=torch.int64))),
    case("ids-wrong-seq", ValueError, r"position_ids must have shape \[seq_len\] or \[batch, seq_len\] \(absolute positions, as in Hugging Face\) with batch = 2, seq_len = 3; got \[2, 4\]",
         lambda: _ids(torch.zeros(2, 4, dtype=torch.int64))),
    case("ids-per-batch-shape", ValueError, r"position_ids must have shape .*got \[2\]; for per-batch offsets \[batch\] pass offsets",
         lambda: _ids(torch.tensor([1, 2]))),
    case("ids-0d", ValueError, r"position_ids must have shape .*got \[\]; for one offset added to start_pos \+ s pass offsets",
         lambda: _ids(torch.tensor(1))),
    case("ids-3d", ValueError, r"position_ids must have shape .*got \[2, 3, 1\]",
         lambda: _ids(torch.zeros(2, 3, 1, dtype=torch.int64))),
    case("ids-with-start-pos", ValueError, r"apply_rope: start_pos must be 0 with position_ids \(they are absolute positions\), got start_pos = 1; add it to the ids, or pass offsets for per-sequence starts",
         lambda: _ids(torch.zeros(2, 3, dtype=torch.int64), start=1)),
    case("qk-ids-with-start-pos", ValueError, r"apply_rope_qk: start_pos must be 0 with position_ids",
         lambda: _ids(torch.zeros(3, dtype=torch.int32), start=4, qk=True)),
    case("offsets-and-ids", ValueError, r"apply_rope: pass offsets \(per-sequence starts\) or position_ids \(absolute ids\), not both",
         lambda: (_rope(offsets=torch.tensor(0), position_ids=torch.zeros(3, dtype=torch.int64)), [X(2, 2, 3, 8), F()])),
    case("offsets-out-of-table", IndexError, r"token \(batch 1, seq 2\) has position 16 \(start_pos 0 \+ offsets \+ s\), outside the freqs table \[0, 16\); build the table with max_seq_len > 16 \(the ops also take inv_freq\)",
         lambda: _pos(torch.tensor([0, 14]))),
    case("ids-out-of-table", IndexError, r"has position 21 \(position_ids\), outside the freqs table.*max_seq_len > 21",
         lambda: _ids(torch.tensor([[0, 1, 2], [3, 4, 21]]))),
    case("ids-int32-out-of-table", IndexError, r"has position 16 \(position_ids\)",
         lambda: _ids(torch.tensor([0, 16, 2], dtype=torch.int32))),
    case("ids-negative", ValueError, r"apply_rope: token \(batch 1, seq 1\) has negative position -1 \(position_ids\)",
         lambda: _ids(torch.tensor([[0, 1, 2], [3, -1, 5]]))),
    case("offsets-negative", ValueError, r"token \(batch 0, seq 0\) has negative position -2 \(start_pos 1 \+ offsets \+ s\)",
         lambda: _pos(torch.tensor([-3, 0]), start=1)),
    case("qk-ids-negative", ValueError, r"apply_rope_qk: token \(batch 0, seq 2\) has negative position -7",
         lambda: _ids(torch.tensor([[0, 1, -7], [0, 1, 2]]), qk=True)),
    case("ids-too-large", IndexError, r"apply_rope: position_ids must lie in \(-2\^60, 2\^60\), got 1152921504606846976",
         lambda: _ids(torch.tensor([[0, 1, 2], [3, 2**60, 5]]))),
    case("offsets-too-negative", IndexError, r"offsets must lie in \(-2\^60, 2\^60\), got -1152921504606846976",
         lambda: _pos(torch.tensor([0, -(2**60)]))),
    case("offsets-scalar-plus-start", IndexError, r"position 16 .*outside",
         lambda: _pos(torch.tensor(4), start=10)),
    case("qk-offsets-out-of-table", IndexError, r"apply_rope_qk: token .* outside the freqs table",
         lambda: _pos(torch.tensor([0, 100]), qk=True)),
    case("qk-offsets-float", TypeError, r"apply_rope_qk: offsets must have an integer dtype",
         lambda: _pos(torch.tensor(1.0), qk=True)),
    # ---- devices (meta stands in for a second device on CPU-only machines)
    case("freqs-other-device", ValueError, r"apply_rope: freqs is on meta but q/x is on cpu; move both to the same device",
         lambda: (_rope(), [X(1, 2, 3, 8), F().to("meta")])),
    case("x-other-device", ValueError, r"freqs is on cpu but q/x is on meta",
         lambda: (_rope(), [X(1, 2, 3, 8).to("meta"), F()])),
    case("k-other-device", ValueError, r"apply_rope_qk: k is on meta but q/x is on cpu",
         lambda: (_qk(), [X(1, 2, 3, 8), X(1, 2, 3, 8).to("meta"), F()])),
    case("offsets-other-device", ValueError, r"offsets is on meta but q/x is on cpu",
         lambda: (_rope(offsets=torch.tensor([1], device="meta")), [X(1, 2, 3, 8), F()])),
    case("ids-other-device", ValueError, r"position_ids is on meta but q/x is on cpu",
         lambda: (_rope(position_ids=torch.tensor([1, 2, 3], device="meta")), [X(1, 2, 3, 8), F()])),
    # ---- freqs requiring grad
    case("freqs-requires-grad", ValueError, r"freqs requires grad.*freqs\.detach\(\)",
         lambda: (_rope(), [X(1, 2, 3, 8).requires_grad_(), F().requires_grad_()])),
    case("qk-freqs-requires-grad", ValueError, r"freqs requires grad",
         lambda: (_qk(), [X(1, 2, 3, 8).requires_grad_(), X(1, 2, 3, 8).requires_grad_(), F().requires_grad_()])),
    # ---- rope_freqs
    case("rope-freqs-odd-dim", ValueError, r"rope_freqs: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.freqs_table(7, 16), [])),
    case("rope-freqs-zero-dim", ValueError, r"rope_freqs: dim must be even and > 0, got 0",
         lambda: (lambda: rotary.freqs_table(0, 16), [])),
    case("rope-freqs-negative-dim", ValueError, r"dim must be even and > 0, got -4",
         lambda: (lambda: rotary.freqs_table(-4, 16), [])),
    case("rope-freqs-negative-len", ValueError, r"rope_freqs: max_seq_len must be >= 0, got -1",
         lambda: (lambda: rotary.freqs_table(8, -1), [])),
    case("rope-freqs-theta-zero", ValueError, r"rope_freqs: theta must be finite and > 0, got 0",
         lambda: (lambda: rotary.freqs_table(8, 16, 0.0), [])),
    case("rope-freqs-theta-negative", ValueError, r"theta must be finite and > 0, got -10000",
         lambda: (lambda: rotary.freqs_table(8, 16, -10000.0), [])),
    case("rope-freqs-theta-nan", ValueError, r"theta must be finite and > 0, got nan",
         lambda: (lambda: rotary.freqs_table(8, 16, float("nan")), [])),
    case("rope-freqs-theta-inf", ValueError, r"theta must be finite",
         lambda: (lambda: rotary.freqs_table(8, 16, float("inf")), [])),
    # ---- RotaryEmbedding (Python)
    case("module-odd-dim", ValueError, r"dim must be even and > 0, got 7",
         lambda: (lambda: rotary.RotaryEmbedding(7, 16), [])),
    case("module-zero-len", ValueError, r"RotaryEmbedding: max_seq_len must be > 0, got 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 0), [])),
    case("module-bad-theta", ValueError, r"theta must be finite and > 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16, -1.0), [])),
    # Past max_seq_len is valid for the modules (inv_freq): see
    # test_module_past_table_matches_reference. Only start_pos >= 2^60 is not.
    case("module-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=2**60), [X(1, 2, 3, 8)])),
    case("module-qk-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (lambda q, k: rotary.RotaryEmbedding(8, 16)(q, k, start_pos=2**60), [X(1, 2, 3, 8), X(1, 1, 3, 8)])),
    case("module-negative-start", ValueError, r"RotaryEmbedding: start_pos must be >= 0, got -2",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=-2), [X(1, 2, 3, 8)])),
    # dim > head_dim is an error; dim < head_dim is partial rotary (see
    # test_module_partial_rotary).
    case("module-wrong-head-dim", ValueError, r"^RotaryEmbedding\(dim=8\): head_dim must be >= dim \(the rotated width\), got head_dim 6 \(shape \(1, 2, 3, 6\)\)$",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x), [X(1, 2, 3, 6)])),
    case("module-qk-wrong-head-dim", ValueError, r"RotaryEmbedding\(dim=8\): head_dim must be >= dim .*got head_dim 4",
         lambda: (lambda q, k: rotary.RotaryEmbedding(8, 16)(q, k), [X(1, 2, 3, 4), X(1, 1, 3, 4)])),
    case("module-qk-mismatch", ValueError, r"k must match q",
         lambda: (lambda q, k: rotary.RotaryEmbedding(8, 16)(q, k), [X(1, 2, 3, 8), X(1, 2, 4, 8)])),
    # ---- CppRotaryEmbedding
    case("cpp-odd-dim", ValueError, r"RotaryEmbedding: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.CppRotaryEmbedding(7, 16), [])),
    case("cpp-zero-len", ValueError, r"RotaryEmbedding: max_seq_len must be > 0, got 0",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 0), [])),
    case("cpp-bad-theta", ValueError, r"theta must be finite and > 0",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16, 0.0), [])),
    case("cpp-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x, start_pos=2**60), [X(1, 2, 3, 8)])),
    case("cpp-qk-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846977",
         lambda: (lambda q, k: rotary.CppRotaryEmbedding(8, 16)(q, k, start_pos=2**60 + 1), [X(1, 2, 3, 8), X(1, 1, 3, 8)])),
    case("cpp-wrong-head-dim", ValueError, r"RotaryEmbedding\(dim=8\): head_dim must be >= dim \(the rotated width\), got head_dim 6 \(shape \[1, 2, 3, 6\]\)",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x), [X(1, 2, 3, 6)])),
    case("cpp-negative-start", ValueError, r"start_pos must be >= 0, got -1",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x, start_pos=-1), [X(1, 2, 3, 8)])),
    case("cpp-odd-input-head-dim", ValueError, r"head_dim must be >= dim .*got head_dim 7",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x), [X(1, 2, 3, 7)])),
    # ==== added with "Exact, hard to misuse": in-place ops, cu_seqlens,
    # layout, inv_freq, angle_dtype, loading mismatched tables, CUDA devices.
    # ---- apply_rope_ / apply_rope_qk_ (inputs must be bitwise unchanged)
    case("inplace-leaf-requires-grad", ValueError, r"apply_rope_: x requires grad; in-place rotation is not differentiable",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 8).requires_grad_(), F()])),
    case("inplace-view-of-leaf-requires-grad", ValueError, r"apply_rope_: x requires grad",
         lambda: (lambda x, f: rotary.apply_rope_(x[:, :1], f), [X(1, 2, 3, 8).requires_grad_(), F()])),
    case("qk-inplace-k-requires-grad", ValueError, r"apply_rope_qk_: k requires grad",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 2, 3, 8).requires_grad_(), F()])),
    case("qk-inplace-same-tensor", ValueError, r"apply_rope_qk_: q and k overlap in memory; in place, each element must belong to one of them",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t, t, f), [X(1, 2, 3, 8), F()])),
    case("qk-inplace-overlapping-head-slices", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t[:, :2], t[:, 1:], f), [X(1, 3, 3, 8), F()])),
    case("qk-inplace-overlapping-packed-qkv", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t[:, :, :3].transpose(1, 2), t[:, :, 2:5].transpose(1, 2), f),
                  [X(2, 4, 6, 8), F()])),
    case("inplace-expanded", ValueError, r"apply_rope_: x has elements sharing memory \(an expanded view\?\); an in-place rotation needs distinct elements",
         lambda: (lambda t, f: rotary.apply_rope_(t.expand(2, 2, 3, 8), f), [X(1, 1, 3, 8), F()])),
    case("qk-inplace-expanded-k", ValueError, r"apply_rope_qk_: k has elements sharing memory",
         lambda: (lambda q, t, f: rotary.apply_rope_qk_(q, t.expand(1, 2, 3, 8), f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F()])),
    # any strides, decided exactly: a partial overlap at an odd offset, a view
    # that overlaps itself, and an input the rotation reads (the whole buffer
    # is the snapshot, so a refused call must leave every byte of it alone)
    case("qk-inplace-partial-overlap-last-dim", ValueError, r"apply_rope_qk_: q and k overlap in memory; in place, each element must belong to one of them",
         lambda: (lambda b, f: rotary.apply_rope_qk_(b[..., 0:8], b[..., 4:12], f), [X(1, 2, 4, 12), F()])),
    case("qk-inplace-strided-overlap", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda b, f: rotary.apply_rope_qk_(b.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 0),
                                                      b.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 4), f), [X(128), F()])),
    case("inplace-as-strided-self-overlap", ValueError, r"apply_rope_: x has elements sharing memory \(an expanded view\?\); an in-place rotation needs distinct elements",
         lambda: (lambda b, f: rotary.apply_rope_(b.as_strided((1, 1, 4, 8), (32, 32, 4, 1)), f), [X(64), F()])),
    case("qk-inplace-k-self-overlap", ValueError, r"apply_rope_qk_: k has elements sharing memory",
         lambda: (lambda q, b, f: rotary.apply_rope_qk_(q, b.as_strided((1, 2, 3, 8), (0, 8, 6, 1)), f), [X(1, 2, 3, 8), X(64), F()])),
    case("inplace-expanded-batch-as-strided", ValueError, r"apply_rope_: x has elements sharing memory",
         lambda: (lambda b, f: rotary.apply_rope_(b.as_strided((2, 1, 3, 8), (0, 24, 8, 1)), f), [X(24), F()])),
    case("inplace-x-aliases-freqs", ValueError, r"apply_rope_: x and freqs overlap in memory; in place, the rotation would overwrite an input it reads",
         lambda: (lambda f: rotary.apply_rope_(torch.view_as_real(f).view(1, 1, 16, 8), f), [F().clone()])),
    case("inplace-freqs-requires-grad", ValueError, r"rotary: freqs requires grad, but gradients with respect to the frequency table are not supported",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 8), F().requires_grad_()])),
    case("qk-inplace-freqs-requires-grad", ValueError, r"rotary: freqs requires grad",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F().requires_grad_()])),
    case("inplace-int32", TypeError, r"apply_rope_: x must be float32, float64, float16 or bfloat16, got Int",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [I(1, 2, 3, 8), F()])),
    case("inplace-odd-head-dim", ValueError, r"apply_rope_: x\.size\(-1\) \(head_dim\) must be even and > 0, got 7",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 7), F()])),
    case("inplace-rotary-dim-gt-head-dim", ValueError, r"apply_rope_: freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 6",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 6), F()])),
    case("qk-inplace-rotary-dim-gt-head-dim", ValueError, r"apply_rope_qk_: freqs must have shape .*head_dim = 8 .*got \[16, 6\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F(12)])),
    case("inplace-offsets-float", TypeError, r"apply_rope_: offsets must have an integer dtype .*got Float",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, offsets=p), [X(2, 2, 3, 8), F(), torch.tensor([1.0, 2.0])])),
    case("inplace-ids-wrong-shape", ValueError, r"apply_rope_: position_ids must have shape \[seq_len\] or \[batch, seq_len\].*got \[2, 4\]",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, position_ids=p), [X(2, 2, 3, 8), F(), torch.zeros(2, 4, dtype=torch.int64)])),
    case("inplace-ids-with-start-pos", ValueError, r"apply_rope_: start_pos must be 0 with position_ids",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, 2, position_ids=p), [X(2, 2, 3, 8), F(), torch.zeros(3, dtype=torch.int64)])),
    case("qk-inplace-batch-mismatch", ValueError, r"apply_rope_qk_: k must match q in batch, seq_len and head_dim.*k has shape \[1, 2, 3, 8\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(2, 2, 3, 8), X(1, 2, 3, 8), F()])),
    case("qk-inplace-seq-mismatch", ValueError, r"apply_rope_qk_: k must match q.*k has shape \[2, 2, 4, 8\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(2, 2, 3, 8), X(2, 2, 4, 8), F()])),
    case("inplace-start-pos-out-of-table", IndexError, r"apply_rope_: start_pos \+ seq_len = 14 \+ 3 = 17 exceeds the freqs table length",
         lambda: (lambda x, f: rotary.apply_rope_(x, f, 14), [X(1, 2, 3, 8), F()])),
    case("qk-inplace-positions-out-of-table", IndexError, r"apply_rope_qk_: token \(batch 1, seq 2\) has position 16",
         lambda: (lambda q, k, f, p: rotary.apply_rope_qk_(q, k, f, offsets=p), [X(2, 2, 3, 8), X(2, 1, 3, 8), F(), torch.tensor([0, 14])])),
    # ---- cu_seqlens (packed varlen)
    case("cu-seqlens-not-monotonic", ValueError, r"apply_rope: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[0, 3, 2, 5\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 3, 2, 5])), [X(5, 2, 8), F()])),
    case("cu-seqlens-not-starting-at-0", ValueError, r"cu_seqlens must start at 0.*got \[1, 3, 5\]",
         lambda: (_rope(cu_seqlens=torch.tensor([1, 3, 5])), [X(5, 2, 8), F()])),
    case("cu-seqlens-not-ending-at-T", ValueError, r"cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[0, 3, 4\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)), [X(5, 2, 8), F()])),
    case("qk-inplace-cu-seqlens-past-T", ValueError, r"apply_rope_qk_: cu_seqlens must start at 0.*got \[0, 3, 6\]",
         lambda: (lambda q, k, f, cu: rotary.apply_rope_qk_(q, k, f, cu_seqlens=cu), [X(5, 2, 8), X(5, 1, 8), F(), torch.tensor([0, 3, 6])])),
    case("cu-seqlens-float", TypeError, r"apply_rope: cu_seqlens must be int32 or int64, got Float",
         lambda: (_rope(cu_seqlens=torch.tensor([0.0, 5.0])), [X(5, 2, 8), F()])),
    case("cu-seqlens-2d", ValueError, r"cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[1, 2\]",
         lambda: (_rope(cu_seqlens=torch.tensor([[0, 5]])), [X(5, 2, 8), F()])),
    case("cu-seqlens-with-4d-x", ValueError, r"with cu_seqlens, x must be 3-D \[total_tokens, heads, head_dim\], got shape \[1, 5, 2, 8\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 5])), [X(1, 5, 2, 8), F()])),
    case("cu-seqlens-ids-wrong-shape", ValueError, r"with cu_seqlens, position_ids must have shape \[total_tokens\] = \[5\].*got \[6\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 2, 5]), position_ids=torch.zeros(6, dtype=torch.int64)), [X(5, 2, 8), F()])),
    # ---- layout, inv_freq
    case("bad-layout", ValueError, r"apply_rope: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'",
         lambda: (_rope(layout="BHDS"), [X(1, 2, 3, 8), F()])),
    case("inv-freq-float32", TypeError, r"apply_rope: inv_freq must be float64, got Float",
         lambda: (_rope(inv_freq=torch.ones(4)), [X(1, 2, 3, 8), F()])),
    case("inv-freq-wrong-shape", ValueError, r"inv_freq must have shape \[rotary_dim / 2\] = \[4\] to match freqs, got \[3\]",
         lambda: (_rope(inv_freq=torch.ones(3, dtype=torch.float64)), [X(1, 2, 3, 8), F()])),
    # ---- angle_dtype
    case("rope-freqs-angle-dtype", ValueError, r"rope_freqs: angle_dtype must be 'float64' .* or 'float32' .*got 'float16'",
         lambda: (lambda: rotary.freqs_table(8, 4, angle_dtype="float16"), [])),
    case("module-angle-dtype", ValueError, r"RotaryEmbedding: angle_dtype must be 'float64'.*got torch\.float16",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16, angle_dtype=torch.float16), [])),
    case("cpp-angle-dtype", ValueError, r"RotaryEmbedding: angle_dtype must be 'float64'.*got 'bfloat16'",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16, angle_dtype="bfloat16"), [])),
    case("module-fp32-angles-past-table", IndexError, r"RotaryEmbedding\(angle_dtype=float32\): start_pos \+ seq_len = 14 \+ 3 = 17 exceeds max_seq_len 16",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16, angle_dtype="float32")(x, start_pos=14), [X(1, 2, 3, 8)])),
    case("cpp-fp32-angles-past-table", IndexError, r"RotaryEmbedding\(angle_dtype=float32\): start_pos \+ seq_len = 14 \+ 3 = 17",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16, angle_dtype="float32")(x, start_pos=14), [X(1, 2, 3, 8)])),
    # ---- loading tables the options would not build
    case("module-load-other-theta", RuntimeError, r"RotaryEmbedding\.load_state_dict: the saved tables do not match this module \(dim=8, max_seq_len=16, theta=10000.*'inv_freq'\[1\]",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16).load_state_dict(rotary.RotaryEmbedding(8, 16, 500.0).state_dict()), [])),
    case("cpp-load-other-max-seq-len", RuntimeError, r"CppRotaryEmbedding\.load_state_dict: the saved 'freqs' has 32 rows but this module's max_seq_len is 16",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16).load_state_dict(rotary.CppRotaryEmbedding(8, 32).state_dict()), [])),
    # ---- a real second device (CUDA builds with a GPU only)
    pytest.param(lambda: (_rope(), [X(1, 2, 3, 8).cuda(), F()]), ValueError,
                 r"apply_rope: freqs is on cpu but q/x is on cuda:0; move both to the same device",
                 id="freqs-on-cpu-x-on-cuda", marks=pytest.mark.skipif("not _cuda_kernels()")),
    pytest.param(lambda: (_qk(), [X(1, 2, 3, 8).cuda(), X(1, 2, 3, 8), F().cuda()]), ValueError,
                 r"apply_rope_qk: k is on cpu but q/x is on cuda:0",
                 id="k-on-cpu-q-on-cuda", marks=pytest.mark.skipif("not _cuda_kernels()")),
]


@pytest.mark.parametrize("build,exc,match", CASES)
def test_bad_input(build, exc, match):
    fn, inputs = build()
    if isinstance(inputs, torch.Tensor):  # _pos(...) returns (fn, positions)
        pos = inputs
        qk = fn.__code__.co_argcount == 4
        x = X(2, 4, 3, 8, seed=1)
        inputs = [x, X(2, 2, 3, 8, seed=2), F(), pos] if qk else [x, F(), pos]
    snap = Snapshot(*inputs)
    with pytest.raises(exc, match=match):
        fn(*inputs)
    snap.check()


# ---- formerly wrong results: now refused above, or equal to the reference
def test_inplace_disjoint_interleaved_views_match_reference():
    """q and k taking the even and odd elements of one buffer share no element:
    accepted, and each rotated as the reference rotates it."""
    buf = X(1, 2, 3, 16, dtype=torch.float64, seed=3)
    q, k = buf[..., 0::2], buf[..., 1::2]
    eq, ek = rope_reference(q, 2), rope_reference(k, 2)
    rotary.apply_rope_qk_(q, k, F(), 2)
    assert_close_ref(q, eq, torch.float64)
    assert_close_ref(k, ek, torch.float64)


def test_inplace_gapped_views_sharing_a_buffer_match_reference():
    """Rows of 8 with gaps of 8, and a twin view filling the gaps: disjoint."""
    buf = X(128, dtype=torch.float64, seed=9)
    q = buf.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 0)
    k = buf.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 8)
    eq, ek = rope_reference(q, 0), rope_reference(k, 0)
    rotary.apply_rope_qk_(q, k, F())
    assert_close_ref(q, eq, torch.float64)
    assert_close_ref(k, ek, torch.float64)


def test_inplace_irregular_distinct_strides_match_reference():
    """Offsets {0, 2, 4} + {0, 3} are distinct (torch's check says TooHard)."""
    x = X(8, dtype=torch.float64, seed=4).as_strided((1, 1, 3, 2), (8, 8, 2, 3))
    expected = rope_reference(x, 1)
    rotary.apply_rope_(x, rotary.rope_freqs(2, 8), 1)
    assert_close_ref(x, expected, torch.float64)


@pytest.mark.parametrize("inverse", [False, True])
def test_conjugate_table_past_the_table_with_inv_freq(inverse):
    """freqs.conj() turns by -angle on every row, the rows past the table
    (from inv_freq) included; the gradient turns by +angle. Every entry point."""
    f = rotary.rope_freqs(8, 4).conj()
    x, k = X(1, 2, 6, 8, dtype=torch.float64, seed=5), X(1, 1, 6, 8, dtype=torch.float64, seed=6)
    ex, ek = rope_reference(x, 1, inverse=not inverse), rope_reference(k, 1, inverse=not inverse)
    kw = dict(inverse=inverse, inv_freq=INV())
    assert_close_ref(rotary.apply_rope(x, f, 1, **kw), ex, torch.float64)
    oq, ok = rotary.apply_rope_qk(x, k, f, 1, **kw)
    assert_close_ref(oq, ex, torch.float64)
    assert_close_ref(ok, ek, torch.float64)
    xi, ki = x.clone(), k.clone()
    rotary.apply_rope_(xi, f, 1, **kw)
    assert_close_ref(xi, ex, torch.float64)
    xi, ki = x.clone(), k.clone()
    rotary.apply_rope_qk_(xi, ki, f, 1, **kw)
    assert_close_ref(xi, ex, torch.float64)
    assert_close_ref(ki, ek, torch.float64)
    leaf, g = x.clone().requires_grad_(), X(1, 2, 6, 8, dtype=torch.float64, seed=7)
    rotary.apply_rope(leaf, f, 1, **kw).backward(g)
    assert_close_ref(leaf.grad, rope_reference(g, 1, inverse=inverse), torch.float64)


def test_conjugate_table_issue_reproducer():
    f = rotary.rope_freqs(8, 4)
    inv, _ = rotary.rope_frequencies(8)
    x = X(1, 1, 6, 8, dtype=torch.float64, seed=8)
    a = rotary.apply_rope(x, f.conj(), 0, True, inv_freq=inv)
    b = rotary.apply_rope(x, rotary.rope_freqs(8, 16), 0, True, inverse=True)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- formerly errors, now valid input: the result must match the reference
def _partial_reference(x, rotary_dim, start_pos=0, interleaved=True):
    """float64: dims [0, rotary_dim) rotated by the rotary_dim-wide RoPE, the rest passed through."""
    rotated = rope_reference(x[..., :rotary_dim], start_pos, interleaved)
    return torch.cat([rotated, x[..., rotary_dim:].detach().to("cpu", torch.float64)], dim=-1)


_MODULES = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}


@pytest.mark.parametrize("kind", list(_MODULES))
@pytest.mark.parametrize("qk,start", [(False, 14), (True, 15), (False, 16), (True, 1000)])
def test_module_past_table_matches_reference(kind, qk, start):
    """Formerly IndexError ("exceeds max_seq_len"): a module passes its float64
    inv_freq, so positions past its 16 cached rows are computed exactly."""
    m = _MODULES[kind](8, 16)
    x, k = X(1, 2, 3, 8, seed=3), X(1, 1, 3, 8, seed=4)
    snap = Snapshot(x, k)
    if qk:
        oq, ok = m(x, k, start_pos=start)
        assert_close_ref(oq, rope_reference(x, start), torch.float32)
        assert_close_ref(ok, rope_reference(k, start), torch.float32)
    else:
        assert_close_ref(m(x, start_pos=start), rope_reference(x, start), torch.float32)
    snap.check()


def test_op_past_table_with_inv_freq_matches_reference():
    """The start-pos-out-of-table / qk-start-pos-out-of-table calls, given
    inv_freq, compute the positions past the table instead of raising."""
    x, k = X(1, 2, 3, 8, seed=5), X(1, 1, 3, 8, seed=6)
    snap = Snapshot(x, k)
    assert_close_ref(rotary.apply_rope(x, F(), 14, inv_freq=INV()), rope_reference(x, 14), torch.float32)
    oq, ok = rotary.apply_rope_qk(x, k, F(), 16, inv_freq=INV())
    assert_close_ref(oq, rope_reference(x, 16), torch.float32)
    assert_close_ref(ok, rope_reference(k, 16), torch.float32)
    snap.check()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("rotary_dim", [2, 4, 6])
def test_partial_rotary_freqs(rotary_dim, interleaved):
    """Formerly "freqs must have shape [*, head_dim / 2]": a table narrower than
    head_dim / 2 rotates dims [0, 2 * freqs.size(1)) and passes the rest through."""
    x, k = X(1, 2, 3, 8, seed=7), X(1, 1, 3, 8, seed=8)
    snap = Snapshot(x, k)
    f = F(rotary_dim)
    out = rotary.apply_rope(x, f, 5, interleaved)
    assert_close_ref(out, _partial_reference(x, rotary_dim, 5, interleaved), torch.float32)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    oq, ok = rotary.apply_rope_qk(x, k, f, 2, interleaved)
    assert_close_ref(oq, _partial_reference(x, rotary_dim, 2, interleaved), torch.float32)
    assert_close_ref(ok, _partial_reference(k, rotary_dim, 2, interleaved), torch.float32)
    snap.check()


@pytest.mark.parametrize("kind", list(_MODULES))
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_module_partial_rotary(kind, interleaved):
    """A module whose dim (8) is below the input head_dim (12) rotates the
    first dim dims; the module-wrong-head-dim case (dim > head_dim) stays an error."""
    m = _MODULES[kind](8, 16, 10000.0, interleaved)
    x, k = X(2, 2, 3, 12, seed=9), X(2, 1, 3, 12, seed=10)
    snap = Snapshot(x, k)
    out = m(x, start_pos=4)
    assert_close_ref(out, _partial_reference(x, 8, 4, interleaved), torch.float32)
    assert torch.equal(out[..., 8:], x[..., 8:])
    oq, ok = m(x, k, start_pos=20)  # past max_seq_len too
    assert_close_ref(oq, _partial_reference(x, 8, 20, interleaved), torch.float32)
    assert_close_ref(ok, _partial_reference(k, 8, 20, interleaved), torch.float32)
    snap.check()


def test_enough_cases():
    assert len(CASES) >= 20


def test_errors_are_not_runtime_error_subclass_confusion():
    """ValueError / TypeError / IndexError, not the generic RuntimeError."""
    with pytest.raises(ValueError) as e:
        rotary.apply_rope(X(1, 2, 3, 7), F())
    assert not isinstance(e.value, RuntimeError)


def test_meta_kernel_reports_same_errors():
    """The Meta kernel (used by torch.compile/export) validates like the CPU one."""
    f = F().to("meta")
    with pytest.raises(ValueError, match=r"x must be 4-D"):
        rotary.apply_rope(torch.empty(3, 4, 8, device="meta"), f)
    with pytest.raises(TypeError, match=r"freqs must be complex64"):
        rotary.apply_rope(torch.empty(1, 2, 3, 8, device="meta"), torch.empty(16, 4, device="meta"))
    with pytest.raises(ValueError, match=r"k must match q"):
        rotary.apply_rope_qk(torch.empty(2, 2, 3, 8, device="meta"), torch.empty(2, 2, 4, 8, device="meta"), f)
    with pytest.raises(TypeError, match=r"offsets must have an integer dtype"):
        rotary.apply_rope(torch.empty(2, 2, 3, 8, device="meta"), f, offsets=torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match=r"start_pos must be 0 with position_ids"):
        rotary.apply_rope(torch.empty(2, 2, 3, 8, device="meta"), f, 3, position_ids=torch.empty(3, dtype=torch.int32, device="meta"))
    out = rotary.apply_rope(torch.empty(2, 2, 3, 8, device="meta"), f, 1)
    assert out.shape == (2, 2, 3, 8) and out.device.type == "meta"


def test_positions_must_be_keyword():
    # torch's dispatcher reports a positional keyword-only argument as RuntimeError.
    with pytest.raises((TypeError, RuntimeError), match="positional"):
        torch.ops.rotary.apply_rope(X(1, 1, 2, 8), F(), 0, True, torch.tensor(1))


_OVERFLOW_SCRIPT = textwrap.dedent(
    """
    import sys, torch, rotary
    assert rotary.__file__ == sys.argv[1], (rotary.__file__, sys.argv[1])
    f = rotary.freqs_table(8, 16)
    inv = torch.pow(10000.0, -torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    x = torch.randn(1, 1, 2, 8)
    py, cpp = rotary.RotaryEmbedding(8, 16), rotary.CppRotaryEmbedding(8, 16)
    bound = {  # rejected by the 2^60 bound on start_pos
        "apply_rope(inv_freq)": lambda s: rotary.apply_rope(x, f, s, inv_freq=inv),
        "apply_rope_qk(inv_freq)": lambda s: rotary.apply_rope_qk(x, x, f, s, inv_freq=inv),
        "apply_rope(offsets)": lambda s: rotary.apply_rope(x, f, s, offsets=torch.tensor(0)),
        "RotaryEmbedding": lambda s: py(x, start_pos=s),
        "RotaryEmbedding qk": lambda s: py(x, x, start_pos=s),
        "CppRotaryEmbedding": lambda s: cpp(x, start_pos=s),
        "CppRotaryEmbedding qk": lambda s: cpp(x, x, start_pos=s),
    }
    table = {  # no inv_freq, no positions: any IndexError (exact message tested below)
        "apply_rope": lambda s: rotary.apply_rope(x, f, s),
        "apply_rope_qk": lambda s: rotary.apply_rope_qk(x, x, f, s),
    }
    bad = []
    for start in (2**63 - 1, 2**62, 2**60):
        for name, call in {**bound, **table}.items():
            try:
                call(start)
            except IndexError as e:
                if name in bound and f"start_pos must be < 2^60, got {start}" not in str(e):
                    bad.append(f"{name}({start}): {e}")
                if name in table and "start_pos" not in str(e):
                    bad.append(f"{name}({start}): {e}")
            else:
                bad.append(f"{name}({start}): no IndexError")
    if bad:
        print("\\n".join(bad))
        sys.exit(3)
    """
)


def _run_in_subprocess(script):
    """Runs ``script`` with the interpreter and the exact ``rotary`` package
    this process imported (a separate build directory's package when the
    suite runs with PYTHONPATH pointing at one)."""
    import os

    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(rotary.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in sys.path if p])
    return subprocess.run(
        [sys.executable, "-c", script, os.path.abspath(rotary.__file__)],
        env=env, capture_output=True, text=True, timeout=120,
    )


def test_start_pos_overflow_is_rejected():
    """start_pos near INT64_MAX must be rejected (IndexError), never wrap
    around int64 and slip past the range check (which would read far outside
    the table). Modules, and the ops given inv_freq or positions, reject any
    start_pos >= 2^60 with "start_pos must be < 2^60". Run in a subprocess:
    the bug this guards against reads arbitrary memory and may crash."""
    r = _run_in_subprocess(_OVERFLOW_SCRIPT)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("start,exc,match", [
    (2**64, IndexError, r"start_pos must be < 2\^60, got 18446744073709551616"),
    (2**63, IndexError, r"start_pos must be < 2\^60, got 9223372036854775808"),
    (-(2**63) - 1, ValueError, r"start_pos must be >= 0, got -9223372036854775809"),
])
@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_"])
def test_op_start_pos_outside_int64_names_start_pos(op, start, exc, match):
    """torch's own parser would say "Expected a value of type 'int' ... found
    type 'int'"; the wrappers name the argument and the bound."""
    x, k = X(1, 1, 2, 8), X(1, 1, 2, 8, seed=1)
    snap = Snapshot(x, k)
    args = (x, k) if "qk" in op else (x,)
    with pytest.raises(exc, match=f"{op}: {match}"):
        getattr(rotary, op)(*args, F(), start, inv_freq=INV())
    snap.check()


@pytest.mark.parametrize("qk", [False, True], ids=["apply_rope", "apply_rope_qk"])
def test_op_start_pos_2_60_bound_without_inv_freq(qk):
    x = X(1, 1, 2, 8)
    start = 2**63 - 1
    with pytest.raises(IndexError, match=rf"start_pos must be < 2\^60, got {start}"):
        if qk:
            rotary.apply_rope_qk(x, x, F(), start)
        else:
            rotary.apply_rope(x, F(), start)


# ---- added with "Exact, hard to misuse"
def _cuda_kernels():
    """A GPU and a CUDA build of rotary (the device cases above need both)."""
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("rotary::apply_rope", "CUDA")


def test_bad_input_matrix_size():
    """The table above: at least 30 distinct bad inputs across apply_rope,
    apply_rope_qk, apply_rope_, apply_rope_qk_, rope_freqs and both modules."""
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    for prefix in ("inplace-", "qk-inplace-", "qk-", "rope-freqs-", "module-", "cpp-", "cu-seqlens-"):
        assert any(i.startswith(prefix) for i in ids), prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("entry", ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_", "module", "cpp_module"])
def test_nan_and_inf_propagate(entry, dtype):
    """NaN / Inf in q or k are not errors (nothing is scanned on the host):
    they propagate. A pair holding NaN comes out NaN in both members (the
    rotation mixes them); an Inf pair gives Inf or NaN (Inf * 0 on an axis
    angle); every other pair is rotated normally."""
    x = X(1, 2, 3, 8, dtype=dtype, seed=5)
    x[0, 0, 1, 2] = float("nan")  # pair 1 (interleaved) of token 1
    x[0, 1, 2, 4] = float("inf")  # pair 2 of token 2
    x[0, 1, 2, 5] = -float("inf")
    k = X(1, 1, 3, 8, dtype=dtype, seed=6)
    k[0, 0, 0, 0] = float("nan")
    f = F()
    clean = x.clone()
    clean[0, 0, 1, 2:4] = 0
    clean[0, 1, 2, 4:6] = 0
    if entry == "apply_rope":
        outs = [rotary.apply_rope(x, f, 2)]
    elif entry == "apply_rope_qk":
        outs = list(rotary.apply_rope_qk(x, k, f, 2))
    elif entry == "apply_rope_":
        outs = [rotary.apply_rope_(x.clone(), f, 2)]
    elif entry == "apply_rope_qk_":
        outs = list(rotary.apply_rope_qk_(x.clone(), k.clone(), f, 2))
    else:
        m = (rotary.RotaryEmbedding if entry == "module" else rotary.CppRotaryEmbedding)(8, 16)
        outs = list(m(x, k, 2))
    y = outs[0]
    assert torch.isnan(y[0, 0, 1, 2:4]).all()
    assert (~torch.isfinite(y[0, 1, 2, 4:6])).all()
    bad = torch.zeros_like(y, dtype=torch.bool)
    bad[0, 0, 1, 2:4] = True
    bad[0, 1, 2, 4:6] = True
    assert torch.isfinite(y[~bad]).all()
    # the finite pairs are exactly what a clean input gives
    want = rotary.apply_rope(clean, f, 2)
    assert torch.equal(y[~bad], want[~bad])
    if len(outs) == 2:
        assert torch.isnan(outs[1][0, 0, 0, :2]).all() and torch.isfinite(outs[1][0, 0, 0, 2:]).all()


@needs_cuda
def test_cross_device_errors():
    f_cpu = rotary.freqs_table(8, 16)
    x = randn((1, 2, 3, 8), seed=282, device="cuda")
    with pytest.raises(ValueError, match=r"freqs is on cpu but q/x is on cuda"):
        rotary.apply_rope(x, f_cpu)
    with pytest.raises(ValueError, match=r"offsets is on cpu"):
        rotary.apply_rope(x, f_cpu.cuda(), **op_positions(0, torch.tensor(1)))
    with pytest.raises(ValueError, match=r"k is on cpu"):
        rotary.apply_rope_qk(x, x.cpu(), f_cpu.cuda())
    with pytest.raises(ValueError, match=r"head_dim"):
        rotary.apply_rope(randn((1, 2, 3, 7), device="cuda"), f_cpu.cuda())
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len"):
        rotary.apply_rope(x, f_cpu.cuda(), 14)


def _dense_refusal_cases():
    f = rotary.freqs_table(8, 16)
    q, w = randn((1, 2, 4, 8), seed=290), torch.ones(8)
    nested = torch.nested.nested_tensor([q[0], q[0]])
    cache = torch.zeros(1, 2, 16, 8)
    sparse, fix = "a sparse COO tensor", r"\(\.to_dense\(\)\)"
    return [
        ("apply_rope", "x", sparse, lambda: rotary.apply_rope(q.to_sparse(), f)),
        ("apply_rope", "x", "a sparse compressed tensor", lambda: rotary.apply_rope(q[0, 0].to_sparse_csr(), f)),
        ("apply_rope", "x", "an mkldnn tensor", lambda: rotary.apply_rope(q.to_mkldnn(), f)),
        ("apply_rope", "x", "a nested tensor", lambda: rotary.apply_rope(nested, f)),
        ("apply_rope", "freqs", sparse, lambda: rotary.apply_rope(q, torch.view_as_real(f).to_sparse())),
        ("apply_rope", "position_ids", sparse,
         lambda: rotary.apply_rope(q, f, position_ids=torch.arange(4).view(1, 4).to_sparse())),
        ("apply_rope_qk", "k", sparse, lambda: rotary.apply_rope_qk(q, q.to_sparse(), f)),
        ("apply_rope_", "x", sparse, lambda: rotary.apply_rope_(q.to_sparse(), f)),
        ("apply_rope", "x", sparse, lambda: rotary.RotaryEmbedding(8, 16)(q.to_sparse())),
        ("apply_rope", "x", sparse, lambda: rotary.CppRotaryEmbedding(8, 16)(q.to_sparse())),
        ("apply_qk_norm_rope", "q_weight", sparse, lambda: rotary.apply_qk_norm_rope(q, q, f, q_weight=w.to_sparse())),
        ("apply_rope_with_kv_cache_", "k_cache", sparse,
         lambda: rotary.apply_rope_with_kv_cache_(q, q.clone(), q.clone(), cache.to_sparse(), cache, f, 0, True)),
        ("apply_rope_cos_sin", "cos", sparse,
         lambda: rotary.apply_rope_cos_sin(q, q, torch.randn(4, 8).to_sparse(), torch.randn(4, 8))),
        ("apply_rope_cos_sin", "q", "a nested tensor",
         lambda: rotary.apply_rope_cos_sin(nested, q, torch.randn(4, 8), torch.randn(4, 8))),
    ], fix


def test_sparse_mkldnn_and_nested_tensors_are_refused_by_name():
    """They dispatch to their own keys before any kernel runs; each op
    refuses the first such argument by name, what it is and what to pass
    (the module calls as the op they make), and writes nothing."""
    cases, fix = _dense_refusal_cases()
    for op, name, what, call in cases:
        with pytest.raises(TypeError, match=rf"^{op}: {name} must be a dense \(strided\) tensor, got {what}; "):
            call()
    q = randn((1, 2, 4, 8), seed=291)
    saved = q.clone()
    with pytest.raises(TypeError, match=fix):
        rotary.apply_rope_qk_(q, q.to_sparse(), rotary.freqs_table(8, 16))
    assert torch.equal(q, saved)
