"""rotary.apply_rope / apply_rope_qk against the independent float64
reference (reference.py), on the CPU: every dtype, pairing and head_dim, the
seed's complex multiply and Hugging Face's rotate_half, non-contiguous
inputs, start_pos and sequence length, empty tensors. (Split from the old
test_ops.py by concern: positions, inverse and the table are in
test_ops_angles.py, every device in test_ops_devices.py.)"""

import pytest
import torch

import rotary
from rotary_testing.reference import hf_apply_rope, rope_reference, seed_apply_rope, seed_precompute_freqs
from rotary_testing.rope_testing import (
    op_positions,
    DTYPE_IDS,
    DTYPES,
    LAYOUTS,
    PAIRING_IDS,
    PAIRINGS,
    TOL,
    Snapshot,
    assert_close_ref,
    make_heads,
    make_packed_qkv,
    poison_allocator,
    randn,
)

HEAD_DIMS = [2, 6, 34, 64, 80, 128]  # 34: vector body + scalar tail


# ---------------------------------------------------------------------------
# apply_rope / apply_rope_qk vs the float64 reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_rope_matches_reference(tables, dtype, head_dim, interleaved):
    B, H, S, start = 2, 3, 5, 4
    freqs = tables(head_dim)
    x = make_heads(B, H, S, head_dim, dtype, seed=head_dim)
    snap = Snapshot(x, freqs)
    poison_allocator(x.numel(), dtype)
    out = rotary.apply_rope(x, freqs, start, interleaved)
    snap.check()
    assert out.shape == x.shape and out.device == x.device
    assert out.data_ptr() != x.data_ptr()
    assert_close_ref(out, rope_reference(x, start, interleaved), dtype)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_rope_qk_matches_reference(tables, dtype, head_dim, interleaved):
    B, Hq, Hk, S, start = 2, 4, 2, 5, 3  # grouped-query: Hq != Hk
    freqs = tables(head_dim)
    q = make_heads(B, Hq, S, head_dim, dtype, seed=1)
    k = make_heads(B, Hk, S, head_dim, dtype, seed=2)
    snap = Snapshot(q, k, freqs)
    poison_allocator(q.numel(), dtype)
    oq, ok = rotary.apply_rope_qk(q, k, freqs, start, interleaved)
    snap.check()
    assert oq.shape == q.shape and ok.shape == k.shape
    assert_close_ref(oq, rope_reference(q, start, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, start, interleaved), dtype)
    # One fused launch does exactly what two single-tensor calls do.
    assert torch.equal(oq, rotary.apply_rope(q, freqs, start, interleaved))
    assert torch.equal(ok, rotary.apply_rope(k, freqs, start, interleaved))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [2, 64, 80])
def test_matches_seed_complex_multiply(tables, dtype, head_dim):
    """Interleaved pairing == the seed's view_as_complex multiply."""
    freqs = tables(head_dim)
    x = make_heads(2, 3, 6, head_dim, dtype, seed=7)
    out = rotary.apply_rope(x, freqs, 5, True)
    seed = seed_apply_rope(x, freqs, 5)
    rtol, atol = TOL[dtype]
    # Both round an fp32 (or better) result once: at most one ulp apart.
    torch.testing.assert_close(out.double(), seed.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [2, 64, 80])
def test_matches_hf_rotate_half(tables, dtype, head_dim):
    """interleaved=False == Hugging Face rotate_half."""
    freqs = tables(head_dim)
    x = make_heads(2, 3, 6, head_dim, dtype, seed=8)
    out = rotary.apply_rope(x, freqs, 2, False)
    hf = hf_apply_rope(x, 2)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), hf.double(), rtol=rtol, atol=atol)


def test_table_close_to_seed_table():
    """The seed's float32-angle table agrees at small positions (it drifts
    at large ones, which is why rotary computes angles in float64)."""
    ours = rotary.freqs_table(64, 32)
    seed = seed_precompute_freqs(64, 32)
    torch.testing.assert_close(ours, seed, rtol=0, atol=5e-6)


def test_pairings_differ(tables):
    x = make_heads(1, 2, 4, 8, seed=9)
    a = rotary.apply_rope(x, tables(8), 1, True)
    b = rotary.apply_rope(x, tables(8), 1, False)
    assert not torch.allclose(a, b)


def test_position_zero_is_identity(tables):
    x = make_heads(2, 2, 1, 16, seed=10)
    for interleaved in PAIRINGS:
        assert torch.equal(rotary.apply_rope(x, tables(16), 0, interleaved), x)


def test_large_tensor_many_threads(tables):
    """Several parallel_for chunks (grain ~32K elements)."""
    x = make_heads(2, 8, 200, 64, seed=11)
    freqs = tables(64, 256)
    out = rotary.apply_rope(x, freqs, 40, True)
    assert_close_ref(out, rope_reference(x, 40, True), torch.float32)
    oq, ok = rotary.apply_rope_qk(x, x[:, :2], freqs, 40, False)
    assert_close_ref(oq, rope_reference(x, 40, False), torch.float32)
    assert_close_ref(ok, rope_reference(x[:, :2], 40, False), torch.float32)


