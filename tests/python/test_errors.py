"""Bad inputs: the right exception type, a message that names the argument
(and, where it helps, the shapes), and no input modified."""

import subprocess
import sys
import textwrap

import pytest
import torch

import rotary
from rope_testing import Snapshot, randn

L = 16


def F(dim=8, n=L):
    return rotary.rope_freqs(dim, n)


def X(*shape, dtype=torch.float32, seed=0):
    return randn(shape, dtype, seed)


def I(*shape, dtype=torch.int32):
    return torch.arange(1, 1 + int(torch.tensor(shape).prod().item()), dtype=dtype).reshape(shape)


def case(id, exc, match, build):
    """build() -> (callable taking the inputs, list of inputs)."""
    return pytest.param(build, exc, match, id=id)


def _rope(**kw):
    return lambda x, f, *rest: rotary.apply_rope(x, f, *rest, **kw)


def _qk(**kw):
    return lambda q, k, f, *rest: rotary.apply_rope_qk(q, k, f, *rest, **kw)


def _pos(pos, start=0, qk=False):
    if qk:
        return lambda q, k, f, p: rotary.apply_rope_qk(q, k, f, start, positions=p), pos
    return lambda x, f, p: rotary.apply_rope(x, f, start, positions=p), pos


CASES = [
    # ---- apply_rope: x
    case("odd-head-dim", ValueError, r"apply_rope: x\.size\(-1\) \(head_dim\) must be even and > 0, got 7 \(shape \[2, 3, 4, 7\]\)",
         lambda: (_rope(), [X(2, 3, 4, 7), F(6)])),
    case("zero-head-dim", ValueError, r"head_dim\) must be even and > 0, got 0",
         lambda: (_rope(), [X(2, 3, 4, 0), F()])),
    case("3d-input", ValueError, r"x must be 4-D \[batch, heads, seq_len, head_dim\], got shape \[3, 4, 8\]",
         lambda: (_rope(), [X(3, 4, 8), F()])),
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
    case("freqs-wrong-width", ValueError, r"freqs must have shape \[max_seq_len, head_dim / 2\] = \[\*, 4\] for head_dim 8, got \[16, 8\]",
         lambda: (_rope(), [X(1, 2, 3, 8), F(16)])),
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
    # ---- positions
    case("positions-int32", TypeError, r"positions must be int64, got Int",
         lambda: _pos(torch.tensor([1, 2], dtype=torch.int32))),
    case("positions-float", TypeError, r"positions must be int64, got Float",
         lambda: _pos(torch.tensor([1.0, 2.0]))),
    case("positions-wrong-batch", ValueError, r"positions must have shape \[\] or \[batch\].*batch = 2, seq_len = 3; got \[3\]",
         lambda: _pos(torch.tensor([1, 2, 3]))),
    case("positions-wrong-seq", ValueError, r"positions must have shape .*got \[2, 4\]",
         lambda: _pos(torch.zeros(2, 4, dtype=torch.int64))),
    case("positions-3d", ValueError, r"positions must have shape .*got \[2, 3, 1\]",
         lambda: _pos(torch.zeros(2, 3, 1, dtype=torch.int64))),
    case("positions-offset-out-of-table", IndexError, r"token \(batch 1, seq 2\) has position 16 \(start_pos 0 \+ positions\), outside the freqs table \[0, 16\)",
         lambda: _pos(torch.tensor([0, 14]))),
    case("positions-ids-out-of-table", IndexError, r"has position 21.*outside the freqs table",
         lambda: _pos(torch.tensor([[0, 1, 2], [3, 4, 20]]), start=1)),
    case("positions-negative", IndexError, r"has position -1 .*outside the freqs table",
         lambda: _pos(torch.tensor([[0, 1, 2], [3, -1, 5]]))),
    case("positions-scalar-plus-start", IndexError, r"position 16 .*outside",
         lambda: _pos(torch.tensor(4), start=10)),
    case("qk-positions-out-of-table", IndexError, r"apply_rope_qk: token .* outside the freqs table",
         lambda: _pos(torch.tensor([0, 100]), qk=True)),
    case("qk-positions-int32", TypeError, r"apply_rope_qk: positions must be int64",
         lambda: _pos(torch.tensor(1, dtype=torch.int32), qk=True)),
    # ---- devices (meta stands in for a second device on CPU-only machines)
    case("freqs-other-device", ValueError, r"apply_rope: freqs is on meta but q/x is on cpu; move both to the same device",
         lambda: (_rope(), [X(1, 2, 3, 8), F().to("meta")])),
    case("x-other-device", ValueError, r"freqs is on cpu but q/x is on meta",
         lambda: (_rope(), [X(1, 2, 3, 8).to("meta"), F()])),
    case("k-other-device", ValueError, r"apply_rope_qk: k is on meta but q/x is on cpu",
         lambda: (_qk(), [X(1, 2, 3, 8), X(1, 2, 3, 8).to("meta"), F()])),
    case("positions-other-device", ValueError, r"positions is on meta but q/x is on cpu",
         lambda: (_rope(positions=torch.tensor([1], device="meta")), [X(1, 2, 3, 8), F()])),
    # ---- freqs requiring grad
    case("freqs-requires-grad", ValueError, r"freqs requires grad.*freqs\.detach\(\)",
         lambda: (_rope(), [X(1, 2, 3, 8).requires_grad_(), F().requires_grad_()])),
    case("qk-freqs-requires-grad", ValueError, r"freqs requires grad",
         lambda: (_qk(), [X(1, 2, 3, 8).requires_grad_(), X(1, 2, 3, 8).requires_grad_(), F().requires_grad_()])),
    # ---- rope_freqs
    case("rope-freqs-odd-dim", ValueError, r"rope_freqs: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.rope_freqs(7, 16), [])),
    case("rope-freqs-zero-dim", ValueError, r"rope_freqs: dim must be even and > 0, got 0",
         lambda: (lambda: rotary.rope_freqs(0, 16), [])),
    case("rope-freqs-negative-dim", ValueError, r"dim must be even and > 0, got -4",
         lambda: (lambda: rotary.rope_freqs(-4, 16), [])),
    case("rope-freqs-negative-len", ValueError, r"rope_freqs: max_seq_len must be >= 0, got -1",
         lambda: (lambda: rotary.rope_freqs(8, -1), [])),
    case("rope-freqs-theta-zero", ValueError, r"rope_freqs: theta must be finite and > 0, got 0",
         lambda: (lambda: rotary.rope_freqs(8, 16, 0.0), [])),
    case("rope-freqs-theta-negative", ValueError, r"theta must be finite and > 0, got -10000",
         lambda: (lambda: rotary.rope_freqs(8, 16, -10000.0), [])),
    case("rope-freqs-theta-nan", ValueError, r"theta must be finite and > 0, got nan",
         lambda: (lambda: rotary.rope_freqs(8, 16, float("nan")), [])),
    case("rope-freqs-theta-inf", ValueError, r"theta must be finite",
         lambda: (lambda: rotary.rope_freqs(8, 16, float("inf")), [])),
    # ---- RotaryEmbedding (Python)
    case("module-odd-dim", ValueError, r"dim must be even and > 0, got 7",
         lambda: (lambda: rotary.RotaryEmbedding(7, 16), [])),
    case("module-zero-len", ValueError, r"RotaryEmbedding: max_seq_len must be > 0, got 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 0), [])),
    case("module-bad-theta", ValueError, r"theta must be finite and > 0",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16, -1.0), [])),
    case("module-out-of-range", IndexError, r"RotaryEmbedding: start_pos \+ seq_len = 14 \+ 3 = 17 exceeds max_seq_len 16",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=14), [X(1, 2, 3, 8)])),
    case("module-negative-start", ValueError, r"RotaryEmbedding: start_pos must be >= 0, got -2",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x, start_pos=-2), [X(1, 2, 3, 8)])),
    case("module-wrong-head-dim", ValueError, r"freqs must have shape .*head_dim 6",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16)(x), [X(1, 2, 3, 6)])),
    case("module-qk-mismatch", ValueError, r"k must match q",
         lambda: (lambda q, k: rotary.RotaryEmbedding(8, 16)(q, k), [X(1, 2, 3, 8), X(1, 2, 4, 8)])),
    # ---- CppRotaryEmbedding
    case("cpp-odd-dim", ValueError, r"RotaryEmbedding: dim must be even and > 0, got 7",
         lambda: (lambda: rotary.CppRotaryEmbedding(7, 16), [])),
    case("cpp-zero-len", ValueError, r"RotaryEmbedding: max_seq_len must be > 0, got 0",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 0), [])),
    case("cpp-bad-theta", ValueError, r"theta must be finite and > 0",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16, 0.0), [])),
    case("cpp-out-of-range", IndexError, r"start_pos \+ seq_len = 14 \+ 3 = 17 exceeds max_seq_len 16",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x, start_pos=14), [X(1, 2, 3, 8)])),
    case("cpp-qk-out-of-range", IndexError, r"exceeds max_seq_len 16",
         lambda: (lambda q, k: rotary.CppRotaryEmbedding(8, 16)(q, k, start_pos=15), [X(1, 2, 3, 8), X(1, 1, 3, 8)])),
    case("cpp-negative-start", ValueError, r"start_pos must be >= 0, got -1",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x, start_pos=-1), [X(1, 2, 3, 8)])),
    case("cpp-odd-input-head-dim", ValueError, r"head_dim\) must be even",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16)(x), [X(1, 2, 3, 7)])),
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
    with pytest.raises(TypeError, match=r"positions must be int64"):
        rotary.apply_rope(torch.empty(2, 2, 3, 8, device="meta"), f, positions=torch.empty(2, dtype=torch.int32, device="meta"))
    out = rotary.apply_rope(torch.empty(2, 2, 3, 8, device="meta"), f, 1)
    assert out.shape == (2, 2, 3, 8) and out.device.type == "meta"


