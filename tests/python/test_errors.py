"""Bad inputs: the right exception type, a message that names the argument
(and, where it helps, the shapes), and no input modified.

This file holds the table for the out-of-place ops (x, freqs, start_pos, q vs
k, offsets / position_ids, devices), rope_freqs and both modules, plus the
shared case helpers; the rest of the suite, split off to keep files short:
test_errors_inplace.py (in-place ops, cu_seqlens, layout, inv_freq,
angle_dtype, loading tables, CUDA devices, sparse / nested tensors),
test_errors_now_valid.py (inputs once refused or wrong, now matching the
reference; NaN / Inf) and test_errors_start_pos_overflow.py (start_pos near
or past int64)."""

import pytest
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq
from rotary_testing.rope_testing import Snapshot, randn

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
    # test_partial_rotary_freqs in test_errors_now_valid.py); wider, or 0
    # wide, is an error.
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
    case("ids-wrong-batch", ValueError, r"position_ids must have shape \[seq_len\] or \[batch, seq_len\] .*with batch = 2, seq_len = 3; got \[3, 3\]",
         lambda: _ids(torch.zeros(3, 3, dtype=torch.int64))),  # a batch row past 2 would be read
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
    case("rope-freqs-odd-dim", ValueError, r"freqs_table: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.freqs_table(7, 16), [])),
    case("rope-freqs-zero-dim", ValueError, r"freqs_table: dim must be even and > 0, got 0",
         lambda: (lambda: rotary.freqs_table(0, 16), [])),
    case("rope-freqs-negative-dim", ValueError, r"dim must be even and > 0, got -4",
         lambda: (lambda: rotary.freqs_table(-4, 16), [])),
    case("rope-freqs-huge-dim", ValueError, r"freqs_table: dim must be <= 2\^20 \(the rotated width of a head\), "
         r"got 1099511627776", lambda: (lambda: rotary.freqs_table(2**40, 4), [])),
    case("inv-frequencies-huge-dim", ValueError, r"inv_frequencies: dim must be <= 2\^20",
         lambda: (lambda: rotary.inv_frequencies(2**62), [])),
    case("rope-freqs-negative-len", ValueError, r"freqs_table: max_seq_len must be >= 0, got -1",
         lambda: (lambda: rotary.freqs_table(8, -1), [])),
    case("rope-freqs-theta-zero", ValueError, r"freqs_table: theta must be finite and > 0, got 0",
         lambda: (lambda: rotary.freqs_table(8, 16, 0.0), [])),
    case("rope-freqs-theta-negative", ValueError, r"theta must be finite and > 0, got -10000",
         lambda: (lambda: rotary.freqs_table(8, 16, -10000.0), [])),
    case("rope-freqs-theta-nan", ValueError, r"theta must be finite and > 0, got nan",
         lambda: (lambda: rotary.freqs_table(8, 16, float("nan")), [])),
    case("rope-freqs-theta-inf", ValueError, r"theta must be finite",
         lambda: (lambda: rotary.freqs_table(8, 16, float("inf")), [])),
    case("inv-frequencies-odd-dim", ValueError, r"inv_frequencies: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.inv_frequencies(7), [])),
    case("inv-frequencies-negative-seq-len", ValueError, r"inv_frequencies: seq_len must be >= 0, got -1",
         lambda: (lambda: rotary.inv_frequencies(8, seq_len=-1), [])),
    # ---- RotaryEmbedding (Python)
    case("module-odd-dim", ValueError, r"dim must be even and > 0, got 7",
         lambda: (lambda: rotary.RotaryEmbedding(7, 16), [])),
    case("module-huge-dim", ValueError, r"RotaryEmbedding: dim must be <= 2\^20 .*got 4611686018427387904",
         lambda: (lambda: rotary.RotaryEmbedding(2**62, 16), [])),
    case("module-zero-len", ValueError, r"RotaryEmbedding: max_seq_len must be > 0, got 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 0), [])),
    case("module-bad-theta", ValueError, r"theta must be finite and > 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16, -1.0), [])),
    # Past max_seq_len is valid for the modules (inv_freq): see
    # test_module_past_table_matches_reference (test_errors_now_valid.py).
    # Only start_pos >= 2^60 is not.
    case("module-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=2**60), [X(1, 2, 3, 8)])),
    case("module-qk-start-pos-2^60", IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976",
         lambda: (lambda q, k: rotary.RotaryEmbedding(8, 16)(q, k, start_pos=2**60), [X(1, 2, 3, 8), X(1, 1, 3, 8)])),
    case("module-negative-start", ValueError, r"RotaryEmbedding: start_pos must be >= 0, got -2",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=-2), [X(1, 2, 3, 8)])),
    # dim > head_dim is an error; dim < head_dim is partial rotary (see
    # test_module_partial_rotary in test_errors_now_valid.py).
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
]


def check_bad_input(build, exc, match):
    """Runs one case of a bad-input table (here and in test_errors_inplace.py)."""
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


@pytest.mark.parametrize("build,exc,match", CASES)
def test_bad_input(build, exc, match):
    check_bad_input(build, exc, match)


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