# ---------------------------------------------------------------------------
# Non-contiguous inputs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_apply_rope(tables, layout, dtype, interleaved):
    D = 16
    x = make_heads(2, 3, 5, D, dtype, layout, seed=12)
    snap = Snapshot(x)
    out = rotary.apply_rope(x, tables(D), 2, interleaved)
    snap.check()
    assert_close_ref(out, rope_reference(x, 2, interleaved), dtype)
    # Same numbers as for a contiguous copy (the layout changes nothing).
    assert torch.equal(out, rotary.apply_rope(x.contiguous(), tables(D), 2, interleaved))


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packed_qkv(tables, dtype, interleaved):
    """q, k, v sliced from one packed [B, S, 3H, D] tensor: q and k rotated
    without copies, v and the packed tensor untouched."""
    B, S, H, D = 2, 7, 3, 32
    packed, q, k, v = make_packed_qkv(B, S, H, D, dtype, seed=13)
    snap = Snapshot(packed)
    oq, ok = rotary.apply_rope_qk(q, k, tables(D), 1, interleaved)
    snap.check()
    assert_close_ref(oq, rope_reference(q, 1, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, 1, interleaved), dtype)
    assert torch.equal(v, snap.items[0][1].transpose(1, 2)[:, 2 * H :])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qk_mixed_layouts(tables, dtype):
    q = make_heads(2, 4, 5, 16, dtype, "stride2", seed=14)
    k = make_heads(2, 1, 5, 16, dtype, "transposed", seed=15)
    snap = Snapshot(q, k)
    for interleaved in PAIRINGS:
        oq, ok = rotary.apply_rope_qk(q, k, tables(16), 3, interleaved)
        assert_close_ref(oq, rope_reference(q, 3, interleaved), dtype)
        assert_close_ref(ok, rope_reference(k, 3, interleaved), dtype)
    snap.check()


def test_expanded_input(tables):
    """A stride-0 (broadcast) input reads fine and the output is a real tensor."""
    row = randn((1, 1, 1, 8), seed=16)
    x = row.expand(2, 3, 4, 8)
    out = rotary.apply_rope(x, tables(8), 0, True)
    assert_close_ref(out, rope_reference(x, 0, True), torch.float32)
    assert out.is_contiguous()


def test_output_layout_follows_dense_input(tables):
    x = make_heads(2, 3, 5, 8, layout="transposed", seed=17)
    out = rotary.apply_rope(x, tables(8), 0, True)
    assert out.stride() == x.stride()


# ---------------------------------------------------------------------------
# start_pos, sequence length, empty tensors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize(
    "S,start", [(1, 0), (1, 9), (1, 31), (4, 28), (32, 0), (5, 17)], ids=lambda v: str(v)
)
def test_start_pos_and_length(tables, S, start, interleaved):
    """Includes S == 1 (decode) and start_pos + S == max_seq_len exactly."""
    freqs = tables(12, 32)
    x = make_heads(2, 2, S, 12, torch.float64, seed=18)
    q = make_heads(2, 3, S, 12, torch.float64, seed=19)
    out = rotary.apply_rope(x, freqs, start, interleaved)
    assert_close_ref(out, rope_reference(x, start, interleaved), torch.float64)
    oq, ok = rotary.apply_rope_qk(q, x, freqs, start, interleaved)
    assert_close_ref(oq, rope_reference(q, start, interleaved), torch.float64)
    assert torch.equal(ok, out)


def test_decode_steps_equal_prefill(tables):
    """Rotating token by token (S == 1, start_pos = s) equals one prefill call."""
    freqs = tables(16, 32)
    x = make_heads(2, 3, 9, 16, seed=20)
    full = rotary.apply_rope(x, freqs, 4, True)
    steps = torch.cat([rotary.apply_rope(x[:, :, s : s + 1], freqs, 4 + s, True) for s in range(9)], dim=2)
    assert torch.equal(full, steps)


def test_table_row_slice_equals_start_pos(tables):
    freqs = tables(16, 32)
    x = make_heads(2, 3, 5, 16, seed=21)
    assert torch.equal(rotary.apply_rope(x, freqs[7:], 0), rotary.apply_rope(x, freqs, 7))


def test_non_contiguous_table(tables):
    """A column-major copy of the table (strides (1, L)) gives the same result."""
    freqs = tables(16, 32)
    col_major = freqs.t().contiguous().t()
    assert col_major.stride() != freqs.stride() and torch.equal(col_major, freqs)
    x = make_heads(2, 3, 5, 16, seed=22)
    for interleaved in PAIRINGS:
        assert torch.equal(
            rotary.apply_rope(x, col_major, 3, interleaved), rotary.apply_rope(x, freqs, 3, interleaved)
        )


@pytest.mark.parametrize(
    "B,Hq,Hk,S", [(0, 2, 2, 4), (2, 2, 2, 0), (2, 0, 0, 4), (2, 3, 0, 4), (0, 0, 0, 0)]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_tensors(tables, B, Hq, Hk, S, dtype):
    freqs = tables(8, 16)
    q = randn((B, Hq, S, 8), dtype, seed=23)
    k = randn((B, Hk, S, 8), dtype, seed=24)
    out = rotary.apply_rope(q, freqs, 2, True)
    assert out.shape == q.shape and out.dtype == dtype
    oq, ok = rotary.apply_rope_qk(q, k, freqs, 2, False)
    assert oq.shape == q.shape and ok.shape == k.shape
    if B * S > 0:
        assert_close_ref(oq, rope_reference(q, 2, False), dtype)
    # Positions of an empty batch.
    pos = torch.zeros(B, dtype=torch.int64) + 1
    assert rotary.apply_rope(q, freqs, **op_positions(0, pos)).shape == q.shape


def test_empty_sequence_at_end_of_table(tables):
    """S == 0 reads no row, so start_pos == max_seq_len is accepted."""
    freqs = tables(8, 16)
    x = randn((2, 3, 0, 8), seed=25)
    assert rotary.apply_rope(x, freqs, 16).shape == x.shape