def test_positions_must_be_keyword():
    # torch's dispatcher reports a positional keyword-only argument as RuntimeError.
    with pytest.raises((TypeError, RuntimeError), match="positional"):
        torch.ops.rotary.apply_rope(X(1, 1, 2, 8), F(), 0, True, torch.tensor(1))


_OVERFLOW_SCRIPT = textwrap.dedent(
    """
    import sys, torch, rotary
    f = rotary.rope_freqs(8, 16)
    x = torch.randn(1, 1, 2, 8)
    m = rotary.CppRotaryEmbedding(8, 16)
    calls = {
        "apply_rope": lambda: rotary.apply_rope(x, f, 2**63 - 1),
        "apply_rope_qk": lambda: rotary.apply_rope_qk(x, x, f, 2**63 - 1),
        "CppRotaryEmbedding": lambda: m(x, start_pos=2**63 - 1),
    }
    bad = []
    for name, call in calls.items():
        try:
            call()
        except IndexError as e:
            assert "exceeds" in str(e), str(e)
        else:
            bad.append(name)
    if bad:
        print("no IndexError (read past the freqs table) from:", ", ".join(bad))
        sys.exit(3)
    """
)


def test_start_pos_overflow_is_rejected():
    """start_pos + seq_len must not wrap around int64 and slip past the range
    check (which would read far outside the table). Run in a subprocess: the
    bug reads arbitrary memory and may crash.

    Known library bug (csrc/checks.cpp, prepare_rope; csrc/module.cpp,
    check_range): ``start_pos + seq <= table_len`` overflows."""
    import os

    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.normpath(os.path.join(here, "..", "..", "python")), env.get("PYTHONPATH", "")]
    )
    r = subprocess.run([sys.executable, "-c", _OVERFLOW_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
