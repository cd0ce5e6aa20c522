"""inv_freq: positions past the freqs table computed in float64, with
start_pos, ids, varlen and partial rotary."""

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import inv_freq, rotate_pairs_nd
from rotary_testing.rope_testing import (
    op_positions,
    PAIRING_IDS,
    PAIRINGS,
    assert_close_ref,
    gen,
    randn,
    _inv,
    assert_tail_is_input,
    layout_shape,
    ref_rope4,
    ref_varlen,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# inv_freq: positions past the table, computed in float64
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", [10**6, 2**31, 2**40])
@pytest.mark.parametrize("variant", ["start_pos", "ids", "varlen", "partial-bshd"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_inv_freq_far_positions(tables, interleaved, variant, where):
    """A table of 8 rows; positions near `where` are computed exactly."""
    D, L = 16, 8
    r = 10 if variant == "partial-bshd" else D
    f = tables(r, L)
    inv = _inv(r)
    for dtype in (torch.float64, torch.float32):
        if variant == "start_pos":
            x = randn((2, 2, 3, D), dtype, seed=47)
            out = rotary.apply_rope(x, f, where, interleaved, inv_freq=inv)
            ref = ref_rope4(x, r, where, interleaved)
        elif variant == "ids":
            x = randn((2, 2, 3, D), dtype, seed=48)
            ids = torch.tensor([[where, 3, where + 7], [0, where - 1, 7]])  # inside and outside the table
            out = rotary.apply_rope(x, f, interleaved=interleaved, inv_freq=inv, **op_positions(0, ids))
            ref = ref_rope4(x, r, 0, interleaved, ids)
        elif variant == "varlen":
            x = randn((7, 2, D), dtype, seed=49)
            cu = torch.tensor([0, 4, 7], dtype=torch.int32)
            out = rotary.apply_rope(x, f, where, interleaved, cu_seqlens=cu, inv_freq=inv)
            ref = ref_varlen(x, cu, r, where, interleaved)
        else:
            x = randn(layout_shape("BSHD", 2, 2, 3, D), dtype, seed=50)
            pos = torch.tensor([where, 1])
            out = rotary.apply_rope(x, f, interleaved=interleaved, inv_freq=inv, layout="BSHD", **op_positions(0, pos))
            ref = ref_rope4(x, r, 0, interleaved, pos, layout="BSHD")
            assert_tail_is_input(out, x, r)
        assert_close_ref(out, ref, dtype)
        k = x[:, :1] if x.dim() == 3 else x
        if variant == "start_pos":
            iq, ik = rotary.apply_rope_qk(x, k, f, where, interleaved, inverse=True, inv_freq=inv)
            assert_close_ref(iq, ref_rope4(x, r, where, interleaved, inverse=True), dtype)


def test_inv_freq_inside_table_changes_nothing(tables):
    f = tables(16, 32)
    x = randn((2, 3, 5, 16), seed=51)
    ids = torch.randint(0, 32, (2, 5), generator=gen(10))
    for interleaved in PAIRINGS:
        a = rotary.apply_rope(x, f, interleaved=interleaved, **op_positions(0, ids))
        assert torch.equal(a, rotary.apply_rope(x, f, interleaved=interleaved, inv_freq=_inv(16), **op_positions(0, ids)))


def test_inv_freq_without_table_rows(tables):
    """An empty table [0, r/2] has no entry to take the attention scaling
    from (a scaled rule's would be lost): refused. One row is enough: every
    position past it is computed."""
    x = randn((1, 2, 4, 8), torch.float64, seed=52)
    with pytest.raises(ValueError, match=r"inv_freq needs a table of at least one row"):
        rotary.apply_rope(x, rotary.freqs_table(8, 0), 100, False, inv_freq=_inv(8))
    out = rotary.apply_rope(x, rotary.freqs_table(8, 1), 100, False, inv_freq=_inv(8))
    assert_close_ref(out, ref_rope4(x, None, 100, False), torch.float64)


def test_inv_freq_uses_table_scaling():
    """Past the table the computed rotation carries the table's scale (row 0,
    pair 0, real part), so it continues a scaled table seamlessly."""
    D, L, scale = 8, 6, 0.75
    f = rotary.freqs_table(D, L) * scale
    x = randn((1, 1, 2 * L, D), torch.float64, seed=53)
    out = rotary.apply_rope(x, f, 0, True, inv_freq=_inv(D))
    pos = np.arange(2 * L, dtype=np.float64)[None, None, :, None]
    want = scale * rotate_pairs_nd(x.numpy(), pos * inv_freq(D), True)
    torch.testing.assert_close(out, torch.from_numpy(want), rtol=1e-6, atol=1e-6)


def test_inv_freq_non_contiguous(tables):
    inv = torch.stack([_inv(8), torch.zeros(4, dtype=torch.float64)], 1)[:, 0]
    assert inv.stride() == (2,)
    x = randn((1, 2, 3, 8), torch.float64, seed=54)
    out = rotary.apply_rope(x, tables(8, 4), 50, True, inv_freq=inv)
    assert_close_ref(out, ref_rope4(x, None, 50), torch.float64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_inv_freq_is_refused(bad):
    """A NaN frequency slipped past the largest-angle check (std::max drops
    it) and turned every row past the table into NaN: refused by name, in
    place writing nothing."""
    f = rotary.freqs_table(8, 4)
    inv = torch.tensor(inv_freq(8), dtype=torch.float64)
    inv[1] = bad
    x = randn((1, 2, 6, 8), torch.float32, 3)
    before = x.clone()
    for op in (rotary.apply_rope, rotary.apply_rope_):
        with pytest.raises(ValueError, match=rf"{op.__name__}: inv_freq\[1\] must be finite, got {bad}"):
            op(x, f, 0, inv_freq=inv)
    assert torch.equal(x, before)


def test_sampled_rows_are_checked_as_the_table_is():
    """rope_freqs_at (single rows, bit for bit the table's) skipped the
    table's checks: rows whose angle passes 2^62 rad came back unreliable."""
    far = torch.tensor([3, 2**62])
    with pytest.raises(ValueError, match=r"freqs_at: inv_freq\[0\] = 1 gives the angle .* float64 angles keep their "
                                         r"phase below 2\^62 rad"):
        rotary._C.rope_freqs_at(8, far, 10000.0)
    near = rotary._C.rope_freqs_at(8, torch.tensor([3, 2**40]), 10000.0)
    assert torch.equal(near[0], rotary.freqs_table(8, 4)[3])
