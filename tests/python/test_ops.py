"""rotary.apply_rope / apply_rope_qk / rope_freqs against the independent
float64 reference (reference.py), on the CPU."""

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import (
    freqs_reference,
    hf_apply_rope,
    inv_freq,
    rope_reference,
    seed_apply_rope,
    seed_precompute_freqs,
)
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
    positions_tensor,
    randn,
)
from rotary_testing.devices import assert_matches_cpu, needs_cuda, sync

HEAD_DIMS = [2, 6, 34, 64, 80, 128]  # 34: vector body + scalar tail


@pytest.fixture(scope="module")
def tables():
    cache = {}

    def get(dim, max_seq_len=32, theta=10000.0):
        key = (dim, max_seq_len, theta)
        if key not in cache:
            cache[key] = rotary.freqs_table(dim, max_seq_len, theta)
        return cache[key]

    return get


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


# ---------------------------------------------------------------------------
# Schema / wrappers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["apply_rope", "apply_rope_qk"])
def test_schema_keyword_only(name):
    schema = getattr(torch.ops.rotary, name).default._schema
    args = {a.name: a for a in schema.arguments}
    assert args["offsets"].kwarg_only and args["position_ids"].kwarg_only and args["inverse"].kwarg_only
    assert "positions" not in args
    assert not args["start_pos"].kwarg_only and not args["interleaved"].kwarg_only
    assert not schema.is_mutable


def test_wrappers_equal_raw_ops(tables):
    freqs = tables(16, 32)
    q = make_heads(2, 3, 5, 16, seed=40)
    k = make_heads(2, 1, 5, 16, seed=41)
    pos = torch.tensor([1, 2])
    assert torch.equal(
        rotary.apply_rope(q, freqs, interleaved=False, inverse=True, **op_positions(3, pos)),
        torch.ops.rotary.apply_rope(q, freqs, interleaved=False, inverse=True, **op_positions(3, pos)),
    )
    a = rotary.apply_rope_qk(q, k, freqs, interleaved=False, **op_positions(3, pos))
    b = torch.ops.rotary.apply_rope_qk(q, k, freqs, interleaved=False, **op_positions(3, pos))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Defaults: start_pos 0, interleaved.
    assert torch.equal(torch.ops.rotary.apply_rope(q, freqs), rotary.apply_rope(q, freqs, 0, True))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [2, 6, 64, 80, 128])
def test_parity_apply_rope(device, tables, head_dim, dtype, interleaved, layout):
    B, H, S, start = 2, 3, 19, 7
    x = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim, device=device)
    snap = Snapshot(x)
    poison_allocator(x.numel(), dtype, device)
    out = rotary.apply_rope(x, tables(head_dim, 64).to(device), start, interleaved)
    sync(device)
    snap.check()
    assert not out.isnan().any(), "output element not written (poison survived)"
    ref = rope_reference(x, start, interleaved)
    assert_close_ref(out, ref, dtype)
    x_cpu = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim)
    out_cpu = rotary.apply_rope(x_cpu, tables(head_dim, 64), start, interleaved)
    assert_matches_cpu(out, out_cpu, dtype)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [6, 64, 128])
