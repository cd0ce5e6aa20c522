"""Every form of positions (start_pos, 0-dim / [B] offsets, [B, S] ids and
the broadcasting size-1 forms) against the reference, and the errors
for negative positions and positions past the table."""

import faulthandler

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
from rotary_testing.rope_testing import make_heads, positions_tensor
from rotary_testing.devices import assert_matches_cpu, needs_cuda, sync

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


def test_rising_positions_name_their_first_token_past_the_table(tables):
    """Offsets (and ids broadcast over seq) rise with s: the first token past
    the table is named, as in a walk of every token, and an empty call of
    2^40 tokens a row is checked without walking them."""
    f = tables(8, 16)
    x = randn((2, 2, 30, 8), seed=47)
    with pytest.raises(IndexError, match=r"apply_rope: token \(batch 1, seq 12\) has position 16 \(start_pos 1 \+ "
                                         r"offsets \+ s\), outside the freqs table \[0, 16\)"):
        rotary.apply_rope(x[:, :, :14], f, 1, offsets=torch.tensor([0, 3]))
    ids = torch.tensor([[2], [17]]).expand(2, 30)
    with pytest.raises(IndexError, match=r"token \(batch 1, seq 0\) has position 17 \(position_ids\), outside"):
        rotary.apply_rope(x, f, position_ids=ids)
    empty = torch.empty(2, 0, 2**40, 8)
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 11\) has position 16 .*outside the freqs table"):
        rotary.apply_rope(empty, f, 0, offsets=torch.tensor([5, 0]))
    inv = rotary.inv_frequencies(8)[0]
    assert rotary.apply_rope(empty, f, 0, offsets=torch.tensor([5, 0]), inv_freq=inv).shape == empty.shape
    huge = torch.empty(0).as_strided((1, 0, 2**62, 8), (0, 0, 8, 1))  # past 2^61 tokens: no position overflows
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 1152921504606846966\) has position "
                                         r"1152921504606846976 \(start_pos 0 \+ offsets \+ s\); positions must be < 2\^60"):
        rotary.apply_rope(huge, f, 0, offsets=torch.tensor([10]), inv_freq=inv)


def test_an_empty_call_over_rows_that_share_positions_checks_one_row(tables):
    """Positions shared by every batch row (0-d offsets, ids [seq] or [1,
    seq], an expanded [batch, seq], N-D ids expanded over seq) were checked
    once per row, and N-D ids once per token: an empty call of 2^40 rows or
    tokens ran for hours. One row is checked, and its failure named as before.
    A regression would hang: the watchdog ends the run with this test's stack."""
    faulthandler.dump_traceback_later(300, exit=True)
    try:
        _empty_calls_over_shared_rows(tables)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _empty_calls_over_shared_rows(tables):
    f = tables(8, 16)
    inv = rotary.inv_frequencies(8)[0]
    empty = torch.empty(2**40, 0, 4, 8)
    forms = (lambda d: dict(offsets=torch.tensor(d)), lambda d: dict(position_ids=torch.arange(4) + d),
             lambda d: dict(position_ids=(torch.arange(4) + d)[None]),
             lambda d: dict(position_ids=(torch.arange(4) + d).expand(2**40, 4)))
    for form in forms:
        assert rotary.apply_rope(empty, f, **form(3)).shape == empty.shape
        with pytest.raises(IndexError, match=r"token \(batch 0, seq [1-3]\) has position 16 .*outside the freqs table"):
            rotary.apply_rope(empty, f, **form(13))
        with pytest.raises(ValueError, match=r"token \(batch 0, seq 0\) has negative position -1 "):
            rotary.apply_rope(empty, f, **form(-1))
    long = torch.empty(1, 0, 2**40, 8)
    ids, far = (torch.tensor([[3], [m]]).expand(2, 2**40) for m in (5, 25))  # [n_axes, seq], one position an axis
    assert rotary.apply_rope(long, f, position_ids=ids, pair_axes=[0, 0, 1, 1]).shape == long.shape
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 0\) has position 25 on axis 1 \(position_ids\), outside"):
        rotary.apply_rope(long, f, position_ids=far, pair_axes=[0, 0, 1, 1])
    assert rotary.apply_rope(long, f, position_ids=far, pair_axes=[0, 0, 1, 1], inv_freq=inv).shape == long.shape


def test_varlen_past_table_is_index_error(tables):
    f = tables(8, 6)
    x = randn((9, 2, 8), seed=46)
    cu = torch.tensor([0, 3, 9])  # the second sequence reaches local index 5
    rotary.apply_rope(x, f, 0, cu_seqlens=cu)  # positions 0..5: inside
    with pytest.raises(IndexError, match=r"apply_rope: token 8 \(sequence 1, index 5\) has position 6 .*outside the freqs table \[0, 6\)"):
        rotary.apply_rope(x, f, 1, cu_seqlens=cu)
    with pytest.raises(IndexError, match=r"outside the freqs table"):
        rotary.apply_rope(x, f, cu_seqlens=cu, **op_positions(0, torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 6]), packed=True))


@pytest.mark.parametrize("kind", ["scalar", "batch", "batch1", "ids", "ids_b1", "ids_s1", "ids_noncontig"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_positions(device, tables, kind, interleaved, dtype):
    B, S, D, start = 3, 9, 64, 4
    pos = positions_tensor(kind, B, S, room=64 - start, seed=220, device=device)
    q = make_heads(B, 4, S, D, dtype, "transposed", seed=221, device=device)
    k = make_heads(B, 1, S, D, dtype, seed=222, device=device)
    snap = Snapshot(q, k, pos)
    out = rotary.apply_rope(q, tables(D, 64).to(device), interleaved=interleaved, **op_positions(start, pos))
    oq, ok = rotary.apply_rope_qk(q, k, tables(D, 64).to(device), interleaved=interleaved, inverse=True, **op_positions(start, pos))
    sync(device)
    snap.check()
    assert_close_ref(out, rope_reference(q, start, interleaved, pos), dtype)
    assert_close_ref(oq, rope_reference(q, start, interleaved, pos, inverse=True), dtype)
    assert_close_ref(ok, rope_reference(k, start, interleaved, pos, inverse=True), dtype)
    out_cpu = rotary.apply_rope(q.cpu(), tables(D, 64), interleaved=interleaved, **op_positions(start, pos.cpu()))
    assert_matches_cpu(out, out_cpu, dtype)


@needs_cuda
@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_qk"])
def test_device_positions_outside_table_give_nan(op):
    """README: device-side positions are not read on the host; a position
    outside the table yields NaN for that token (never an out-of-bounds read),
    and every other token is still rotated correctly."""
    f = rotary.freqs_table(16, 32).cuda()
    x = make_heads(2, 3, 4, 16, seed=290, device="cuda")
    ids = torch.tensor([[0, 5, 32, 31], [-1, 7, 1000, 2]], device="cuda")
    if op == "apply_rope":
        out = rotary.apply_rope(x, f, interleaved=True, **op_positions(0, ids))
    else:
        out, _ = rotary.apply_rope_qk(x, x[:, :1], f, interleaved=True, **op_positions(0, ids))
    torch.cuda.synchronize()
    bad = torch.tensor([[False, False, True, False], [True, False, True, False]])
    out = out.cpu()
    assert torch.equal(out.isnan().all(-1).all(1), bad)  # [B, S]: whole token NaN or not
    good_ids = ids.cpu().clamp(0, 31)
    ref = rope_reference(x, 0, True, good_ids)
    mask = (~bad)[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[mask].double(), ref[mask], rtol=1e-5, atol=1e-5)
