"""Module state: threads, one state machine shared by both modules, a call
that raises leaving the module as it was, tables rebuilt under inference_mode
or after meta initialisation, and loading the library twice.

state_dict round trips and loading tables that do not match the options are
in test_state_dict.py (split off to keep files short; it imports the module
specs below)."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
from torch import nn

import rotary
from rotary_testing.reference import rotate_pairs_nd
from rotary_testing.rope_testing import assert_close_ref
from rotary_testing.scaling_reference import ref_frequencies

MODULES = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [2.0, 3.0, 4.0, 6.0],
    "original_max_position_embeddings": 64,
    "factor": 4.0,
}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def run_threads(fn, n):
    """Runs fn(i) for i < n on n threads released together; returns the results."""
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("scaling", [None, YARN], ids=["default", "yarn"])
def test_one_module_many_threads(kind, scaling):
    rope = MODULES[kind](32, 64, 10000.0, True, scaling)
    n, rounds = 8, 20
    qs = [torch.randn(2, 4, 16, 32, generator=gen(i)) for i in range(n)]
    ks = [torch.randn(2, 2, 16, 32, generator=gen(100 + i)) for i in range(n)]
    starts = [(7 * i) % 90 for i in range(n)]  # some past the 64 cached rows
    want = [rope(qs[i], ks[i], starts[i]) for i in range(n)]

    def call(i):
        outs = [rope(qs[i], ks[i], starts[i]) for _ in range(rounds)]
        return all(torch.equal(o[0], want[i][0]) and torch.equal(o[1], want[i][1]) for o in outs)

    assert all(run_threads(call, n))


@pytest.mark.parametrize("kind", list(MODULES))
def test_host_driven_rule_many_threads(kind):
    """dynamic rebuilds its table per call (reach 200 grows it, reach 16 goes
    back to the original). Alternating reaches from 8 threads: every call
    must see the table of its own reach, as a fresh module would."""
    rope = MODULES[kind](16, 64, 10000.0, False, DYNAMIC)
    fresh = MODULES[kind](16, 64, 10000.0, False, DYNAMIC)
    x = torch.randn(1, 2, 16, 16, generator=gen(3))
    short = fresh(x, 0)  # reach 16: original frequencies
    long_ = MODULES[kind](16, 64, 10000.0, False, DYNAMIC)(x, 184)  # reach 200: grown

    def call(i):
        ok = True
        for r in range(12):
            if (i + r) % 2:
                ok &= torch.equal(rope(x, 184), long_)
            else:
                ok &= torch.equal(rope(x, 0), short)
        return ok

    assert all(run_threads(call, 8))


def test_python_module_copies_and_pickles_with_its_state():
    m = rotary.RotaryEmbedding(16, 64, scaling=DYNAMIC)
    x = torch.randn(1, 1, 4, 16)
    m(x, 196)  # grown to 200
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.rope_state == 200 and torch.equal(c.freqs, m.freqs) and torch.equal(c.inv_freq, m.inv_freq)
        assert torch.equal(c(x, 100), m(x, 100))
        c(x, 0)  # the copy shrinks back; the original keeps its own state
        assert c.rope_state == 0 and m.rope_state == 200


# ---------------------------------------------------------------------------
# One state machine: both modules delegate every decision to RopeTables
# ---------------------------------------------------------------------------
def _same_state(a, b):
    assert a.host_driven == b.host_driven
    assert a.rope_state == b.rope_state
    assert a.attention_scaling == b.attention_scaling
    assert a.freqs.shape == b.freqs.shape and torch.equal(a.freqs, b.freqs)
    assert torch.equal(a.inv_freq, b.inv_freq)


@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE, YARN], ids=["dynamic", "longrope", "yarn"])
def test_modules_share_one_state_machine(scaling):
    py = rotary.RotaryEmbedding(8, 64, 500.0, False, scaling)
    cpp = rotary.CppRotaryEmbedding(8, 64, 500.0, False, scaling)
    assert py.host_driven == (scaling is not YARN)
    _same_state(py, cpp)
    x = torch.randn(2, 2, 8, 8, generator=gen(11))
    k = torch.randn(2, 1, 8, 8, generator=gen(12))
    odd = torch.randn(2, 2, 8, 7, generator=gen(13))
    calls = [
        lambda m: m(x, 10),  # reach 18
        lambda m: m(x, k, 80),  # reach 88: grows / long factors
        lambda m: m(x, 40),  # kept
        lambda m: m(x, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 150]] * 2)),  # reach 151
        lambda m: m(x, k, positions=torch.tensor([3, 120])),  # offsets: reach 128
        lambda m: m(odd, 500),  # refused: no change
        lambda m: m(x, 2**40),  # dynamic: the allocation fails; others: computed past the table
        lambda m: m(x, 0),  # back to the initial state
        lambda m: m(x, k, 300),
    ]
    for i, call in enumerate(calls):
        outs = []
        for m in (py, cpp):
            try:
                outs.append(call(m))
            except (ValueError, RuntimeError) as e:
                outs.append(type(e))
        _same_state(py, cpp)
        a, b = outs
        if isinstance(a, tuple):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), i
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), i
        else:
            assert a is b, (i, a, b)


def test_modules_share_one_state_machine_from_many_threads():
    """Grow-only calls (every reach > 64) from 8 threads: whatever the order,
    both modules end grown to the largest reach, bit for bit as a fresh
    module grown by that one call."""
    x = torch.randn(1, 2, 4, 16, generator=gen(21))
    starts = [100 + 37 * i for i in range(16)]
    mods = [MODULES[kind](16, 64, 10000.0, False, DYNAMIC) for kind in ("py", "cpp")]

    def call(i):
        for m in mods:
            for r in range(6):
                m(x, starts[(i + 5 * r) % len(starts)])
        return True

    assert all(run_threads(call, 8))
    fresh = rotary.RotaryEmbedding(16, 64, 10000.0, False, DYNAMIC)
    fresh(x, max(starts))
    assert fresh.rope_state == max(starts) + 4
    for m in mods:
        _same_state(m, fresh)


# ---------------------------------------------------------------------------
# A call that raises leaves the module as it was
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MODULES))
def test_refused_call_leaves_the_module_as_it_was(kind):
    m = MODULES[kind](8, 64, scaling=DYNAMIC)
    before = (m.freqs.clone(), m.inv_freq.clone())
    fresh = MODULES[kind](8, 64, scaling=DYNAMIC)

    def unchanged():
        assert m.rope_state == 0 and m.freqs.shape == (64, 4)
        assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])

    with pytest.raises(ValueError, match="head_dim"):
        m(torch.randn(1, 1, 4, 7), 996)  # odd head_dim: the reach 1000 must not grow the table
    unchanged()
    x = torch.randn(1, 1, 4, 8)
    assert torch.equal(m(x, 300), fresh(x, 300))
    assert torch.equal(m(x, 3), fresh(x, 3))
    # float32 angles have no on-the-fly path: past the rows a dynamic table grows to is an IndexError
    m32 = MODULES[kind](8, 64, scaling=DYNAMIC, angle_dtype="float32")
    before32 = m32.freqs.clone()
    with pytest.raises(IndexError, match=r"exceeds the rows a dynamic table grows to, 1048576.*angle_dtype=float64"):
        m32(x, 2**20)
    assert m32.rope_state == 0 and torch.equal(m32.freqs, before32)


@pytest.mark.parametrize("kind", list(MODULES))
def test_far_dynamic_reach_keeps_the_table_bounded(kind):
    """A reach of 2^40 (one row per position would not fit in memory) is
    served from row 0 alone, every other position computed on the fly
    (tests/fuzz/regressions.py checks the values against the reference)."""
    m = MODULES[kind](8, 64, scaling=DYNAMIC)
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    got = m(x, 2**40)
    assert m.freqs.shape == (1, 4) and m.rope_state == 2**40 + 4
    assert torch.equal(got, MODULES[kind](8, 64, scaling=DYNAMIC)(x, 2**40)) and got.isfinite().all()


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("spec", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_tables_rebuilt_under_inference_mode_serve_autograd_later(kind, spec):
    """A rule that rebuilds its tables inside torch.inference_mode() installs
    normal tensors: later calls with autograd still work (inference tensors
    cannot be saved for backward)."""
    with torch.inference_mode():
        m = MODULES[kind](8, 64, scaling=spec)
        m(torch.randn(1, 2, 4, 8), 100)
    assert not m.freqs.is_inference() and not m.inv_freq.is_inference()
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=gen(5), requires_grad=True)
    g = torch.randn(1, 2, 4, 8, dtype=torch.float64, generator=gen(6))
    y = m(x, 100)
    (gx,) = torch.autograd.grad((y * g).sum(), x)
    # float64 reference: positions 100..103 under the rule at reach 104 (the
    # complex64 table limits it to the float64 tolerance); the gradient is the
    # inverse rotation of g, with the same attention scaling
    inv, att = ref_frequencies(8, 10000.0, {**spec, "max_position_embeddings": 64}, 104)
    angle = np.arange(100, 104, dtype=np.float64)[:, None] * np.array(inv)
    want = att * rotate_pairs_nd(x.detach().numpy(), angle, True)
    want_gx = att * rotate_pairs_nd(g.numpy(), -angle, True)
    assert_close_ref(y, torch.from_numpy(want), torch.float64)
    assert_close_ref(gx, torch.from_numpy(want_gx), torch.float64)


@pytest.mark.parametrize("spec", [None, YARN, DYNAMIC], ids=["plain", "yarn", "dynamic"])
def test_to_empty_from_meta_rebuilds_the_tables(spec):
    """Meta initialisation, then to_empty: the tables hold no values on meta,
    so they are rebuilt from the options, in the state the rule was in."""
    m = rotary.RotaryEmbedding(8, 32, scaling=spec)
    x = torch.randn(1, 2, 80, 8, dtype=torch.float64, generator=gen(3))
    want = m(x)  # a dynamic rule grows its table to 80 rows here
    freqs, inv_freq, state = m.freqs.clone(), m.inv_freq.clone(), m.rope_state
    parent = nn.Sequential(m).to("meta")
    assert m.freqs.is_meta and m.inv_freq.is_meta
    assert parent.to_empty(device="cpu") is parent
    assert torch.equal(m.freqs, freqs) and torch.equal(m.inv_freq, inv_freq) and m.rope_state == state
    assert torch.equal(m(x), want)


@pytest.mark.parametrize("spec", [None, DYNAMIC], ids=["plain", "dynamic"])
def test_assign_load_into_a_meta_model_takes_the_saved_device(spec):
    """load_state_dict(sd, assign=True) into a meta-initialised model (torch's
    way to load big models): the tables were rebuilt on meta, so the model
    could not run. They are rebuilt where the saved ones are, in their state."""
    src = nn.Sequential(nn.Linear(8, 8), rotary.RotaryEmbedding(8, 64, scaling=spec))
    x = torch.randn(1, 2, 80, 8, dtype=torch.float64, generator=gen(4))
    src[1](x)  # a dynamic rule grows to 80 here
    with torch.device("meta"):
        dst = nn.Sequential(nn.Linear(8, 8), rotary.RotaryEmbedding(8, 64, scaling=spec))
    dst.load_state_dict(src.state_dict(), assign=True)
    rope = dst[1]
    assert rope.freqs.device.type == "cpu" and rope.inv_freq.device.type == "cpu"
    assert rope.rope_state == src[1].rope_state == (80 if spec else 0)
    inv, att = ref_frequencies(8, 10000.0, {**(spec or {}), "max_position_embeddings": 64}, 80)
    angle = np.arange(80)[:, None] * np.array(inv)
    assert_close_ref(rope(x), torch.from_numpy(att * rotate_pairs_nd(x.numpy(), angle, True)), torch.float64)


def test_a_far_dynamic_state_survives_copies():
    """A dynamic rule grown past 2^53 (positions go to 2^60): its inv_freq no
    longer tells the length, and the C++ module's clone, deepcopy and pickle
    (which rebuilt it from the tables) refused it; they carry the state."""
    far = 2**53 + 1
    cpp = rotary.CppRotaryEmbedding(8, 16, scaling={"rope_type": "dynamic", "factor": 2.0})
    x = torch.randn(1, 1, 2, 8, dtype=torch.float64, generator=gen(5))
    want = cpp(x, far - 2)  # reach far: grows
    for made in (cpp.clone(), copy.deepcopy(cpp), pickle.loads(pickle.dumps(cpp))):
        assert made.rope_state == far
        assert torch.equal(made(x, far - 2), want)


def test_a_meta_module_reports_tables_a_load_leaves_out():
    # Its own tables are meta (no values): missing keys, not "the module keeps its own".
    with torch.device("meta"):
        m = rotary.RotaryEmbedding(8, 16)
    result = m.load_state_dict({}, strict=False, assign=True)
    assert set(result.missing_keys) == {"freqs", "inv_freq"}


# ---------------------------------------------------------------------------
# Loading the library twice
# ---------------------------------------------------------------------------
_TWICE = textwrap.dedent(
    """
    import importlib, os, sys, torch
    import rotary
    lib = os.path.join(os.path.dirname(rotary.__file__), "librotary.so")
    assert os.path.exists(lib), lib
    torch.ops.load_library(lib)
    torch.ops.load_library(os.path.realpath(lib))
    first = sys.modules["rotary._C"]
    import rotary._C
    del sys.modules["rotary._C"]
    again = importlib.import_module("rotary._C")
    importlib.reload(rotary)
    x = torch.randn(1, 2, 3, 8)
    f = rotary.freqs_table(8, 16)
    a = torch.ops.rotary.apply_rope(x, f, 2)
    b = rotary.apply_rope(x, f, 2)
    c = rotary.RotaryEmbedding(8, 16)(x, 2)
    d = again.CppRotaryEmbedding(8, 16)(x, 2)
    e = first.CppRotaryEmbedding(8, 16)(x, 2)
    assert all(torch.equal(a, t) for t in (b, c, d, e))
    print("ok")
    """
)


def test_load_library_twice():
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = os.path.dirname(os.path.dirname(rotary.__file__))
    env["PYTHONPATH"] = os.pathsep.join([pkg, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _TWICE], env=env, capture_output=True, text=True, timeout=300, cwd=here)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
