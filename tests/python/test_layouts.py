"""RoPE in the BHSD / BSHD / SBHD layouts against the float64 reference
(reference.py, through rope_testing.ref_rope4), with random strides,
every positions form and the inverse; and a check that the reference
helpers reject a wrong rotary dim, pairing, layout or token index."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import (
    op_positions,
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    Snapshot,
    assert_close_ref,
    gen,
    poison_allocator,
    randn,
    LAYOUT_NAMES,
    assert_tail_is_input,
    layout_shape,
    random_strided,
    ref_rope4,
    ref_varlen,
    to_bhsd,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


def test_reference_helpers_have_teeth(tables):
    """The comparisons reject the wrong rotary dim, pairing, layout reading
    and global (instead of per-sequence) token index."""
    f = tables(8)
    x = randn((2, 3, 4, 12), torch.float64, seed=0)
    out = rotary.apply_rope(x, f, 2)
    assert_close_ref(out, ref_rope4(x, 8, 2), torch.float64)
    for wrong in (ref_rope4(x, None, 2), ref_rope4(x, 8, 2, False), ref_rope4(x, 8, 3), ref_rope4(x, 8, 2, inverse=True)):
        with pytest.raises(AssertionError):
            assert_close_ref(out, wrong, torch.float64)
    out = rotary.apply_rope(x, f, 2, layout="BSHD")
    assert_close_ref(out, ref_rope4(x, 8, 2, layout="BSHD"), torch.float64)
    with pytest.raises(AssertionError):
        assert_close_ref(out, ref_rope4(x, 8, 2), torch.float64)
    x3 = x[0]
    cu = torch.tensor([0, 1, 3])
    out = rotary.apply_rope(x3, f, 2, cu_seqlens=cu)
    assert_close_ref(out, ref_varlen(x3, cu, 8, 2), torch.float64)
    with pytest.raises(AssertionError):
        assert_close_ref(out, ref_varlen(x3, torch.tensor([0, 3]), 8, 2), torch.float64)


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_matches_reference(tables, layout, dtype, interleaved):
    B, Hq, Hk, S, D, start = 2, 4, 2, 5, 20, 3
    f = tables(D)
    q = randn(layout_shape(layout, B, Hq, S, D), dtype, seed=1)
    k = randn(layout_shape(layout, B, Hk, S, D), dtype, seed=2)
    snap = Snapshot(q, k, f)
    poison_allocator(q.numel(), dtype)
    out = rotary.apply_rope(q, f, start, interleaved, layout=layout)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved, layout=layout)
    snap.check()
    # The output has the input's shape and memory layout.
    assert out.shape == q.shape and out.stride() == q.stride()
    assert oq.stride() == q.stride() and ok.stride() == k.stride()
    assert_close_ref(out, ref_rope4(q, None, start, interleaved, layout=layout), dtype)
    assert_close_ref(ok, ref_rope4(k, None, start, interleaved, layout=layout), dtype)
    assert torch.equal(oq, out)
    # A layout name is only a view: the BHSD op on the permuted view gives the same bits.
    assert torch.equal(to_bhsd(out, layout), rotary.apply_rope(to_bhsd(q, layout), f, start, interleaved))


POS_KINDS = ["none", "scalar", "batch", "batch1", "ids", "ids_b1", "ids_s1"]


def make_positions(kind, B, S, room, seed):
    g = gen(seed)
    if kind == "none":
        return None
    if kind == "scalar":
        return torch.tensor(int(torch.randint(0, room - S + 1, (), generator=g)))
    if kind == "batch":
        return torch.randint(0, room - S + 1, (B,), generator=g)
    if kind == "batch1":
        return torch.randint(0, room - S + 1, (1,), generator=g)
    if kind == "ids":
        return torch.randint(0, room, (S, B), generator=g).t()  # non-contiguous ids
    if kind == "ids_b1":
        return torch.randint(0, room, (1, S), generator=g)
    if kind == "ids_s1":
        return torch.randint(0, room, (B, 1), generator=g)
    raise ValueError(kind)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_random_strides(tables, layout, interleaved, seed):
    """Random memory orders and gaps, cycling dtypes, positions forms and
    rotary dims; q and k with different strides."""
    dtype = DTYPES[seed % 4]
    kind = POS_KINDS[(seed + len(layout) + interleaved) % len(POS_KINDS)]
    B, Hq, Hk, S, D, L, start = 3, 3, 1, 6, 24, 40, 2
    r = [24, 16, 2, 18, 8, 24][seed]
    f = tables(r, L)
    pos = make_positions(kind, B, S, L - start, seed)
    q = random_strided(layout_shape(layout, B, Hq, S, D), dtype, seed=10 + seed)
    k = random_strided(layout_shape(layout, B, Hk, S, D), dtype, seed=20 + seed)
    snap = Snapshot(q, k)
    oq, ok = rotary.apply_rope_qk(q, k, f, interleaved=interleaved, layout=layout, **op_positions(start, pos))
    out = rotary.apply_rope(k, f, interleaved=interleaved, layout=layout, **op_positions(start, pos))
    snap.check()
    assert_close_ref(oq, ref_rope4(q, r, start, interleaved, pos, layout=layout), dtype)
    assert_close_ref(ok, ref_rope4(k, r, start, interleaved, pos, layout=layout), dtype)
    assert torch.equal(out, ok)
    assert_tail_is_input(oq, q, r)
    # In place on a copy with the same strides: the same bits, tail untouched.
    q2 = q.clone() if q.is_contiguous() else random_strided(q.shape, dtype, seed=10 + seed)
    k2 = random_strided(k.shape, dtype, seed=20 + seed)
    res = rotary.apply_rope_qk_(q2, k2, f, interleaved=interleaved, layout=layout, **op_positions(start, pos))
    assert res[0] is q2 and res[1] is k2
    assert torch.equal(q2, oq) and torch.equal(k2, ok)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_inverse_round_trip(tables, layout, interleaved):
    B, H, S, D, start = 2, 3, 5, 16, 4
    f = tables(D)
    x = randn(layout_shape(layout, B, H, S, D), torch.float64, seed=3)
    pos = torch.tensor([1, 7])
    inv = rotary.apply_rope(x, f, interleaved=interleaved, inverse=True, layout=layout, **op_positions(start, pos))
    assert_close_ref(inv, ref_rope4(x, None, start, interleaved, pos, True, layout), torch.float64)
    fwd = rotary.apply_rope(x, f, interleaved=interleaved, layout=layout, **op_positions(start, pos))
    back = rotary.apply_rope(fwd, f, interleaved=interleaved, inverse=True, layout=layout, **op_positions(start, pos))
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)