def test_parity_apply_rope_qk_packed(device, tables, head_dim, dtype, interleaved):
    B, S, H = 2, 23, 4
    packed, q, k, v = make_packed_qkv(B, S, H, head_dim, dtype, seed=210, device=device)
    k = k[:, :2]  # Hq = 4, Hk = 2, still views of the packed tensor
    snap = Snapshot(packed)
    poison_allocator(q.numel(), dtype, device)
    oq, ok = rotary.apply_rope_qk(q, k, tables(head_dim, 64).to(device), 41, interleaved)
    sync(device)
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any()
    assert_close_ref(oq, rope_reference(q, 41, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, 41, interleaved), dtype)
    pc = packed.cpu()
    qc, kc = pc.transpose(1, 2)[:, :H], pc.transpose(1, 2)[:, H : H + 2]
    cq, ck = rotary.apply_rope_qk(qc, kc, tables(head_dim, 64), 41, interleaved)
    assert_matches_cpu(oq, cq, dtype)
    assert_matches_cpu(ok, ck, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_multi_block(device, tables, dtype):
    """Enough rows and heads for many thread blocks / a full grid."""
    B, H, Hk, S, D = 3, 16, 4, 300, 128
    q = make_heads(B, H, S, D, dtype, "transposed", seed=230, device=device)
    k = make_heads(B, Hk, S, D, dtype, seed=231, device=device)
    f = rotary.freqs_table(D, 1024).to(device)
    poison_allocator(q.numel(), dtype, device)
    for interleaved in PAIRINGS:
        oq, ok = rotary.apply_rope_qk(q, k, f, 700, interleaved)
        assert_close_ref(oq, rope_reference(q, 700, interleaved), dtype)
        assert_close_ref(ok, rope_reference(k, 700, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conj_and_inverse(device, tables, dtype):
    x = make_heads(2, 3, 11, 64, dtype, "stride2", seed=232, device=device)
    f = tables(64, 64).to(device)
    inv = rotary.apply_rope(x, f, 5, False, inverse=True)
    assert torch.equal(rotary.apply_rope(x, f.conj(), 5, False), inv)
    assert_close_ref(inv, rope_reference(x, 5, False, inverse=True), dtype)
    if dtype in (torch.float32, torch.float64):
        back = rotary.apply_rope(rotary.apply_rope(x, f, 5, False), f, 5, False, inverse=True)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(back, x, rtol=rtol, atol=atol)


# Head counts that are not a multiple of the heads a thread holds, rows that
# do not fill the last block, a head wider than a block's threads, and a
# partial rotary (dims past the table's width pass through), in and out of place.
@pytest.mark.parametrize("shape", [(27, 3, 5, 128, 128), (37, 5, 2, 640, 640), (5, 1, 33, 128, 64)],
                         ids=["gqa27_3", "d640", "partial64of128"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_grid_shapes_in_and_out_of_place(device, shape, layout, interleaved, dtype):
    hq, hk, S, D, R = shape
    B, start = 3, 11
    f = rotary.freqs_table(R, 64).to(device)
    q = make_heads(B, hq, S, D, dtype, layout, seed=240, device=device)
    k = make_heads(B, hk, S, D, dtype, layout, seed=241, device=device)

    def expect(x, out, msg):
        ref = rope_reference(x[..., :R], start, interleaved)
        assert_close_ref(out[..., :R], ref, dtype, msg)
        assert torch.equal(out[..., R:], x[..., R:]), msg + ": pass-through dims changed"

    snap = Snapshot(q, k)
    poison_allocator(q.numel(), dtype, device)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    sync(device)
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any(), "output element not written (poison survived)"
    expect(q, oq, "q out of place")
    expect(k, ok, "k out of place")
    qi, ki = q.clone(), k.clone()
    rotary.apply_rope_qk_(qi, ki, f, start, interleaved)
    sync(device)
    assert torch.equal(qi, oq) and torch.equal(ki, ok), "in place differs from out of place"


@needs_cuda
def test_more_than_2_31_elements():
    """2^31 + 128 * 128 elements: offsets past int32 take the 64-bit index path."""
    B, S, D = (1 << 17) + 1, 128, 128
    need = 2 * B * S * D * 2
    if torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip("needs about 11 GB of free GPU memory")
    x = torch.empty(B, 1, S, D, dtype=torch.bfloat16, device="cuda").normal_(generator=torch.Generator("cuda").manual_seed(250))
    f = rotary.freqs_table(D, S).to("cuda")
    out = rotary.apply_rope(x, f, 0, False)
    sync("cuda")
    for b in (0, B // 2, B - 1):  # the last batch lies past element 2^31
        assert_close_ref(out[b : b + 1], rope_reference(x[b : b + 1], 0, False), torch.bfloat16, f"batch {b}")
    rotary.apply_rope_(x, f, 0, False)
    sync("cuda")
    assert torch.equal(x, out), "in place differs from out of place"


@needs_cuda
@pytest.mark.parametrize("layout", ["hf", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_l2_prefetch_of_next_rows_cuda(layout, dtype, interleaved):
    """Enough rows that every block strides (the launch prefetches each
    thread's next row into L2): the reference's values, and the bits of the
    launch without the prefetch, out of place and in place."""
    B, S, HQ, HK, D, start = 2, 4099, 8, 2, 128, 5
    gen = torch.Generator("cuda").manual_seed(260)
    if layout == "hf":
        q, k = (torch.randn(B, S, h, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for h in (HQ, HK))
    else:
        q, k = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=gen) for h in (HQ, HK))
    f = rotary.freqs_table(D, S + start).to("cuda")
    assert rotary._C._cuda_launch_shape(q, k, f, interleaved)["l2_prefetch"] == 1
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    prior = rotary._C._cuda_set_l2_prefetch(False)
    try:
        pq, pk = rotary.apply_rope_qk(q, k, f, start, interleaved)
    finally:
        rotary._C._cuda_set_l2_prefetch(prior)
    sync("cuda")
    assert torch.equal(oq, pq) and torch.equal(ok, pk), "the prefetch changed the results"
    for x, out in ((q, oq), (k, ok)):
        assert_close_ref(out.cpu(), rope_reference(x.cpu(), start, interleaved), dtype, f"{layout}")
    qi, ki = q.clone(), k.clone()
    rotary.apply_rope_qk_(qi, ki, f, start, interleaved)
    sync("cuda")
    assert torch.equal(qi, oq) and torch.equal(ki, ok), "in place differs from out of place"


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 0, 4, 8), (2, 2, 0, 8)])
def test_empty(device, tables, shape):
    x = randn(shape, seed=233, device=device)
    out = rotary.apply_rope(x, tables(8, 64).to(device), 3)
    oq, ok = rotary.apply_rope_qk(x, x, tables(8, 64).to(device), 3)
    sync(device)
    assert out.shape == x.shape and oq.shape == x.shape and ok.shape == x.shape


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (1, 0, 4, 8), (1, 2, 0, 8), (1, 1, 1, 8), (1, 2, 1, 8), (2, 3, 5, 8)])
def test_meta_outputs_have_the_kernels_strides(shape):
    """Meta allocates the outputs as the kernels do (the input's strides where
    it is dense, size-1 and empty dims included; torch's empty_like re-derives
    those on Meta), so a traced graph's strides are the eager ones."""
    f = rotary.freqs_table(8, 16)
    b, h, s, d = shape
    inputs = {"contiguous": torch.randn(shape), "transposed": torch.randn(b, s, h, d).transpose(1, 2),
              "strided": torch.randn(b, h, s, 2 * d)[..., ::2]}
    calls = {
        "apply_rope": lambda x, f: [rotary.apply_rope(x, f)],
        "apply_rope_qk": lambda x, f: list(rotary.apply_rope_qk(x, x.clone(), f)),
        "apply_qk_norm_rope": lambda x, f: list(rotary.apply_qk_norm_rope(x, x.clone(), f)),
        "apply_qk_norm_rope fp8 q": lambda x, f: list(rotary.apply_qk_norm_rope(
            x, x.clone(), f, q_fp8_scale=torch.tensor(0.1, device=x.device))),
    }
    for layout, x in inputs.items():
        for name, call in calls.items():
            eager, meta = call(x, f), call(x.to("meta"), f.to("meta"))
            for e, m in zip(eager, meta):
                assert (m.shape, m.stride(), m.dtype) == (e.shape, e.stride(), e.dtype), (layout, name)
