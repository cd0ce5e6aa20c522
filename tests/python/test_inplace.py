"""In-place ops (apply_rope_, apply_rope_qk_): the out-of-place bits, packed
qkv views, refused inputs (requires grad, expanded, q/k overlap) and bad
calls that write nothing; the wrappers return their inputs."""

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
    randn,
    VARLEN_LENS,
    cu_from_lens,
    random_strided,
    ref_rope4,
    ref_varlen,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


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
        kw = dict(layout="BSHD", position_ids=torch.tensor([[1, 10, 3, 3, 21], [2, 2, 2, 2, 2]]))
    elif variant == "sbhd-partial":
        x = random_strided((5, 2, 3, D), dtype, seed=62)
        kw = dict(layout="SBHD", offsets=torch.tensor([4, 0]))
    else:
        x = random_strided((sum(VARLEN_LENS), 3, D), dtype, seed=63)
        kw = dict(cu_seqlens=cu_from_lens(VARLEN_LENS, torch.int32), offsets=torch.tensor(2))
    start = 0 if "position_ids" in kw else 1
    want = rotary.apply_rope(x, f, start, interleaved, **kw)
    y = x.clone() if x.is_contiguous() else x  # x itself is modified below
    before = y._version
    res = rotary.apply_rope_(y, f, start, interleaved, **kw)
    assert res is y
    assert y._version > before
    assert torch.equal(y, want)
    # qk in place: two tensors, GQA head counts.
    q = randn(want.shape, dtype, seed=64)
    k = q[..., :1, :].clone() if variant != "bhsd" else q[:, :1].clone()
    wq, wk = rotary.apply_rope_qk(q, k, f, start, interleaved, **kw)
    rq, rk = rotary.apply_rope_qk_(q, k, f, start, interleaved, **kw)
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
    rq, rk = rotary.apply_rope_qk_(q, k, f, interleaved=interleaved, layout="BSHD", **op_positions(2, pos))
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
    rotary.apply_rope_qk_(q, k, f, interleaved=interleaved, cu_seqlens=cu, **op_positions(0, ids, packed=True))
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
        ("varlen-offset-past-table", x3, dict(cu_seqlens=cu, offsets=torch.tensor(13))),
        ("varlen-ids-negative", x3, dict(cu_seqlens=cu, position_ids=torch.tensor([0, 1, 2, 3, -9, 5]))),
        ("varlen-ids-shape", x3, dict(cu_seqlens=cu, position_ids=torch.zeros(1, T, dtype=torch.int64))),
        ("ids-with-start-pos", x4, dict(start=1, position_ids=torch.zeros(2, 3, dtype=torch.int32))),
        ("offsets-and-ids", x4, dict(offsets=torch.zeros(2, dtype=torch.int64), position_ids=torch.zeros(3))),
        ("layout", x4, dict(layout="BHDS")),
        ("layout-varlen", x3, dict(cu_seqlens=cu, layout="BSHD")),
        ("offsets-past-table", x4, dict(offsets=torch.tensor([0, 14]))),
        ("ids-negative", x4, dict(position_ids=torch.tensor([[0, 1, 2], [3, -1, 2]]))),
        ("inv-freq-dtype", x4, dict(start=20, inv_freq=torch.ones(4))),
        ("freqs-wide", x4, dict(freqs=rotary.freqs_table(16, 16))),
    ]


_BAD_INPLACE = _bad_inplace_cases()


@pytest.mark.parametrize("make,kw", [c[1:] for c in _BAD_INPLACE], ids=[c[0] for c in _BAD_INPLACE])
def test_inplace_error_writes_nothing(make, kw):
    kw = dict(kw)
    f = kw.pop("freqs", rotary.freqs_table(8, 16))
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


def test_wrappers_return_inputs_and_match_raw_ops(tables):
    f = tables(8)
    q, k = randn((2, 2, 3, 8), seed=130), randn((2, 1, 3, 8), seed=131)
    q2, k2 = q.clone(), k.clone()
    assert torch.ops.rotary.apply_rope_qk_(q2, k2, f, 1) is None  # the op itself returns nothing
    rq, rk = rotary.apply_rope_qk_(q, k, f, 1)
    assert rq is q and rk is k and torch.equal(q, q2) and torch.equal(k, k2)


# Every in-place op bumps each tensor it writes once, and nothing else, in
# every grad mode: under inference mode too, where the Autograd kernels do
# not run (torch's own in-place ops bump there as well).
def _inplace_calls():
    f = rotary.freqs_table(8, 16)
    q, k, v = randn((1, 4, 3, 8), seed=140), randn((1, 2, 3, 8), seed=141), randn((1, 2, 3, 8), seed=142)
    kc, vc = randn((1, 2, 6, 8), seed=143), randn((1, 2, 6, 8), seed=144)
    pos = torch.tensor([[1, 2, 3]])
    return [
        ("apply_rope_", lambda: rotary.apply_rope_(q, f), [q]),
        ("apply_rope_qk_", lambda: rotary.apply_rope_qk_(q, k, f), [q, k]),
        ("apply_qk_norm_rope_", lambda: rotary.apply_qk_norm_rope_(q, k, f), [q, k]),
        ("apply_rope_with_kv_cache_",
         lambda: rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, cache_positions=pos), [q, k, kc, vc]),
        ("apply_qk_norm_rope_with_kv_cache_",
         lambda: rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, cache_positions=pos), [q, k, kc, vc]),
    ], [f, v]


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_versions_bumped_once_in_every_grad_mode(mode):
    calls, read_only = _inplace_calls()
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    for name, call, written in calls:
        before = [t._version for t in written + read_only]
        with ctx():
            call()
        after = [t._version for t in written + read_only]
        assert [a - b for a, b in zip(after, before)] == [1] * len(written) + [0] * len(read_only), name


def test_saved_tensor_rotated_under_inference_mode_fails_backward():
    # The prologue saves q for its norm's backward; rotating q in place under
    # inference mode afterwards must make that backward raise, not read it.
    f = rotary.freqs_table(8, 16)
    q, k = randn((1, 4, 3, 8), seed=150), randn((1, 2, 3, 8), seed=151)
    w = torch.ones(8, requires_grad=True)
    oq, _ = rotary.apply_qk_norm_rope(q, k, f, q_weight=w)
    with torch.inference_mode():
        rotary.apply_rope_(q, f)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oq.sum().backward()
