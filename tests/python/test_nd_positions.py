"""rotary_offset (the rotated span anywhere in the head) and N-D positions
(pair_axes: pair j turns by its own axis of position_ids) against the float64
reference, through every op, in place, autograd, opcheck and compile."""

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference_nd
from rotary_testing.rope_testing import (
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    Snapshot,
    assert_close_ref,
    bits,
    cu_from_lens,
    gen,
    poison_allocator,
    random_strided,
    randn,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")

MROPE_AXES = [0] * 4 + [1] * 2 + [2] * 2  # sections [4, 2, 2] of 8 pairs


def grid(n_axes, B, S, room, seed):
    """int64 [n_axes, B, S] random positions below `room`."""
    return torch.randint(0, room, (n_axes, B, S), generator=gen(seed))


def ref(x, pos, axes, r, offset=0, interleaved=True, inverse=False):
    return rope_reference_nd(x, pos.numpy(), axes, r, offset, interleaved, inverse)


# --------------------------------------------------------------- rotary_offset
@pytest.mark.parametrize("offset", [0, 2, 5, 8])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_offset(tables, dtype, interleaved, offset):
    """Dims [offset, offset + r) rotate; the others are the input's, out of
    place (copied) and in place (never written: NaN bits kept)."""
    B, Hq, Hk, S, D, r, start = 2, 3, 1, 5, 24, 16, 3
    f = tables(r)
    q = randn((B, Hq, S, D), dtype, seed=1)
    k = random_strided((B, Hk, S, D), dtype, seed=2)
    snap = Snapshot(q, k)
    poison_allocator(q.numel(), dtype)
    pos = torch.arange(start, start + S).expand(1, B, S)
    out = rotary.apply_rope(q, f, start, interleaved, rotary_offset=offset)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved, rotary_offset=offset)
    snap.check()
    assert_close_ref(out, ref(q, pos, [0] * (r // 2), r, offset, interleaved), dtype)
    assert_close_ref(ok, ref(k, pos, [0] * (r // 2), r, offset, interleaved), dtype)
    assert torch.equal(oq, out)
    outside = torch.ones(D, dtype=torch.bool)
    outside[offset : offset + r] = False
    assert torch.equal(out[..., outside], q[..., outside])
    # The span is exactly the rotation of the narrow view.
    span = rotary.apply_rope(q[..., offset : offset + r], f, start, interleaved)
    assert torch.equal(out[..., offset : offset + r], span)
    x = q.clone()
    x[..., outside] = float("nan")
    kept = bits(x[..., outside])
    rotary.apply_rope_(x, f, start, interleaved, rotary_offset=offset)
    assert torch.equal(x[..., offset : offset + r], span)
    assert torch.equal(bits(x[..., outside]), kept)


def test_rotary_offset_errors(tables):
    f = tables(16)
    x = randn((1, 2, 3, 24))
    for bad in (9, -1, 100):
        snap = Snapshot(x)
        match = (r"apply_rope_: rotary_offset must be >= 0, got -1" if bad < 0 else
                 r"apply_rope_: rotary_offset \+ rotary_dim must fit in head_dim = 24.*"
                 rf"rotary_offset = {bad} and rotary_dim = 16")
        with pytest.raises(ValueError, match=match):
            rotary.apply_rope_(x, f, rotary_offset=bad)
        snap.check()
    with pytest.raises(ValueError, match="rotary_offset"):
        torch.ops.rotary.apply_rope(x.to("meta"), f.to("meta"), rotary_offset=10)


# ------------------------------------------------------------------ pair_axes
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pair_axes(tables, dtype, interleaved):
    """[n_axes, B, S], broadcast [n_axes, 1, S] and [n_axes, S] ids, int32
    and int64, with an offset span, q and k, non-contiguous."""
    B, Hq, Hk, S, D, r, L = 2, 4, 2, 6, 20, 16, 32
    f = tables(r, L)
    q = random_strided((B, Hq, S, D), dtype, seed=3)
    k = randn((B, S, Hk, D), dtype, seed=4).transpose(1, 2)
    pos = grid(3, B, S, L, seed=5)
    for ids, full in ((pos, pos), (pos[:, :1].int(), pos[:, :1].expand(3, B, S)), (pos[:, 0], pos[:, :1].expand(3, B, S))):
        snap = Snapshot(q, k, ids)
        oq, ok = rotary.apply_rope_qk(
            q, k, f, interleaved=interleaved, position_ids=ids, pair_axes=MROPE_AXES, rotary_offset=2)
        snap.check()
        assert_close_ref(oq, ref(q, full, MROPE_AXES, r, 2, interleaved), dtype)
        assert_close_ref(ok, ref(k, full, MROPE_AXES, r, 2, interleaved), dtype)
        x = q.clone()
        rotary.apply_rope_(x, f, interleaved=interleaved, position_ids=ids, pair_axes=MROPE_AXES, rotary_offset=2)
        assert torch.equal(x, oq)


@pytest.mark.parametrize("axes", [MROPE_AXES, [(j % 3 if j < 6 else 0) for j in range(8)], [1, 0] * 4])
def test_text_tokens_equal_1d(tables, axes):
    """A token whose axes agree gets exactly the 1-D result, bit for bit."""
    B, H, S, D, L = 2, 3, 7, 16, 32
    f = tables(D, L)
    x = randn((B, H, S, D), torch.bfloat16, seed=6)
    ids = torch.randint(0, L, (B, S), generator=gen(7))
    nd = rotary.apply_rope(x, f, position_ids=ids.expand(max(axes) + 1, B, S), pair_axes=axes)
    assert torch.equal(nd, rotary.apply_rope(x, f, position_ids=ids))


def test_pair_axes_packed_and_past_table(tables):
    """Packed [n_axes, T] ids with cu_seqlens; with inv_freq, positions past
    the table are computed exactly."""
    r, D, L = 8, 8, 16
    f, inv = tables(r, L), torch.from_numpy(1.0 / 10000.0 ** (np.arange(r // 2) * 2.0 / r))
    cu = cu_from_lens([3, 0, 5], torch.int32)
    x = randn((8, 2, D), torch.float64, seed=8)
    pos = torch.randint(0, 40, (2, 8), generator=gen(9))
    axes = [0, 1, 0, 1]
    out = rotary.apply_rope(x, f, cu_seqlens=cu, position_ids=pos, pair_axes=axes, inv_freq=inv)
    expect = ref(x.permute(1, 0, 2).unsqueeze(0), pos[:, None], axes, r)[0].permute(1, 0, 2)
    assert_close_ref(out, expect, torch.float64)
    with pytest.raises(IndexError, match=r"on axis \d \(position_ids\), outside the freqs table"):
        rotary.apply_rope(x, f, cu_seqlens=cu, position_ids=pos, pair_axes=axes)


def test_pair_axes_errors(tables):
    """Each bad input names the argument; a refused in-place call writes nothing."""
    f = tables(16)
    x = randn((2, 3, 5, 16))
    ids = torch.zeros(3, 2, 5, dtype=torch.long)
    cases = [
        (dict(position_ids=ids, pair_axes=[0] * 7), r"pair_axes must have one axis per pair, rotary_dim / 2 = 8 entries, got 7"),
        (dict(position_ids=ids, pair_axes=[0] * 7 + [-1]), r"pair_axes\[7\] must be an axis index in \[0, 16\), got -1"),
        (dict(position_ids=ids, pair_axes=[0] * 4 + [1] * 4), r"position_ids has 3 axes .* pair_axes .*uses axes 0..1"),
        (dict(position_ids=ids[:2], pair_axes=MROPE_AXES), r"position_ids has 2 axes .* pair_axes .*uses axes 0..2"),
        (dict(pair_axes=MROPE_AXES), r"pair_axes needs position_ids with a leading axis dim"),
        (dict(offsets=torch.tensor(1), pair_axes=MROPE_AXES), r"pair_axes needs position_ids.*offsets carry no axes"),
        (dict(position_ids=ids[0, 0], pair_axes=MROPE_AXES), r"with pair_axes, position_ids must have shape \[n_axes, seq_len\]"),
        (dict(position_ids=ids[:, :, :4], pair_axes=MROPE_AXES), r"with n_axes = 3, batch = 2 and seq_len = 5; got \[3, 2, 4\]"),
        (dict(position_ids=ids[:, 0, :4], pair_axes=MROPE_AXES), r"with n_axes = 3 and seq_len = 5; got \[3, 4\]"),
        (dict(position_ids=ids - 1, pair_axes=MROPE_AXES), r"negative position -1 on axis 0"),
        (dict(position_ids=ids + 40, pair_axes=MROPE_AXES), r"position 40 on axis 0 \(position_ids\), outside the freqs table"),
        (dict(position_ids=ids + torch.tensor([0, 32, 0])[:, None, None], pair_axes=MROPE_AXES),
         r"position 32 on axis 1 \(position_ids\), outside the freqs table \[0, 32\)"),  # one row past: its last + 1
        (dict(position_ids=torch.zeros(3, 3, 5, dtype=torch.long), pair_axes=MROPE_AXES),
         r"with n_axes = 3, batch = 2 and seq_len = 5; got \[3, 3, 5\]"),  # rows past 2 would be read
        (dict(position_ids=torch.zeros(1, 1, 5, dtype=torch.long), pair_axes=[0] * 8 + [0]),
         r"pair_axes must have one axis per pair, rotary_dim / 2 = 8 entries, got 9"),
        (dict(position_ids=ids), r"for N-D positions \[n_axes, batch, seq_len\] pass pair_axes"),
    ]
    rotary.apply_rope_(x.clone(), f, position_ids=ids + torch.tensor([0, 31, 0])[:, None, None], pair_axes=MROPE_AXES)
    for kw, msg in cases:
        y = x.clone()
        snap = Snapshot(y, ids)
        with pytest.raises((ValueError, IndexError), match=msg):
            rotary.apply_rope_(y, f, **kw)
        snap.check()
        if "negative" not in msg and "outside" not in msg:  # shape errors: Meta too
            meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            with pytest.raises(ValueError, match=msg):
                torch.ops.rotary.apply_rope(x.to("meta"), f.to("meta"), **meta)


def test_pair_axes_gradients(tables):
    """Backward is the inverse N-D rotation; gradcheck and gradgradcheck in fp64."""
    f = tables(8)
    pos = grid(2, 1, 3, 32, seed=10)
    axes = [0, 1, 1, 0]
    q = randn((1, 2, 3, 12), torch.float64, seed=11).requires_grad_()
    k = randn((1, 1, 3, 12), torch.float64, seed=12).requires_grad_()

    def fn(q, k):
        return rotary.apply_rope_qk(q, k, f, interleaved=False, position_ids=pos, pair_axes=axes, rotary_offset=3)

    assert torch.autograd.gradcheck(fn, (q, k))
    assert torch.autograd.gradgradcheck(fn, (q, k))


def test_pair_axes_opcheck_and_compile(tables):
    f = tables(8)
    pos = grid(3, 2, 4, 32, seed=13)
    axes = [0, 0, 1, 2]
    q, k = randn((2, 2, 4, 10), seed=14), randn((2, 1, 4, 10), seed=15)
    kw = dict(position_ids=pos, pair_axes=axes, rotary_offset=2)
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk.default, (q, k, f), kw)
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, (q.clone().requires_grad_(), f), kw)
    torch.library.opcheck(torch.ops.rotary.apply_rope_.default, (q.clone(), f), kw)

    @torch.compile(fullgraph=True)
    def step(q, k, pos):
        return rotary.apply_rope_qk(q, k, f, position_ids=pos, pair_axes=axes, rotary_offset=2)

    eq, ek = rotary.apply_rope_qk(q, k, f, **kw)
    cq, ck = step(q, k, pos)
    assert torch.equal(cq, eq) and torch.equal(ck, ek)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_nd_and_graph_replay(tables, dtype):
    """The CUDA kernel against the CPU one (N-D ids, offset span, vector and
    strided paths), and a CUDA graph replayed with new device positions."""
    f = tables(16, 64)
    axes = MROPE_AXES
    for D, off in ((32, 8), (26, 5)):
        q, k = randn((2, 4, 7, D), dtype, seed=20), randn((2, 2, 7, D), dtype, seed=21)
        pos = grid(3, 2, 7, 64, seed=22)
        kw = dict(position_ids=pos, pair_axes=axes, rotary_offset=off, interleaved=False)
        cq, ck = rotary.apply_rope_qk(q, k, f, **kw)
        gq, gk = rotary.apply_rope_qk(q.cuda(), k.cuda(), f.cuda(), **{**kw, "position_ids": pos.cuda()})
        assert_close_ref(gq, ref(q, pos, axes, 16, off, False), dtype)
        torch.testing.assert_close(gk.cpu(), ck, rtol=0, atol=TOL_GRAPH[dtype])
    x = randn((1, 2, 5, 16), dtype, seed=23).cuda()
    dev_pos = grid(3, 1, 5, 64, seed=24).cuda()
    out, fc = torch.empty_like(x), f.cuda()  # no host-to-device copy while capturing
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(rotary.apply_rope(x, fc, position_ids=dev_pos, pair_axes=axes))
    new = grid(3, 1, 5, 64, seed=25)
    dev_pos.copy_(new)
    g.replay()
    assert_close_ref(out, ref(x, new, axes, 16), dtype)


TOL_GRAPH = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def test_far_angle_bound_is_per_axis():
    """The 2^62 rad bound past the table reads each axis's own pairs: a slow
    axis far out is served (exactly) when only a fast axis's frequency would
    pass the bound at that position; the fast axis there is refused."""
    from rotary_testing.reference import exact_angle, rotate_pairs_nd

    inv = torch.tensor([1e3, 1e-3], dtype=torch.float64)  # pair 0 on axis 0, pair 1 on axis 1
    tab = torch.polar(torch.ones(16, 2, dtype=torch.float64), torch.arange(16.0, dtype=torch.float64)[:, None] * inv)
    tab = tab.to(torch.complex64)
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[[1]], [[2**59]]])  # pair 1 turns 5.8e14 rad; 2^59 * 1e3 would pass 2^62
    got = rotary.apply_rope(q, tab, position_ids=pos, pair_axes=[0, 1], inv_freq=inv)
    angle = np.stack([exact_angle(pos[a].numpy(), inv[a : a + 1].numpy())[..., 0] for a in (0, 1)], -1)
    torch.testing.assert_close(got, torch.from_numpy(rotate_pairs_nd(q.numpy(), angle[:, None], True)),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError, match=r"2\^62"):
        rotary.apply_rope(q, tab, position_ids=pos.flip(0), pair_axes=[0, 1], inv_freq=inv)


def test_an_axis_no_pair_reads_is_not_checked_against_the_table(tables):
    """The host check refused a position past the table on an axis no pair
    turns by (pair_axes [1, 1, 1, 1] of 2 axes), which no kernel reads (the
    CUDA kernels served it); a negative one is still refused."""
    f = tables(8, 16)
    x = randn((2, 3, 5, 8), torch.float64, seed=21)
    ids = torch.randint(0, 16, (2, 2, 5), generator=gen(22))
    ids[0] += 1000  # axis 0: past the table, never read
    for op in (rotary.apply_rope, rotary.apply_rope_):
        got = op(x.clone(), f, position_ids=ids, pair_axes=[1] * 4)
        assert_close_ref(got, ref(x, ids, [1] * 4, 8), torch.float64)
    with pytest.raises(IndexError, match=r"position 10\d\d on axis 0 \(position_ids\), outside the freqs table"):
        rotary.apply_rope(x, f, position_ids=ids, pair_axes=[0, 1, 1, 1])
    with pytest.raises(ValueError, match=r"negative position -1 on axis 0"):
        rotary.apply_rope(x, f, position_ids=torch.stack([ids[1] * 0 - 1, ids[1]]), pair_axes=[1] * 4)


def test_more_pairs_than_the_kernels_hold_are_refused_by_the_op():
    """The op's own limit (the module's is tested apart): 513 pairs would be
    written past RopeParams::pair_axis, over the fields after it."""
    x, f = randn((1, 1, 4, 1026), seed=23), rotary.freqs_table(1026, 4)
    ids = torch.arange(4)[None]
    at_limit = rotary.apply_rope(x[..., :1024], rotary.freqs_table(1024, 4), position_ids=ids, pair_axes=[0] * 512)
    assert_close_ref(at_limit, ref(x[..., :1024], ids[:, None], [0] * 512, 1024), x.dtype)
    for op in (torch.ops.rotary.apply_rope, rotary.apply_rope):
        with pytest.raises(ValueError, match=r"pair_axes supports at most 512 pairs \(rotary_dim <= 1024\), got 513"):
            op(x, f, position_ids=ids, pair_axes=[0] * 512 + [1])


def test_nd_host_checks_reach_every_token_and_axis():
    """The host check of N-D ids reaches every token (not only the first
    of a row), the axis only the last pair reads, and the (-2^60, 2^60)
    range on an axis no pair reads or with inv_freq; a mutation run found
    no test that sent these."""
    x, f = randn((1, 1, 4, 8), seed=24), rotary.freqs_table(8, 16)
    far = torch.zeros(2, 4, dtype=torch.long)
    far[0, 3] = 100
    for ids in (far, far[:, None]):  # [n_axes, seq] and [n_axes, 1, seq]
        with pytest.raises(IndexError, match=r"token \(batch 0, seq 3\) has position 100 on axis 0 \(position_ids\)"):
            rotary.apply_rope(x, f, position_ids=ids, pair_axes=[0, 0, 1, 1])
    last = torch.zeros(2, 4, dtype=torch.long)
    last[1, 0] = 100
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 0\) has position 100 on axis 1 \(position_ids\)"):
        rotary.apply_rope(x, f, position_ids=last, pair_axes=[0, 0, 0, 1])
    unread = torch.zeros(3, 4, dtype=torch.long)
    unread[1, 1] = 2**61
    inv = torch.full((4,), 1e-6, dtype=torch.float64)
    slow = torch.polar(torch.ones(16, 4), torch.arange(16.0)[:, None] * inv.float())
    read = torch.zeros(2, 4, dtype=torch.long)
    read[0, 1] = 2**61
    for kw in (dict(freqs=f, position_ids=unread, pair_axes=[0, 0, 2, 2]),
               dict(freqs=slow, position_ids=read, pair_axes=[0, 0, 1, 1], inv_freq=inv)):
        with pytest.raises(IndexError, match=r"position_ids must lie in \(-2\^60, 2\^60\), got 2305843009213693952"):
            rotary.apply_rope(x, **kw)
    read[0, 1] = 2**60 - 1  # the largest: served with inv_freq
    assert torch.isfinite(rotary.apply_rope(x, slow, position_ids=read, pair_axes=[0, 0, 1, 1], inv_freq=inv)).all()
