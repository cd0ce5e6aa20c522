"""start_pos near or past int64: rejected with IndexError / ValueError naming
start_pos and the 2^60 bound, never wrapping around and reading outside the
table. Split from test_errors.py to keep files short."""

import subprocess
import sys
import textwrap

import pytest

import rotary
from rotary_testing.rope_testing import Snapshot
from test_errors import F, INV, X


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
