"""Inputs that are not errors: calls formerly refused (past the table, partial
rotary) or formerly computed wrong (disjoint in-place views, conjugate
tables), now equal to the float64 reference; NaN / Inf propagate instead of
raising. Split from test_errors.py to keep files short."""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import Snapshot, assert_close_ref
from test_errors import F, INV, X


# ---- formerly wrong results: now refused (test_errors_inplace.py), or equal to the reference
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
