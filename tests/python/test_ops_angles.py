"""The angle each row turns by, against the independent float64 reference
(reference.py), on the CPU: apply_rope / apply_rope_qk with positions
(offsets, position_ids), inverse rotations and conjugate tables, and
rotary.freqs_table itself (up to 2**20 positions). (Split from the old
test_ops.py by concern.)"""

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import freqs_reference, inv_freq, rope_reference
from rotary_testing.rope_testing import (
    op_positions,
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    TOL,
    Snapshot,
    assert_close_ref,
    make_heads,
    positions_tensor,
)


# ---------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------
POSITION_KINDS = ["scalar", "batch", "batch1", "ids", "ids_b1", "ids_s1", "ids_noncontig"]


@pytest.mark.parametrize("kind", POSITION_KINDS)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_positions(tables, kind, interleaved, dtype):
    B, Hq, Hk, S, D, L, start = 3, 2, 1, 5, 16, 40, 6
    freqs = tables(D, L)
    pos = positions_tensor(kind, B, S, room=L - start, seed=26)
    q = make_heads(B, Hq, S, D, dtype, "transposed", seed=27)
    k = make_heads(B, Hk, S, D, dtype, seed=28)
    snap = Snapshot(q, k, pos, freqs)
    out = rotary.apply_rope(q, freqs, interleaved=interleaved, **op_positions(start, pos))
    oq, ok = rotary.apply_rope_qk(q, k, freqs, interleaved=interleaved, **op_positions(start, pos))
    snap.check()
    assert_close_ref(out, rope_reference(q, start, interleaved, pos), dtype)
    assert torch.equal(oq, out)
    assert_close_ref(ok, rope_reference(k, start, interleaved, pos), dtype)


def test_positions_scalar_offset_equals_start_pos(tables):
    freqs = tables(16, 40)
    x = make_heads(2, 3, 5, 16, seed=29)
    a = rotary.apply_rope(x, freqs, **op_positions(2, torch.tensor(7)))
    assert torch.equal(a, rotary.apply_rope(x, freqs, 9))
    b = rotary.apply_rope(x, freqs, **op_positions(0, torch.tensor([7, 7])))
    assert torch.equal(b, rotary.apply_rope(x, freqs, 7))


def test_position_ids_arange_equals_no_positions(tables):
    freqs = tables(16, 40)
    x = make_heads(2, 3, 5, 16, seed=30)
    ids = torch.arange(5).expand(2, 5)
    assert torch.equal(rotary.apply_rope(x, freqs, **op_positions(3, ids)), rotary.apply_rope(x, freqs, 3))


def test_position_ids_per_batch_rows(tables):
    """[B, S] ids rotate each batch row independently (left-padded batches)."""
    freqs = tables(16, 40)
    x = make_heads(2, 3, 4, 16, torch.float64, seed=31)
    ids = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    out = rotary.apply_rope(x, freqs, **op_positions(0, ids))
    assert torch.equal(out[:1], rotary.apply_rope(x[:1], freqs, 0))
    assert torch.equal(out[1:], rotary.apply_rope(x[1:], freqs, 10))


def test_negative_offsets_inside_table(tables):
    """Offsets may be negative as long as start_pos + offset + s stays in range."""
    freqs = tables(16, 40)
    x = make_heads(3, 2, 4, 16, torch.float64, seed=32)
    pos = torch.tensor([-6, -1, 2])
    out = rotary.apply_rope(x, freqs, **op_positions(6, pos))
    assert_close_ref(out, rope_reference(x, 6, True, pos), torch.float64)


def test_positions_may_exceed_range_without_start_pos_check(tables):
    """With positions, start_pos + S may exceed the table as long as every
    actual position is inside it."""
    freqs = tables(8, 16)
    x = make_heads(1, 1, 10, 8, seed=33)
    ids = torch.zeros(1, 10, dtype=torch.int64)
    out = rotary.apply_rope(x, freqs, **op_positions(15, ids))
    assert_close_ref(out, rope_reference(x, 15, True, ids), torch.float32)


