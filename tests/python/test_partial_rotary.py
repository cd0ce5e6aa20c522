"""Partial rotary (freqs narrower than head_dim): the reference on
x[..., :r] plus the untouched tail, alone and with varlen, layouts and ids."""

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
    VARLEN_LENS,
    assert_tail_is_input,
    bits,
    cu_from_lens,
    layout_shape,
    random_strided,
    ref_rope4,
    ref_varlen,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# Partial rotary
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("r", [2, 16, 34, 40])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_partial_rotary(tables, dtype, interleaved, r):
    """freqs [L, r/2] rotates dims [0, r) (pairs (2j, 2j+1) or (j, j + r/2))
    and copies [r, D); in place, [r, D) is not touched."""
    B, Hq, Hk, S, D, start = 2, 3, 1, 5, 40, 6
    f = tables(r)
    q = randn((B, Hq, S, D), dtype, seed=40)
    k = randn((B, S, Hk, D), dtype, seed=41).transpose(1, 2)
    snap = Snapshot(q, k)
    poison_allocator(q.numel(), dtype)
    out = rotary.apply_rope(q, f, start, interleaved)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    snap.check()
    assert_close_ref(out, ref_rope4(q, r, start, interleaved), dtype)
    assert_close_ref(ok, ref_rope4(k, r, start, interleaved), dtype)
    assert torch.equal(oq, out)
    assert_tail_is_input(out, q, r)
    assert_tail_is_input(ok, k, r)
    # The rotated part is exactly a full rotation of the narrow view.
    assert torch.equal(out[..., :r], rotary.apply_rope(q[..., :r], f, start, interleaved))
    # In place: the same bits in [0, r); the tail keeps its NaN bits untouched.
    x = q.clone()
    x[..., r:] = float("nan")
    tail = x[..., r:].clone()
    assert rotary.apply_rope_(x, f, start, interleaved) is x
    assert torch.equal(x[..., :r], out[..., :r])
    assert torch.equal(bits(x[..., r:]), bits(tail))


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_partial_rotary_varlen_layout_positions(tables, interleaved):
    """Partial rotary combined with varlen, layouts and ids."""
    r, D, L = 8, 14, 32
    f = tables(r, L)
    cu = cu_from_lens(VARLEN_LENS, torch.int32)
    T = int(cu[-1])
    x = random_strided((T, 3, D), torch.float32, seed=42)
    ids = torch.randint(0, L, (T,), generator=gen(8))
    out = rotary.apply_rope(x, f, interleaved=interleaved, cu_seqlens=cu, **op_positions(0, ids, packed=True))
    assert_close_ref(out, ref_varlen(x, cu, r, 0, interleaved, ids), torch.float32)
    assert_tail_is_input(out, x, r)
    y = random_strided(layout_shape("SBHD", 2, 3, 5, D), torch.bfloat16, seed=43)
    pos = torch.tensor([[0, 3, 1, 30, 9], [4, 4, 4, 4, 4]])
    out = rotary.apply_rope(y, f, interleaved=interleaved, layout="SBHD", **op_positions(1, pos))
    assert_close_ref(out, ref_rope4(y, r, 1, interleaved, pos, layout="SBHD"), torch.bfloat16)
    assert_tail_is_input(out, y, r)
