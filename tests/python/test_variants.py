"""RoPE variants against the independent float64 reference (reference.py):
layouts (BHSD / BSHD / SBHD), packed variable-length batches (cu_seqlens),
partial rotary, every form of positions, positions past the table with
inv_freq, in-place ops, inverse, gradients, opcheck, torch.compile and the
error message of each bad input.

The reference never calls rotary. Partial rotary is the reference on
x[..., :r] (d = r) plus the untouched tail; a packed batch is the reference
run on each sequence separately."""

import re

import numpy as np
import pytest
import torch


import rotary
from reference import inv_freq, rope_reference, rotate_pairs_nd
from rope_testing import (
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    TOL,
    Snapshot,
    assert_close_ref,
    gen,
    poison_allocator,
    randn,
)

LAYOUT_NAMES = ["BHSD", "BSHD", "SBHD"]


@pytest.fixture(scope="module")
def tables():
    cache = {}

    def get(rotary_dim, max_seq_len=32):
        key = (rotary_dim, max_seq_len)
        if key not in cache:
            cache[key] = rotary.rope_freqs(rotary_dim, max_seq_len)
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------
# Helpers: layouts, strided inputs, references
# ---------------------------------------------------------------------------
def layout_shape(layout, B, H, S, D):
    return {"BHSD": (B, H, S, D), "BSHD": (B, S, H, D), "SBHD": (S, B, H, D)}[layout]


def to_bhsd(x, layout):
    """The [B, H, S, D] view of a tensor in `layout` (no copy)."""
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(1, 2, 0, 3)}[layout]()


def from_bhsd(x, layout):
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(2, 0, 1, 3)}[layout]()


def random_strided(shape, dtype=torch.float32, seed=0):
    """Values of `shape` stored with a random dim order, a random padding per
    dim (so it is a slice of a larger buffer) and maybe last-dim stride 2."""
    g = gen(seed + 7919)
    n = len(shape)
    perm = torch.randperm(n, generator=g).tolist()
    pad = torch.randint(0, 2, (n,), generator=g).tolist()
    step = int(torch.randint(1, 3, (1,), generator=g))
    mult = [step if d == n - 1 else 1 for d in range(n)]
    sizes = [(shape[d] + pad[d]) * mult[d] for d in range(n)]
    buf = randn([sizes[d] for d in perm], dtype, seed)
    v = buf.permute([perm.index(d) for d in range(n)])
    for d in range(n):
        v = v.narrow(d, pad[d] * mult[d], shape[d] * mult[d])
    if step == 2:
        v = v[..., ::2]
    assert tuple(v.shape) == tuple(shape)
    return v


def ref_rope4(x, r=None, start=0, interleaved=True, positions=None, inverse=False, layout="BHSD"):
    """float64 reference of a 4-D input in `layout`: the seed rotation of dims
    [0, r) (as a head of size r) and dims [r, D) copied."""
    xb = to_bhsd(x, layout)
    r = xb.shape[-1] if r is None else r
    rot = rope_reference(xb[..., :r], start, interleaved, positions, inverse)
    out = torch.cat([rot, xb[..., r:].detach().to("cpu", torch.float64)], dim=-1)
    return from_bhsd(out, layout)


def ref_varlen(x, cu, r=None, start=0, interleaved=True, positions=None, inverse=False):
    """float64 reference of a packed [T, H, D] batch: each sequence alone,
    token s of sequence n at local index s - cu[n]."""
    bounds = [int(v) for v in cu]
    parts = [torch.empty((0,) + tuple(x.shape[1:]), dtype=torch.float64)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = x[a:b].permute(1, 0, 2).unsqueeze(0)  # [1, H, len, D]
        if positions is None:
            st, pos = start, None
        elif positions.dim() == 0:  # an offset
            st, pos = start + int(positions), None
        else:  # absolute ids
            st, pos = start, positions[a:b].unsqueeze(0)
        parts.append(ref_rope4(seg, r, st, interleaved, pos, inverse)[0].permute(1, 0, 2))
    return torch.cat(parts, dim=0)


def cu_from_lens(lens, dtype=torch.int64):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=dtype)