# ---------------------------------------------------------------------------
# inverse
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("kind", ["none", "batch", "ids"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_inverse(tables, kind, interleaved, dtype):
    B, S, D, L, start = 2, 6, 24, 40, 5
    freqs = tables(D, L)
    pos = positions_tensor(kind, B, S, room=L - start, seed=34)
    x = make_heads(B, 3, S, D, dtype, "transposed", seed=35)
    inv = rotary.apply_rope(x, freqs, interleaved=interleaved, inverse=True, **op_positions(start, pos))
    assert_close_ref(inv, rope_reference(x, start, interleaved, pos, inverse=True), dtype)
    back = rotary.apply_rope(rotary.apply_rope(x, freqs, start, interleaved, positions=pos), freqs, interleaved=interleaved, inverse=True, **op_positions(start, pos))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(back, x, rtol=rtol, atol=atol)
    k = make_heads(B, 1, S, D, dtype, seed=36)
    iq, ik = rotary.apply_rope_qk(x, k, freqs, interleaved=interleaved, inverse=True, **op_positions(start, pos))
    assert torch.equal(iq, inv)
    assert_close_ref(ik, rope_reference(k, start, interleaved, pos, inverse=True), dtype)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conj_table_equals_inverse(tables, dtype, interleaved):
    freqs = tables(16, 32)
    x = make_heads(2, 3, 5, 16, dtype, seed=37)
    k = make_heads(2, 1, 5, 16, dtype, seed=38)
    inv = rotary.apply_rope(x, freqs, 4, interleaved, inverse=True)
    fwd = rotary.apply_rope(x, freqs, 4, interleaved)
    conj = freqs.conj()
    assert conj.is_conj()
    assert torch.equal(rotary.apply_rope(x, conj, 4, interleaved), inv)
    assert torch.equal(rotary.apply_rope(x, conj.resolve_conj(), 4, interleaved), inv)
    # conj table + inverse = forward
    assert torch.equal(rotary.apply_rope(x, conj, 4, interleaved, inverse=True), fwd)
    iq, ik = rotary.apply_rope_qk(x, k, conj, 4, interleaved)
    assert torch.equal(iq, inv)
    assert torch.equal(ik, rotary.apply_rope(k, freqs, 4, interleaved, inverse=True))
    assert not freqs.is_conj()


# ---------------------------------------------------------------------------
# rope_freqs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 10.5, 1.0])
@pytest.mark.parametrize("dim", [2, 8, 64, 128])
def test_rope_freqs_values(dim, theta):
    L = 257
    f = rotary.freqs_table(dim, L, theta)
    assert f.dtype == torch.complex64 and f.shape == (L, dim // 2) and f.is_contiguous()
    assert not f.requires_grad and f.device.type == "cpu"
    ref = freqs_reference(dim, L, theta)
    assert np.abs(f.numpy().astype(np.complex128) - ref).max() < 1e-7


def test_rope_freqs_default_theta():
    assert torch.equal(rotary.freqs_table(16, 8), rotary.freqs_table(16, 8, 10000.0))
    assert torch.equal(rotary.freqs_table(16, 8), rotary.freqs_table(dim=16, max_seq_len=8, theta=10000.0))


def test_rope_freqs_empty_table():
    f = rotary.freqs_table(8, 0)
    assert f.shape == (0, 4) and f.dtype == torch.complex64


def test_rope_freqs_first_rows():
    f = rotary.freqs_table(8, 3)
    assert torch.equal(f[0], torch.ones(4, dtype=torch.complex64))  # position 0: angle 0
    # pair 0 turns exactly one radian per position
    assert abs(complex(f[1, 0]) - np.exp(1j)) < 1e-7


@pytest.fixture(scope="module")
def huge_table():
    """dim 8, 2**20 + 1 rows: 4M complex64 values, 32 MB."""
    return rotary.freqs_table(8, 2**20 + 1)


def test_rope_freqs_million_positions(huge_table):
    """float64 angles keep the table within 1e-7 of exp(i pos theta_j) even at
    position 2**20 (float32 angles would be off by ~0.06 there)."""
    f = huge_table
    assert f.shape == (2**20 + 1, 4)
    ref = freqs_reference(8, 2**20 + 1)
    err = np.abs(f.numpy().astype(np.complex128) - ref)
    assert err.max() < 1e-7, f"max error {err.max()} at row {np.unravel_index(err.argmax(), err.shape)}"
    last = 2**20 * inv_freq(8)
    assert np.abs(f[2**20].numpy() - np.exp(1j * last)).max() < 1e-7


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_apply_rope_at_million_positions(huge_table, interleaved):
    x = make_heads(2, 2, 1, 8, torch.float64, seed=39)
    out = rotary.apply_rope(x, huge_table, 2**20, interleaved)
    assert_close_ref(out, rope_reference(x, 2**20, interleaved), torch.float64)
    ids = torch.tensor([[2**20], [2**19 + 12345]])
    out = rotary.apply_rope(x, huge_table, interleaved=interleaved, **op_positions(0, ids))
    assert_close_ref(out, rope_reference(x, 0, interleaved, ids), torch.float64)
