"""Packed variable-length batches (cu_seqlens, layout THD) against the
float64 reference run on each sequence alone (rope_testing.ref_varlen)."""

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
    cu_from_lens,
    random_strided,
    ref_varlen,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# Packed variable-length batches
# ---------------------------------------------------------------------------
VARLEN_LENS = [3, 0, 5, 1, 0, 4]  # empty sequences inside the batch


@pytest.mark.parametrize("kind", ["none", "offset", "seq-offsets", "ids"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_matches_reference(tables, dtype, interleaved, cu_dtype, kind):
    T, Hq, Hk, D, L, start = sum(VARLEN_LENS), 4, 2, 20, 32, 2
    cu = cu_from_lens(VARLEN_LENS, cu_dtype)
    f = tables(D, L)
    pos = {"none": None, "offset": torch.tensor(6), "ids": torch.randint(0, L - start, (T,), generator=gen(5)),
           # one start per sequence (flash-attn's seqlen_offsets, FlashInfer's offsets with indptr), int32 here
           "seq-offsets": torch.randint(0, L - start - max(VARLEN_LENS), (len(VARLEN_LENS),), generator=gen(6),
                                        dtype=torch.int32)}[kind]
    seq_offsets = pos if kind == "seq-offsets" else None
    where = dict(start_pos=start, offsets=pos) if seq_offsets is not None else op_positions(start, pos, packed=True)
    q = random_strided((T, Hq, D), dtype, seed=30 + len(kind))
    k = randn((T, Hk, D), dtype, seed=31)
    snap = Snapshot(q, k, cu, f)
    poison_allocator(q.numel(), dtype)
    out = rotary.apply_rope(q, f, interleaved=interleaved, cu_seqlens=cu, **where)
    oq, ok = rotary.apply_rope_qk(q, k, f, interleaved=interleaved, cu_seqlens=cu, **where)
    snap.check()
    assert out.shape == q.shape and ok.shape == k.shape
    ref_pos = None if seq_offsets is not None else pos
    assert_close_ref(out, ref_varlen(q, cu, None, start, interleaved, ref_pos, seq_offsets=seq_offsets), dtype)
    assert_close_ref(ok, ref_varlen(k, cu, None, start, interleaved, ref_pos, seq_offsets=seq_offsets), dtype)
    assert torch.equal(oq, out)


def test_varlen_per_sequence_offsets_past_the_table_and_in_place(tables):
    """[num_seqs] offsets: each sequence's own start, checked against the
    table per sequence (a refused in-place call writes nothing); a [1] offset
    is every sequence's; past the table with inv_freq, exact."""
    T, H, D, L = sum(VARLEN_LENS), 2, 16, 32
    cu = cu_from_lens(VARLEN_LENS)
    f = tables(D, L)
    offs = torch.tensor([0, 40, 3, 27, 0, 28])  # sequence 1 is empty: its offset reaches nothing
    x = randn((T, H, D), torch.float64, seed=40)
    torch.testing.assert_close(rotary.apply_rope(x, f, cu_seqlens=cu, offsets=offs),
                               ref_varlen(x, cu, seq_offsets=offs), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.apply_rope(x, f, cu_seqlens=cu, offsets=offs[2:3]),
                               ref_varlen(x, cu, seq_offsets=offs[2:3]), rtol=0, atol=1e-6)
    far = offs + torch.tensor([0, 0, 0, 0, 0, 1])  # the last sequence's last token at 32: past the table
    y = x.clone()
    with pytest.raises(IndexError, match=r"token 12 \(sequence 5, index 3\) has position 32 \(start_pos 0 \+ offsets "
                                         r"\+ s\), outside the freqs table \[0, 32\)"):
        rotary.apply_rope_(y, f, cu_seqlens=cu, offsets=far)
    assert torch.equal(y, x)
    inv, _ = rotary.inv_frequencies(D)
    torch.testing.assert_close(rotary.apply_rope(x, f, cu_seqlens=cu, offsets=far, inv_freq=inv),
                               ref_varlen(x, cu, seq_offsets=far), rtol=0, atol=1e-6)
    k = randn((T, 1, D), torch.float64, seed=41).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rotary.apply_rope_qk(a, b, f, 0, False, cu_seqlens=cu, offsets=offs),
                                    (x.clone().requires_grad_(), k))


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_varlen_equals_per_sequence_calls(tables, interleaved):
    """Each sequence of a packed batch gets exactly the bits of a 4-D call on
    that sequence alone."""
    T, H, D, start = sum(VARLEN_LENS), 3, 16, 5
    cu = cu_from_lens(VARLEN_LENS)
    f = tables(D)
    x = randn((T, H, D), seed=32)
    out = rotary.apply_rope(x, f, start, interleaved, cu_seqlens=cu)
    ids = torch.randint(0, 32, (T,), generator=gen(6))
    out_ids = rotary.apply_rope(x, f, interleaved=interleaved, cu_seqlens=cu, **op_positions(0, ids, packed=True))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = x[a:b].permute(1, 0, 2).unsqueeze(0)
        want = rotary.apply_rope(seg, f, start, interleaved)[0].permute(1, 0, 2)
        assert torch.equal(out[a:b], want)
        want = rotary.apply_rope(seg, f, interleaved=interleaved, **op_positions(0, ids[a:b][None]))[0].permute(1, 0, 2)
        assert torch.equal(out_ids[a:b], want)


@pytest.mark.parametrize(
    "lens", [[], [0], [0, 0], [7], [0, 7], [7, 0, 0], [1] * 7, [2, 0, 0, 5]], ids=lambda v: "lens" + str(v)
)
def test_varlen_edge_batches(tables, lens):
    """No tokens, empty sequences at either end, one long sequence, length-1 sequences."""
    T, H, D, start = sum(lens), 2, 8, 3
    cu = cu_from_lens(lens, torch.int32)
    f = tables(D)
    x = randn((T, H, D), torch.float64, seed=33)
    for interleaved in PAIRINGS:
        out = rotary.apply_rope(x, f, start, interleaved, cu_seqlens=cu)
        assert out.shape == x.shape
        assert_close_ref(out, ref_varlen(x, cu, None, start, interleaved), torch.float64)
        oq, ok = rotary.apply_rope_qk(x, x[:, :1], f, start, interleaved, cu_seqlens=cu)
        assert torch.equal(oq, out) and torch.equal(ok, out[:, :1])


def test_varlen_single_sequence_equals_4d(tables):
    x = randn((9, 3, 16), seed=34)
    f = tables(16)
    out = rotary.apply_rope(x, f, 4, False, cu_seqlens=torch.tensor([0, 9]), layout="THD")
    assert torch.equal(out, rotary.apply_rope(x[None], f, 4, False, layout="BSHD")[0])


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_varlen_inverse_round_trip(tables, interleaved):
    T, D = sum(VARLEN_LENS), 12
    cu = cu_from_lens(VARLEN_LENS)
    f = tables(D)
    x = randn((T, 2, D), torch.float64, seed=35)
    ids = torch.randint(0, 30, (T,), generator=gen(7))
    inv = rotary.apply_rope(x, f, interleaved=interleaved, inverse=True, cu_seqlens=cu, **op_positions(1, ids, packed=True))
    assert_close_ref(inv, ref_varlen(x, cu, None, 1, interleaved, ids, inverse=True), torch.float64)
    fwd = rotary.apply_rope(x, f, interleaved=interleaved, cu_seqlens=cu, **op_positions(1, ids, packed=True))
    back = rotary.apply_rope(fwd, f, interleaved=interleaved, inverse=True, cu_seqlens=cu, **op_positions(1, ids, packed=True))
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)


def test_varlen_strided_cu_seqlens(tables):
    """A cu_seqlens view with stride 2 holds the same boundaries."""
    x = randn((5, 2, 8), torch.float64, seed=36)
    f = tables(8)
    cu = torch.tensor([0, 99, 2, 99, 5, 99])[::2]
    assert cu.tolist() == [0, 2, 5] and cu.stride() == (2,)
    out = rotary.apply_rope(x, f, 0, cu_seqlens=cu)
    assert torch.equal(out, rotary.apply_rope(x, f, 0, cu_seqlens=cu.contiguous()))
