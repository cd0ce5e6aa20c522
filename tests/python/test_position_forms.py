"""Every form of positions (start_pos, 0-dim / [B] offsets, [B, S] ids and
the broadcasting size-1 forms) against the reference, and the errors
for negative positions and positions past the table."""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import (
    op_positions,
    PAIRING_IDS,
    PAIRINGS,
    Snapshot,
    assert_close_ref,
    gen,
    randn,
    layout_shape,
    ref_rope4,
    to_bhsd,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# Positions
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["int", "0d", "B", "BS", "1", "1S", "B1"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_position_forms(tables, form, interleaved):
    """Scalar start_pos, 0-dim offset, [B] offsets, [B, S] ids and the
    broadcasting size-1 forms, with partial rotary in BSHD."""
    B, H, S, D, r, L, start = 3, 2, 4, 12, 8, 40, 5
    f = tables(r, L)
    x = randn(layout_shape("BSHD", B, H, S, D), torch.float64, seed=44)
    g = gen(9)
    pos = {
        "int": None,
        "0d": torch.tensor(7),
        "B": torch.tensor([0, 20, 3]),
        "BS": torch.randint(0, L - start, (B, S), generator=g),
        "1": torch.tensor([11]),
        "1S": torch.randint(0, L - start, (1, S), generator=g),
        "B1": torch.randint(0, L - start, (B, 1), generator=g),
    }[form]
    out = rotary.apply_rope(x, f, interleaved=interleaved, layout="BSHD", **op_positions(start, pos))
    assert_close_ref(out, ref_rope4(x, r, start, interleaved, pos, layout="BSHD"), torch.float64)
    # Per-batch meaning, spelled out without the reference's grid helper.
    xb = to_bhsd(x, "BSHD")
    for b in range(B):
        for s in range(S):
            if pos is None:
                p = start + s
            elif pos.dim() <= 1:
                p = start + int(pos.reshape(-1)[b if pos.numel() > 1 else 0]) + s
            else:
                p = start + int(pos[b if pos.shape[0] > 1 else 0, s if pos.shape[1] > 1 else 0])
            want = rope_reference(xb[b : b + 1, :, s : s + 1, :r], p, interleaved)
            got = to_bhsd(out, "BSHD")[b : b + 1, :, s : s + 1, :r]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("offset-0d", dict(start=2, offsets=torch.tensor(-3))),
        ("offsets-B", dict(start=0, offsets=torch.tensor([0, -1]))),
        ("ids", dict(start=0, position_ids=torch.tensor([[1, 2, 3], [1, -1, 2]]))),
        ("ids-int32", dict(start=0, position_ids=torch.tensor([1, -1, 2], dtype=torch.int32))),
        ("varlen-offset", dict(start=0, offsets=torch.tensor(-1), cu=[0, 2, 6])),
        ("varlen-ids", dict(start=0, position_ids=torch.tensor([3, 4, 5, -1, 3, 3]), cu=[0, 2, 6])),
    ],
)
def test_negative_position_is_value_error(tables, name, kwargs):
    f = tables(8)
    kwargs = dict(kwargs)
    cu, start = kwargs.pop("cu", None), kwargs.pop("start")
    x = randn((6, 2, 8) if cu else (2, 2, 3, 8), seed=45)
    extra = {"cu_seqlens": torch.tensor(cu)} if cu else {}
    snap = Snapshot(x)
    origin = r"\(position_ids\)" if "position_ids" in kwargs else r"\(start_pos \d+ \+ offsets \+ s\)"
    with pytest.raises(ValueError, match=r"has negative position -\d+ " + origin):
        rotary.apply_rope(x, f, start, **kwargs, **extra)
    with pytest.raises(ValueError, match=r"apply_rope_: token .* has negative position"):
        rotary.apply_rope_(x, f, start, **kwargs, **extra)
    snap.check()


def test_varlen_past_table_is_index_error(tables):
    f = tables(8, 6)
    x = randn((9, 2, 8), seed=46)
    cu = torch.tensor([0, 3, 9])  # the second sequence reaches local index 5
    rotary.apply_rope(x, f, 0, cu_seqlens=cu)  # positions 0..5: inside
    with pytest.raises(IndexError, match=r"apply_rope: token \(batch 0, seq 8\) has position 6 .*outside the freqs table \[0, 6\)"):
        rotary.apply_rope(x, f, 1, cu_seqlens=cu)
    with pytest.raises(IndexError, match=r"outside the freqs table"):
        rotary.apply_rope(x, f, cu_seqlens=cu, **op_positions(0, torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 6]), packed=True))