def bits(t):
    """The raw bits of t (so NaN compares equal to itself)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_tail_is_input(out, x, r):
    """Dims past rotary_dim hold exactly the input values."""
    assert torch.equal(out[..., r:], x[..., r:])


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
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved, positions=pos, layout=layout)
    out = rotary.apply_rope(k, f, start, interleaved, positions=pos, layout=layout)
    snap.check()
    assert_close_ref(oq, ref_rope4(q, r, start, interleaved, pos, layout=layout), dtype)
    assert_close_ref(ok, ref_rope4(k, r, start, interleaved, pos, layout=layout), dtype)
    assert torch.equal(out, ok)
    assert_tail_is_input(oq, q, r)
    # In place on a copy with the same strides: the same bits, tail untouched.
    q2 = q.clone() if q.is_contiguous() else random_strided(q.shape, dtype, seed=10 + seed)
    k2 = random_strided(k.shape, dtype, seed=20 + seed)
    res = rotary.apply_rope_qk_(q2, k2, f, start, interleaved, positions=pos, layout=layout)
    assert res[0] is q2 and res[1] is k2
    assert torch.equal(q2, oq) and torch.equal(k2, ok)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_inverse_round_trip(tables, layout, interleaved):
    B, H, S, D, start = 2, 3, 5, 16, 4
    f = tables(D)
    x = randn(layout_shape(layout, B, H, S, D), torch.float64, seed=3)
    pos = torch.tensor([1, 7])
    inv = rotary.apply_rope(x, f, start, interleaved, positions=pos, inverse=True, layout=layout)
    assert_close_ref(inv, ref_rope4(x, None, start, interleaved, pos, True, layout), torch.float64)
    fwd = rotary.apply_rope(x, f, start, interleaved, positions=pos, layout=layout)
    back = rotary.apply_rope(fwd, f, start, interleaved, positions=pos, inverse=True, layout=layout)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Packed variable-length batches
# ---------------------------------------------------------------------------
VARLEN_LENS = [3, 0, 5, 1, 0, 4]  # empty sequences inside the batch


@pytest.mark.parametrize("kind", ["none", "offset", "ids"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_matches_reference(tables, dtype, interleaved, cu_dtype, kind):
    T, Hq, Hk, D, L, start = sum(VARLEN_LENS), 4, 2, 20, 32, 2
    cu = cu_from_lens(VARLEN_LENS, cu_dtype)
    f = tables(D, L)
    pos = {"none": None, "offset": torch.tensor(6), "ids": torch.randint(0, L - start, (T,), generator=gen(5))}[kind]
    q = random_strided((T, Hq, D), dtype, seed=30 + len(kind))
    k = randn((T, Hk, D), dtype, seed=31)
    snap = Snapshot(q, k, cu, f)
    poison_allocator(q.numel(), dtype)
    out = rotary.apply_rope(q, f, start, interleaved, positions=pos, cu_seqlens=cu)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved, positions=pos, cu_seqlens=cu)
    snap.check()
    assert out.shape == q.shape and ok.shape == k.shape
    assert_close_ref(out, ref_varlen(q, cu, None, start, interleaved, pos), dtype)
    assert_close_ref(ok, ref_varlen(k, cu, None, start, interleaved, pos), dtype)
    assert torch.equal(oq, out)


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
    out_ids = rotary.apply_rope(x, f, 0, interleaved, positions=ids, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seg = x[a:b].permute(1, 0, 2).unsqueeze(0)
        want = rotary.apply_rope(seg, f, start, interleaved)[0].permute(1, 0, 2)
        assert torch.equal(out[a:b], want)
        want = rotary.apply_rope(seg, f, 0, interleaved, positions=ids[a:b][None])[0].permute(1, 0, 2)
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
    inv = rotary.apply_rope(x, f, 1, interleaved, positions=ids, inverse=True, cu_seqlens=cu)
    assert_close_ref(inv, ref_varlen(x, cu, None, 1, interleaved, ids, inverse=True), torch.float64)
    back = rotary.apply_rope(
        rotary.apply_rope(x, f, 1, interleaved, positions=ids, cu_seqlens=cu),
        f, 1, interleaved, positions=ids, inverse=True, cu_seqlens=cu,
    )
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)


def test_varlen_strided_cu_seqlens(tables):
    """A cu_seqlens view with stride 2 holds the same boundaries."""
    x = randn((5, 2, 8), torch.float64, seed=36)
    f = tables(8)
    cu = torch.tensor([0, 99, 2, 99, 5, 99])[::2]
    assert cu.tolist() == [0, 2, 5] and cu.stride() == (2,)
    out = rotary.apply_rope(x, f, 0, cu_seqlens=cu)
    assert torch.equal(out, rotary.apply_rope(x, f, 0, cu_seqlens=cu.contiguous()))


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
    out = rotary.apply_rope(x, f, 0, interleaved, positions=ids, cu_seqlens=cu)
    assert_close_ref(out, ref_varlen(x, cu, r, 0, interleaved, ids), torch.float32)
    assert_tail_is_input(out, x, r)
    y = random_strided(layout_shape("SBHD", 2, 3, 5, D), torch.bfloat16, seed=43)
    pos = torch.tensor([[0, 3, 1, 30, 9], [4, 4, 4, 4, 4]])
    out = rotary.apply_rope(y, f, 1, interleaved, positions=pos, layout="SBHD")
    assert_close_ref(out, ref_rope4(y, r, 1, interleaved, pos, layout="SBHD"), torch.bfloat16)
    assert_tail_is_input(out, y, r)


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
    out = rotary.apply_rope(x, f, start, interleaved, positions=pos, layout="BSHD")
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
        ("offset-0d", dict(start=2, positions=torch.tensor(-3))),
        ("offsets-B", dict(start=0, positions=torch.tensor([0, -1]))),
        ("ids", dict(start=1, positions=torch.tensor([[0, 1, 2], [0, -2, 1]]))),
        ("varlen-offset", dict(start=0, positions=torch.tensor(-1), cu=[0, 2, 6])),
        ("varlen-ids", dict(start=3, positions=torch.tensor([0, 1, 2, -4, 0, 0]), cu=[0, 2, 6])),
    ],
)
def test_negative_position_is_value_error(tables, name, kwargs):
    f = tables(8)
    cu = kwargs.get("cu")
    x = randn((6, 2, 8) if cu else (2, 2, 3, 8), seed=45)
    extra = {"cu_seqlens": torch.tensor(cu)} if cu else {}
    snap = Snapshot(x)
    with pytest.raises(ValueError, match=r"has negative position -\d+ \(start_pos \d+ \+ positions\)"):
        rotary.apply_rope(x, f, kwargs["start"], positions=kwargs["positions"], **extra)
    with pytest.raises(ValueError, match=r"apply_rope_: token .* has negative position"):
        rotary.apply_rope_(x, f, kwargs["start"], positions=kwargs["positions"], **extra)
    snap.check()


def test_varlen_past_table_is_index_error(tables):
    f = tables(8, 6)
    x = randn((9, 2, 8), seed=46)
    cu = torch.tensor([0, 3, 9])  # the second sequence reaches local index 5
    rotary.apply_rope(x, f, 0, cu_seqlens=cu)  # positions 0..5: inside
    with pytest.raises(IndexError, match=r"apply_rope: token \(batch 0, seq 8\) has position 6 .*outside the freqs table \[0, 6\)"):
        rotary.apply_rope(x, f, 1, cu_seqlens=cu)
    with pytest.raises(IndexError, match=r"outside the freqs table"):
        rotary.apply_rope(x, f, 0, positions=torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 6]), cu_seqlens=cu)


# ---------------------------------------------------------------------------
# inv_freq: positions past the table, computed in float64
# ---------------------------------------------------------------------------
def _inv(r):
    return torch.from_numpy(inv_freq(r))


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
            out = rotary.apply_rope(x, f, 0, interleaved, positions=ids, inv_freq=inv)
            ref = ref_rope4(x, r, 0, interleaved, ids)
        elif variant == "varlen":
            x = randn((7, 2, D), dtype, seed=49)
            cu = torch.tensor([0, 4, 7], dtype=torch.int32)
            out = rotary.apply_rope(x, f, where, interleaved, cu_seqlens=cu, inv_freq=inv)
            ref = ref_varlen(x, cu, r, where, interleaved)
        else:
            x = randn(layout_shape("BSHD", 2, 2, 3, D), dtype, seed=50)
            pos = torch.tensor([where, 1])
            out = rotary.apply_rope(x, f, 0, interleaved, positions=pos, inv_freq=inv, layout="BSHD")
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
        a = rotary.apply_rope(x, f, 0, interleaved, positions=ids)
        assert torch.equal(a, rotary.apply_rope(x, f, 0, interleaved, positions=ids, inv_freq=_inv(16)))


def test_inv_freq_without_table_rows(tables):
    """An empty table [0, r/2]: every position is computed."""
    f = rotary.rope_freqs(8, 0)
    x = randn((1, 2, 4, 8), torch.float64, seed=52)
    out = rotary.apply_rope(x, f, 100, False, inv_freq=_inv(8))
    assert_close_ref(out, ref_rope4(x, None, 100, False), torch.float64)


def test_inv_freq_uses_table_scaling():
    """Past the table the computed rotation carries the table's scale (row 0,
    pair 0, real part), so it continues a scaled table seamlessly."""
    D, L, scale = 8, 6, 0.75
    f = rotary.rope_freqs(D, L) * scale
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


# ---------------------------------------------------------------------------
# In place
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["bhsd", "bshd-positions", "sbhd-partial", "varlen-partial"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inplace_equals_out_of_place(tables, dtype, interleaved, variant):
    D = 24
    r = 16 if "partial" in variant else D
    f = tables(r)
    kw = {}
    if variant == "bhsd":
        x = random_strided((2, 3, 5, D), dtype, seed=60)
    elif variant == "bshd-positions":
        x = random_strided((2, 5, 3, D), dtype, seed=61)
        kw = dict(layout="BSHD", positions=torch.tensor([[0, 9, 2, 2, 20], [1, 1, 1, 1, 1]]))
    elif variant == "sbhd-partial":
        x = random_strided((5, 2, 3, D), dtype, seed=62)
        kw = dict(layout="SBHD", positions=torch.tensor([4, 0]))
    else:
        x = random_strided((sum(VARLEN_LENS), 3, D), dtype, seed=63)
        kw = dict(cu_seqlens=cu_from_lens(VARLEN_LENS, torch.int32), positions=torch.tensor(2))
    want = rotary.apply_rope(x, f, 1, interleaved, **kw)
    y = x.clone() if x.is_contiguous() else x  # x itself is modified below
    before = y._version
    res = rotary.apply_rope_(y, f, 1, interleaved, **kw)
    assert res is y
    assert y._version > before
    assert torch.equal(y, want)
    # qk in place: two tensors, GQA head counts.
    q = randn(want.shape, dtype, seed=64)
    k = q[..., :1, :].clone() if variant != "bhsd" else q[:, :1].clone()
    wq, wk = rotary.apply_rope_qk(q, k, f, 1, interleaved, **kw)
    rq, rk = rotary.apply_rope_qk_(q, k, f, 1, interleaved, **kw)
    assert rq is q and rk is k
    assert torch.equal(q, wq) and torch.equal(k, wk)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_inplace_packed_qkv(tables, dtype, interleaved):
    """q and k as views of one packed [B, S, Hq + 2 Hk, D] tensor (BSHD
    layout): rotated where they are; v and everything else untouched."""
    B, S, Hq, Hk, D, r = 2, 6, 4, 2, 20, 12
    f = tables(r)
    qkv = randn((B, S, Hq + 2 * Hk, D), dtype, seed=65)
    before = qkv.clone()
    q, k, v = qkv.split([Hq, Hk, Hk], dim=2)
    pos = torch.tensor([3, 0])
    rq, rk = rotary.apply_rope_qk_(q, k, f, 2, interleaved, positions=pos, layout="BSHD")
    assert rq is q and rk is k
    assert torch.equal(v, before[:, :, Hq + Hk :])
    assert_close_ref(q, ref_rope4(before[:, :, :Hq], r, 2, interleaved, pos, layout="BSHD"), dtype)
    assert_close_ref(k, ref_rope4(before[:, :, Hq : Hq + Hk], r, 2, interleaved, pos, layout="BSHD"), dtype)
    assert torch.equal(qkv[..., r:], before[..., r:])


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_inplace_packed_qkv_varlen(tables, interleaved):
    T, H, D = sum(VARLEN_LENS), 2, 16
    cu = cu_from_lens(VARLEN_LENS)
    f = tables(D)
    qkv = randn((T, 3 * H, D), seed=66)
    before = qkv.clone()
    q, k, v = qkv.split(H, dim=1)
    ids = torch.randint(0, 32, (T,), generator=gen(11))
    rotary.apply_rope_qk_(q, k, f, 0, interleaved, positions=ids, cu_seqlens=cu)
    assert torch.equal(v, before[:, 2 * H :])
    assert_close_ref(q, ref_varlen(before[:, :H], cu, None, 0, interleaved, ids), torch.float32)
    assert_close_ref(k, ref_varlen(before[:, H : 2 * H], cu, None, 0, interleaved, ids), torch.float32)


def test_inplace_requires_grad_is_refused(tables):
    f = tables(8)
    x = randn((1, 2, 3, 8), seed=67).requires_grad_()
    k = randn((1, 1, 3, 8), seed=68)
    snap = Snapshot(x, k)
    with pytest.raises(ValueError, match=r"apply_rope_: x requires grad; in-place rotation is not differentiable"):
        rotary.apply_rope_(x, f, 1)
    with pytest.raises(ValueError, match=r"apply_rope_qk_: q requires grad"):
        rotary.apply_rope_qk_(x, k, f, 1)
    with pytest.raises(ValueError, match=r"apply_rope_qk_: k requires grad"):
        rotary.apply_rope_qk_(k, x, f, 1)
    with pytest.raises(ValueError, match=r"x requires grad"):
        rotary.apply_rope_(x[:, :1], f, 1)  # a view of a leaf that requires grad
    snap.check()
    with torch.no_grad():  # grad mode off: allowed
        want = rotary.apply_rope(x, f, 1)
        rotary.apply_rope_(x, f, 1)
    assert torch.equal(x.detach(), want)


def test_inplace_expanded_is_refused(tables):
    f = tables(8)
    base = randn((2, 1, 3, 8), seed=69)
    snap = Snapshot(base)
    with pytest.raises(ValueError, match=r"apply_rope_: x has elements sharing memory \(an expanded view\?\)"):
        rotary.apply_rope_(base.expand(2, 4, 3, 8), f)
    with pytest.raises(ValueError, match=r"apply_rope_qk_: k has elements sharing memory"):
        rotary.apply_rope_qk_(randn((2, 4, 3, 8)), base.expand(2, 4, 3, 8), f)
    with pytest.raises(ValueError, match=r"apply_rope_qk_: q has elements sharing memory"):
        rotary.apply_rope_qk_(base.expand(2, 4, 3, 8), randn((2, 4, 3, 8)), f)
    snap.check()


def test_inplace_q_k_overlap_is_refused(tables):
    f = tables(8)
    x = randn((1, 4, 3, 8), seed=70)
    snap = Snapshot(x)
    with pytest.raises(ValueError, match=r"apply_rope_qk_: q and k overlap in memory"):
        rotary.apply_rope_qk_(x, x, f)
    with pytest.raises(ValueError, match=r"q and k overlap in memory"):
        rotary.apply_rope_qk_(x[:, :3], x[:, 2:], f)  # dense slices sharing head 2
    with pytest.raises(ValueError, match=r"q and k overlap in memory"):
        rotary.apply_rope_qk_(x, x.view(1, 4, 3, 8), f)
    snap.check()


def test_inplace_q_k_overlap_non_dense_is_refused(tables):
    f = tables(8)
    qkv = randn((2, 3, 6, 8), seed=71)  # [B, S, heads, D]
    snap = Snapshot(qkv)
    with pytest.raises(ValueError, match=r"q and k overlap in memory"):
        rotary.apply_rope_qk_(qkv[:, :, :3], qkv[:, :, 2:4], f, layout="BSHD")
    snap.check()


# Bad in-place calls: each must raise before anything is written.
def _bad_inplace_cases():
    T, D = 6, 8
    cu = torch.tensor([0, 2, 6])
    x3 = lambda: randn((T, 2, D), seed=72)  # noqa: E731
    x4 = lambda: randn((2, 2, 3, D), seed=73)  # noqa: E731
    return [
        ("cu-not-0", x3, dict(cu_seqlens=torch.tensor([1, 2, 6]))),
        ("cu-decreasing", x3, dict(cu_seqlens=torch.tensor([0, 4, 2, 6]))),
        ("cu-short", x3, dict(cu_seqlens=torch.tensor([0, 2, 5]))),
        ("cu-float", x3, dict(cu_seqlens=cu.float())),
        ("varlen-pos-past-table", x3, dict(cu_seqlens=cu, positions=torch.tensor(13))),
        ("varlen-pos-negative", x3, dict(cu_seqlens=cu, positions=torch.tensor([0, 1, 2, 3, -9, 5]))),
        ("varlen-pos-shape", x3, dict(cu_seqlens=cu, positions=torch.zeros(1, T, dtype=torch.int64))),
        ("layout", x4, dict(layout="BHDS")),
        ("layout-varlen", x3, dict(cu_seqlens=cu, layout="BSHD")),
        ("pos-past-table", x4, dict(positions=torch.tensor([0, 14]))),
        ("ids-negative", x4, dict(positions=torch.tensor([[0, 1, 2], [3, -1, 2]]))),
        ("inv-freq-dtype", x4, dict(start=20, inv_freq=torch.ones(4))),
        ("freqs-wide", x4, dict(freqs=rotary.rope_freqs(16, 16))),
    ]


_BAD_INPLACE = _bad_inplace_cases()


@pytest.mark.parametrize("make,kw", [c[1:] for c in _BAD_INPLACE], ids=[c[0] for c in _BAD_INPLACE])
def test_inplace_error_writes_nothing(make, kw):
    kw = dict(kw)
    f = kw.pop("freqs", rotary.rope_freqs(8, 16))
    start = kw.pop("start", 0)
    x = make()
    k = x[..., :1, :].clone() if x.dim() == 3 else x[:, :1].clone()
    snap = Snapshot(x, k)
    with pytest.raises((ValueError, TypeError, IndexError)):
        rotary.apply_rope_(x, f, start, **kw)
    with pytest.raises((ValueError, TypeError, IndexError)):
        rotary.apply_rope_qk_(x, k, f, start, **kw)
    # A valid q with a bad k: q is not written either.
    with pytest.raises((ValueError, TypeError, IndexError)):
        rotary.apply_rope_qk_(x, k.to(torch.float64), f, start, **kw)
    snap.check()


# ---------------------------------------------------------------------------
# Gradients (fp64)
# ---------------------------------------------------------------------------
GRAD_CASES = {
    "varlen-cu32-interleaved": dict(shape=(6, 2, 6), cu=[0, 2, 2, 6], r=6, interleaved=True),
    "varlen-ids-half": dict(shape=(6, 2, 6), cu=[0, 4, 6], r=6, interleaved=False, positions=torch.tensor([5, 0, 3, 1, 2, 9])),
    "varlen-offset-partial": dict(shape=(5, 1, 8), cu=[0, 5], r=4, interleaved=False, positions=torch.tensor(3)),
    "partial-interleaved": dict(shape=(2, 2, 3, 10), r=6, interleaved=True),
    "partial-half-inverse": dict(shape=(2, 2, 3, 10), r=4, interleaved=False, inverse=True),
    "bshd-positions": dict(shape=(2, 3, 2, 6), r=6, interleaved=True, layout="BSHD", positions=torch.tensor([1, 4])),
    "sbhd-ids-partial": dict(shape=(3, 2, 2, 8), r=6, interleaved=False, layout="SBHD", positions=torch.tensor([[0, 7, 2], [5, 5, 1]])),
    "inv-freq-far": dict(shape=(1, 2, 2, 6), r=6, interleaved=True, start=10**6, inv_freq=True),
}


def _grad_kwargs(c):
    kw = dict(positions=c.get("positions"), inverse=c.get("inverse", False), layout=c.get("layout", "BHSD"))
    if "cu" in c:
        kw["cu_seqlens"] = torch.tensor(c["cu"], dtype=torch.int32)
    if c.get("inv_freq"):
        kw["inv_freq"] = _inv(c["r"])
    return kw


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradcheck_variants(name):
    c = GRAD_CASES[name]
    f = rotary.rope_freqs(c["r"], 12)
    kw = _grad_kwargs(c)
    start = c.get("start", 1)
    x = randn(c["shape"], torch.float64, seed=80).requires_grad_()
    k_shape = list(c["shape"])
    k_shape[-2 if kw["layout"] != "BHSD" or "cu" in c else 1] = 1  # one k head
    k = randn(k_shape, torch.float64, seed=81).requires_grad_()

    def one(x):
        return rotary.apply_rope(x, f, start, c["interleaved"], **kw)

    def both(q, k):
        return rotary.apply_rope_qk(q, k, f, start, c["interleaved"], **kw)

    assert torch.autograd.gradcheck(one, (x,))
    assert torch.autograd.gradgradcheck(one, (x,))
    assert torch.autograd.gradcheck(both, (x, k))
    assert torch.autograd.gradgradcheck(both, (x, k))


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_grad_is_inverse_rotation_variants(name):
    c = GRAD_CASES[name]
    f = rotary.rope_freqs(c["r"], 12)
    kw = _grad_kwargs(c)
    start = c.get("start", 1)
    x = randn(c["shape"], torch.float32, seed=82).requires_grad_()
    w = randn(c["shape"], torch.float32, seed=83)
    (rotary.apply_rope(x, f, start, c["interleaved"], **kw) * w).sum().backward()
    inv = not kw["inverse"]
    if "cu" in c:
        ref = ref_varlen(w, kw["cu_seqlens"], c["r"], start, c["interleaved"], kw["positions"], inv)
    else:
        ref = ref_rope4(w, c["r"], start, c["interleaved"], kw["positions"], inv, kw["layout"])
    assert_close_ref(x.grad, ref, torch.float32)
    assert torch.equal(x.grad[..., c["r"] :], w[..., c["r"] :])  # pass-through dims: identity


# ---------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------
def _opcheck_samples():
    f8, f4 = rotary.rope_freqs(8, 32), rotary.rope_freqs(4, 32)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    T = 7
    ids = torch.randint(0, 30, (T,), generator=gen(12))
    def g(shape, seed, dtype=torch.float32):  # a leaf that requires grad
        return randn(shape, dtype, seed=seed).requires_grad_()

    one = [
        ("varlen", lambda: (g((T, 2, 8), 90), f8, 1, True), dict(cu_seqlens=cu)),
        ("varlen-ids-bf16", lambda: (randn((T, 2, 8), torch.bfloat16, seed=91), f8, 0, False),
         dict(cu_seqlens=cu.long(), positions=ids)),
        ("partial", lambda: (g((2, 2, 3, 8), 92), f4, 2, False), {}),
        ("bshd", lambda: (g((2, 3, 2, 8), 93), f8, 0, True), dict(layout="BSHD", positions=torch.tensor([1, 5]))),
        ("sbhd-partial-inverse", lambda: (randn((3, 2, 2, 8), seed=94), f4, 1, True), dict(layout="SBHD", inverse=True)),
        ("inv-freq", lambda: (randn((1, 2, 3, 8), seed=95), f8, 1000, True), dict(inv_freq=_inv(8))),
    ]
    two = [
        ("varlen", lambda: (g((T, 2, 8), 96), g((T, 1, 8), 97), f8, 1, True), dict(cu_seqlens=cu)),
        ("partial-bshd", lambda: (g((2, 3, 4, 8), 98), randn((2, 3, 2, 8), seed=99), f4, 0, False), dict(layout="BSHD")),
        ("sbhd-ids", lambda: (randn((3, 2, 2, 8), seed=100), randn((3, 2, 1, 8), seed=101), f8, 0, True),
         dict(layout="SBHD", positions=torch.tensor([[0, 9, 3], [2, 2, 2]]))),
    ]
    return one, two


_ONE, _TWO = _opcheck_samples()


@pytest.mark.parametrize("make,kw", [s[1:] for s in _ONE], ids=[s[0] for s in _ONE])
def test_opcheck_apply_rope_variants(make, kw):
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, make(), kw)


@pytest.mark.parametrize("make,kw", [s[1:] for s in _TWO], ids=[s[0] for s in _TWO])
def test_opcheck_apply_rope_qk_variants(make, kw):
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk.default, make(), kw)


def _no_grad(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("make,kw", [s[1:] for s in _ONE], ids=[s[0] for s in _ONE])
def test_opcheck_apply_rope_inplace_variants(make, kw):
    torch.library.opcheck(torch.ops.rotary.apply_rope_.default, _no_grad(make()), kw)


@pytest.mark.parametrize("make,kw", [s[1:] for s in _TWO], ids=[s[0] for s in _TWO])
def test_opcheck_apply_rope_qk_inplace_variants(make, kw):
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk_.default, _no_grad(make()), kw)


def test_opcheck_apply_rope_inplace_aot_dispatch():
    make, kw = _ONE[0][1:]
    torch.library.opcheck(torch.ops.rotary.apply_rope_.default, _no_grad(make()), kw, test_utils="test_aot_dispatch_dynamic")


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True, backend="aot_eager")
# ---------------------------------------------------------------------------
def test_compile_inplace_qk_on_packed_qkv(tables):
    B, S, H, D = 2, 5, 2, 16
    f = tables(D)

    def fn(qkv, pos):
        q, k, v = qkv.split(H, dim=2)
        rotary.apply_rope_qk_(q, k, f, 1, False, positions=pos, layout="BSHD")
        return (q * k).sum(-1), v * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    pos = torch.tensor([0, 7])
    a = randn((B, S, 3 * H, D), seed=110)
    b = a.clone()
    got = compiled(a, pos)
    want = fn(b, pos)
    assert torch.equal(a, b)  # the mutation of the graph input is replayed
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    q0 = randn((B, S, 3 * H, D), seed=110)[:, :, :H]
    assert_close_ref(a[:, :, :H], ref_rope4(q0, None, 1, False, pos, layout="BSHD"), torch.float32)


def test_compile_inplace_qk_varlen_partial(tables):
    f = tables(8)
    cu = cu_from_lens(VARLEN_LENS, torch.int32)
    T = int(cu[-1])

    def fn(q, k):
        rotary.apply_rope_qk_(q, k, f, 2, True, cu_seqlens=cu)
        return q + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k = randn((T, 3, 12), seed=111), randn((T, 1, 12), seed=112)
    q2, k2 = q.clone(), k.clone()
    out = compiled(q, k)
    assert torch.equal(out, fn(q2, k2)) and torch.equal(q, q2) and torch.equal(k, k2)


def test_compile_inplace_apply_rope(tables):
    f = tables(16)

    def fn(x):
        rotary.apply_rope_(x, f, 3)
        return x * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = randn((2, 2, 4, 16), seed=113)
    y = x.clone()
    assert torch.equal(compiled(x), fn(y)) and torch.equal(x, y)


def test_compile_varlen_forward_backward(tables):
    r, D = 8, 12
    f = tables(r)
    cu = cu_from_lens(VARLEN_LENS)
    T = int(cu[-1])
    ids = torch.randint(0, 32, (T,), generator=gen(13))

    def fn(q, k):
        q2, k2 = rotary.apply_rope_qk(q, k, f, 0, False, positions=ids, cu_seqlens=cu)
        return (q2 * k2).sum(-1).relu() + rotary.apply_rope(q, f, 3, cu_seqlens=cu, inverse=True).sum(-1)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q = randn((T, 2, D), seed=114).requires_grad_()
    k = randn((T, 2, D), seed=115).requires_grad_()
    out, ref = compiled(q, k), fn(q, k)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k)), torch.autograd.grad(ref.sum(), (q, k))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Errors: type and a message naming the argument, for all four ops
# ---------------------------------------------------------------------------
def _x3(T=5, H=2, D=8):
    return randn((T, H, D), seed=120)


def _x4(*shape):
    return randn(shape or (2, 2, 3, 8), seed=121)


# id, exception, message regex ({op}: op name, {x}: "x" or "q"), input builder,
# keyword arguments. Each runs through all four ops.
ERRORS = [
    ("cu-not-starting-at-0", ValueError, r"{op}: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[1, 2, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([1, 2, 5]))),
    ("cu-decreasing", ValueError, r"{op}: cu_seqlens must start at 0, never decrease.*got \[0, 3, 2, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 3, 2, 5]))),
    ("cu-not-ending-at-T", ValueError, r"{op}: cu_seqlens .*end at total_tokens = 5; got \[0, 2, 4\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))),
    ("cu-past-T", ValueError, r"end at total_tokens = 5; got \[0, 6\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 6]))),
    ("cu-float", TypeError, r"{op}: cu_seqlens must be int32 or int64, got Float",
     _x3, dict(cu_seqlens=torch.tensor([0.0, 5.0]))),
    ("cu-int16", TypeError, r"{op}: cu_seqlens must be int32 or int64, got Short",
     _x3, dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int16))),
    ("cu-2d", ValueError, r"{op}: cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[1, 3\]",
     _x3, dict(cu_seqlens=torch.tensor([[0, 2, 5]]))),
    ("cu-empty", ValueError, r"{op}: cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[0\]",
     _x3, dict(cu_seqlens=torch.zeros(0, dtype=torch.int64))),
    ("cu-no-sequence", ValueError, r"end at total_tokens = 5; got \[0\]",
     _x3, dict(cu_seqlens=torch.tensor([0]))),
    ("4d-with-cu", ValueError, r"{op}: with cu_seqlens, {x} must be 3-D \[total_tokens, heads, head_dim\], got shape \[2, 2, 3, 8\]",
     _x4, dict(cu_seqlens=torch.tensor([0, 5]))),
    ("3d-without-cu", ValueError,
     r"{op}: {x} must be 4-D \[batch, heads, seq_len, head_dim\], got shape \[5, 2, 8\] \(layout BHSD\); "
     r"a 3-D \[total_tokens, heads, head_dim\] input needs cu_seqlens",
     _x3, {}),
    ("3d-without-cu-bshd", ValueError,
     r"{op}: {x} must be 4-D \[batch, seq_len, heads, head_dim\], got shape \[5, 2, 8\] \(layout BSHD\); .*needs cu_seqlens",
     _x3, dict(layout="BSHD")),
    ("layout-unknown", ValueError, r"{op}: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'",
     _x4, dict(layout="BHDS")),
    ("layout-lowercase", ValueError, r"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'bshd'",
     _x4, dict(layout="bshd")),
    ("layout-thd-without-cu", ValueError, r"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'THD'",
     _x4, dict(layout="THD")),
    ("layout-with-cu", ValueError, r"{op}: with cu_seqlens the layout is 'THD', got 'SBHD'",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), layout="SBHD")),
    ("freqs-wider-than-head-dim", ValueError,
     r"{op}: freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 8 \(full rotation: \[\*, 4\]\), got \[16, 5\]",
     _x4, dict(freqs=rotary.rope_freqs(10, 16))),
    ("freqs-wider-varlen", ValueError, r"{op}: freqs must have shape .*head_dim = 8.*got \[16, 8\]",
     _x3, dict(freqs=rotary.rope_freqs(16, 16), cu_seqlens=torch.tensor([0, 5]))),
    ("freqs-zero-width", ValueError, r"{op}: freqs must have shape .*got \[16, 0\]",
     _x4, dict(freqs=torch.zeros(16, 0, dtype=torch.complex64))),
    ("inv-freq-float32", TypeError, r"{op}: inv_freq must be float64, got Float",
     _x4, dict(inv_freq=torch.ones(4))),
    ("inv-freq-wrong-length", ValueError, r"{op}: inv_freq must have shape \[rotary_dim / 2\] = \[4\] to match freqs, got \[8\]",
     _x4, dict(inv_freq=torch.ones(8, dtype=torch.float64))),
    ("inv-freq-partial-length", ValueError, r"inv_freq must have shape \[rotary_dim / 2\] = \[2\] to match freqs, got \[4\]",
     _x4, dict(inv_freq=torch.ones(4, dtype=torch.float64), freqs=rotary.rope_freqs(4, 16))),
    ("inv-freq-2d", ValueError, r"{op}: inv_freq must have shape \[rotary_dim / 2\] = \[4\].*got \[1, 4\]",
     _x4, dict(inv_freq=torch.ones(1, 4, dtype=torch.float64))),
    ("varlen-positions-2d", ValueError,
     r"{op}: with cu_seqlens, positions must have shape \[\] .* or \[total_tokens\] = \[5\] .*; got \[1, 5\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), positions=torch.zeros(1, 5, dtype=torch.int64))),
    ("varlen-positions-per-sequence", ValueError, r"{op}: with cu_seqlens, positions must have shape .*got \[2\]",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 5]), positions=torch.tensor([0, 3]))),
    ("varlen-positions-int32", TypeError, r"{op}: positions must be int64, got Int",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), positions=torch.zeros(5, dtype=torch.int32))),
    ("bshd-positions-batch", ValueError, r"{op}: positions must have shape .*batch = 2, seq_len = 3; got \[3\]",
     lambda: _x4(2, 3, 2, 8), dict(layout="BSHD", positions=torch.tensor([0, 1, 2]))),
    ("sbhd-positions-ids", ValueError, r"{op}: positions must have shape .*batch = 2, seq_len = 3; got \[3, 2\]",
     lambda: _x4(3, 2, 2, 8), dict(layout="SBHD", positions=torch.zeros(3, 2, dtype=torch.int64))),
    ("varlen-negative", ValueError, r"{op}: token \(batch 0, seq 0\) has negative position -2 \(start_pos 0 \+ positions\)",
     _x3, dict(cu_seqlens=torch.tensor([0, 2, 5]), positions=torch.tensor(-2))),
    ("varlen-past-table", IndexError, r"{op}: token \(batch 0, seq 4\) has position 16 .*outside the freqs table \[0, 16\)",
     _x3, dict(cu_seqlens=torch.tensor([0, 5]), start=12)),
    ("past-table-with-partial", IndexError, r"{op}: start_pos \+ seq_len = 15 \+ 3 = 18 exceeds",
     _x4, dict(freqs=rotary.rope_freqs(4, 16), start=15)),
]


def _run_op(op, x, f, start, kw):
    if op in ("apply_rope", "apply_rope_"):
        return getattr(rotary, op)(x, f, start, **kw)
    k = x[..., :1, :].clone() if x.dim() == 3 or kw.get("layout") in ("BSHD", "SBHD") else x[:, :1].clone()
    return getattr(rotary, op)(x, k, f, start, **kw)


@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_"])
@pytest.mark.parametrize("exc,pattern,make,kw", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_messages(op, exc, pattern, make, kw):
    kw = dict(kw)
    f = kw.pop("freqs", rotary.rope_freqs(8, 16))
    start = kw.pop("start", 0)
    x = make()
    snap = Snapshot(x, f, *[v for v in kw.values() if isinstance(v, torch.Tensor)])
    name = "q" if op.startswith("apply_rope_qk") else "x"
    with pytest.raises(exc, match=pattern.format(op=re.escape(op), x=name)):
        _run_op(op, x, f, start, kw)
    snap.check()


def test_k_named_in_varlen_errors():
    f = rotary.rope_freqs(8, 16)
    cu = torch.tensor([0, 5])
    with pytest.raises(ValueError, match=r"apply_rope_qk: with cu_seqlens, k must be 3-D .*got shape \[1, 5, 1, 8\]"):
        rotary.apply_rope_qk(_x3(), _x3()[None, :, :1], f, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"apply_rope_qk: k must match q .*q has shape \[5, 2, 8\], k has shape \[4, 1, 8\]"):
        rotary.apply_rope_qk(_x3(), _x3(4, 1), f, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"apply_rope_qk: k must match q"):
        # same token count in BSHD, but k's heads/seq are swapped
        rotary.apply_rope_qk(_x4(2, 3, 2, 8), _x4(2, 2, 3, 8), f, layout="BSHD")


def test_meta_kernel_checks_variants():
    """torch.compile / export see the same shape errors (no values on meta)."""
    f = rotary.rope_freqs(8, 16).to("meta")
    cu = torch.tensor([0, 5], device="meta")
    with pytest.raises(ValueError, match=r"a 3-D \[total_tokens, heads, head_dim\] input needs cu_seqlens"):
        rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f)
    with pytest.raises(ValueError, match=r"layout must be"):
        rotary.apply_rope(torch.empty(1, 2, 3, 8, device="meta"), f, layout="HBSD")
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32 or int64"):
        rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f, cu_seqlens=cu.float())
    with pytest.raises(TypeError, match=r"inv_freq must be float64"):
        rotary.apply_rope(torch.empty(1, 2, 3, 8, device="meta"), f, inv_freq=torch.empty(4, device="meta"))
    out = rotary.apply_rope(torch.empty(5, 2, 8, device="meta"), f, cu_seqlens=cu)
    assert out.shape == (5, 2, 8)
    x = torch.empty(3, 2, 4, 8, device="meta")  # SBHD
    assert rotary.apply_rope(x, f, layout="SBHD").stride() == x.stride()


def test_wrappers_return_inputs_and_match_raw_ops(tables):
    f = tables(8)
    q, k = randn((2, 2, 3, 8), seed=130), randn((2, 1, 3, 8), seed=131)
    q2, k2 = q.clone(), k.clone()
    assert torch.ops.rotary.apply_rope_qk_(q2, k2, f, 1) is None  # the op itself returns nothing
    rq, rk = rotary.apply_rope_qk_(q, k, f, 1)
    assert rq is q and rk is k and torch.equal(q, q2) and torch.equal(k, k2)
