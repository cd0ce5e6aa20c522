"""The prologue ops (q/k RMSNorm + RoPE, with or without the cache write)
under what the RoPE ops already survived: views with a math bit, a
conjugated table past its end, the inductor, fp8 scales, and a tensor
changed in place after the call that the backward does not need. Each call
gives the float64 reference's result or is refused by name, writing
nothing."""

import pytest
import torch

import rotary
from rotary_testing.prologue_reference import check, ref_prologue
from rotary_testing.rope_testing import randn, ref_rope4

D = 16


def neg_view(shape, seed):
    """A float view with the negative bit: logical values = -memory."""
    z = torch.complex(randn(shape, seed=seed), randn(shape, seed=seed + 1))
    v = z.conj().imag
    assert v.is_neg()
    return v


def weight(seed):
    return 1.0 + 0.5 * randn((D,), seed=seed)


def snapshot(*ts):
    return [t.detach().clone() for t in ts]


def unchanged(before, *ts):
    return all(torch.equal(a, b) for a, b in zip(before, ts))


# ----------------------------------------------------------- negative bits
@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_negative_bit_views_in_place(which):
    """torch's Negative fallback crashed the process here (the op writes two
    tensors and returns nothing)."""
    f = rotary.freqs_table(D, 16)
    q = neg_view((1, 2, 5, D), 1) if which in ("q", "both") else randn((1, 2, 5, D), seed=1)
    k = neg_view((1, 3, 5, D), 3) if which in ("k", "both") else randn((1, 3, 5, D), seed=3)
    wq, wk = weight(5), weight(6)
    want_q, want_k = ref_prologue(q, wq, D, start=2), ref_prologue(k, wk, D, start=2)
    rotary.apply_qk_norm_rope_(q, k, f, 2, q_weight=wq, k_weight=wk)
    check(q.clone(), want_q, torch.float32)
    check(k.clone(), want_k, torch.float32)


def test_negative_bit_views_out_of_place():
    f = rotary.freqs_table(D, 16)
    x, y = neg_view((1, 2, 5, D), 7), neg_view((1, 1, 5, D), 9)
    wq, wk = weight(5), weight(6)
    qo, ko = rotary.apply_qk_norm_rope(x, y, f, 2, q_weight=wq, k_weight=wk)
    check(qo, ref_prologue(x, wq, D, start=2), torch.float32)
    check(ko, ref_prologue(y, wk, D, start=2), torch.float32)


def cache_inputs(seed):
    q, k, v = randn((1, 2, 3, D), seed=seed), randn((1, 2, 3, D), seed=seed + 1), randn((1, 2, 3, D), seed=seed + 2)
    return q, k, v, torch.full((1, 2, 8, D), 7.0), torch.full((1, 2, 8, D), -7.0)


def test_negative_bit_views_with_the_cache_write():
    f = rotary.freqs_table(D, 16)
    wk = weight(4)
    # k and k_cache with the bit, v and v_cache with it too.
    q, _, _, _, _ = cache_inputs(1)
    k, kc = neg_view((1, 2, 3, D), 11), neg_view((1, 2, 8, D), 13)
    v, vc = neg_view((1, 2, 3, D), 15), neg_view((1, 2, 8, D), 17)
    want_k, want_v = ref_prologue(k, wk, D, start=1), v.clone()
    rest_k, rest_v = kc.clone(), vc.clone()
    rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, 1, k_weight=wk)
    check(k.clone(), want_k, torch.float32)
    check(kc.clone()[:, :, 1:4], want_k, torch.float32)
    assert torch.equal(vc.clone()[:, :, 1:4], want_v)
    for got, before in ((kc.clone(), rest_k), (vc.clone(), rest_v)):
        assert torch.equal(got[:, :, :1], before[:, :, :1]) and torch.equal(got[:, :, 4:], before[:, :, 4:])
    # Only v with the bit: the cache holds its logical values.
    q, k, _, kc, vc = cache_inputs(21)
    v = neg_view((1, 2, 3, D), 23)
    rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, 1)
    assert torch.equal(vc[:, :, 1:4], v.clone())


@pytest.mark.parametrize("which", ["k", "k_cache"])
def test_negative_bit_on_one_of_k_and_k_cache_is_refused(which):
    f = rotary.freqs_table(D, 16)
    q, k, v, kc, vc = cache_inputs(31)
    if which == "k":
        k = neg_view((1, 2, 3, D), 33)
    else:
        kc = neg_view((1, 2, 8, D), 35)
    before = snapshot(q, k, v, kc, vc)
    with pytest.raises(ValueError, match=r"apply_qk_norm_rope_with_kv_cache_: k is (not )?a negative-bit view but "
                                         r"k_cache"):
        rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, 1)
    assert unchanged(before, q, k, v, kc, vc)


def test_a_negative_bit_view_does_not_hide_an_overlap():
    """The fallback ran the op on a copy of q, so an overlap went unseen and
    the write landed anyway."""
    f = rotary.freqs_table(D, 16)
    z = torch.complex(randn((1, 2, 3, D), seed=41), randn((1, 2, 3, D), seed=42))
    q, k = z.conj().imag, z.imag[:, :1]  # the same memory, one with the bit
    before = z.clone()
    with pytest.raises(ValueError, match="apply_qk_norm_rope_: q and k overlap in memory"):
        rotary.apply_qk_norm_rope_(q, k, f, 2)
    assert torch.equal(z, before)
    z = torch.complex(randn((1, 2, 8, D), seed=43), randn((1, 2, 8, D), seed=44))
    q, kc = z.conj().imag[:, :, :3], z.imag
    _, k, v, _, vc = cache_inputs(45)
    before = z.clone()
    with pytest.raises(ValueError, match="apply_qk_norm_rope_with_kv_cache_: k_cache and q overlap in memory"):
        rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, 4)
    assert torch.equal(z, before)


# ------------------------------------------------- a conjugated table past its end
def call(op, q, k, f, start, **kw):
    """(q, k) as rotated by op; the cache op writes a cache made here."""
    if op == "apply_qk_norm_rope":
        return rotary.apply_qk_norm_rope(q, k, f, start, **kw)
    q, k = q.clone(), k.clone()
    if op == "apply_qk_norm_rope_":
        return rotary.apply_qk_norm_rope_(q, k, f, start, **kw)
    v = randn(k.shape, seed=99)
    kc, vc = torch.zeros(1, k.shape[1], 16, D, dtype=k.dtype), torch.zeros(1, k.shape[1], 16, D, dtype=k.dtype)
    rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, f, start, **kw)
    assert torch.equal(kc[:, :, start:start + k.shape[2]], k)
    return q, k


OPS = ["apply_qk_norm_rope", "apply_qk_norm_rope_", "apply_qk_norm_rope_with_kv_cache_"]


@pytest.mark.parametrize("op", OPS)
def test_conjugated_table_turns_back_past_its_end(op):
    """freqs.conj() is the inverse rotation, on the rows computed from
    inv_freq too: torch's Conjugate fallback copied the table without its
    bit, so those rows turned forwards."""
    table = rotary.freqs_table(D, 8)
    inv = rotary.inv_frequencies(D)[0]
    q, k = randn((1, 2, 6, D), seed=51), randn((1, 1, 6, D), seed=52)
    wq, wk = weight(53), weight(54)
    qo, ko = call(op, q, k, table.conj(), 5, inv_freq=inv, q_weight=wq, k_weight=wk)  # positions 5..10
    check(qo, ref_prologue(q, wq, D, start=5, inverse=True), torch.float32)
    check(ko, ref_prologue(k, wk, D, start=5, inverse=True), torch.float32)


def test_conjugated_table_gradients_past_its_end():
    table = rotary.freqs_table(D, 4)
    inv = rotary.inv_frequencies(D)[0]
    q = randn((1, 2, 3, D), torch.float64, seed=61).requires_grad_()
    k = randn((1, 1, 3, D), torch.float64, seed=62).requires_grad_()
    w = (1.0 + 0.5 * randn((D,), torch.float64, seed=63)).requires_grad_()
    fn = lambda q, k, w: rotary.apply_qk_norm_rope(q, k, table.conj(), 2, inv_freq=inv, q_weight=w, k_weight=w)
    torch.autograd.gradcheck(fn, (q, k, w))
    qo, _ = fn(q, k, w)
    check(qo, ref_prologue(q, w, D, start=2, inverse=True), torch.float64)


# ------------------------------------------------------------- the inductor
@pytest.mark.parametrize("cache", [False, True], ids=["apply_qk_norm_rope_", "apply_qk_norm_rope_with_kv_cache_"])
def test_in_place_ops_compile_with_the_inductor(cache):
    """A complex table under auto_functionalized_v2 failed to lower
    ("auto_functionalized_v2 was not removed")."""
    table = rotary.freqs_table(D, 16)
    q, k, v = randn((2, 2, 5, D), seed=71), randn((2, 1, 5, D), seed=72), randn((2, 1, 5, D), seed=74)
    kc, vc = torch.full((2, 1, 16, D), 7.0), torch.full((2, 1, 16, D), 7.0)
    wq = weight(73)
    want_q, want_k = ref_prologue(q, wq, D, start=3), ref_prologue(k, None, D, start=3)

    def fn(q, k, v, kc, vc):
        if cache:
            rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, kc, vc, table, 3, q_weight=wq)
        else:
            rotary.apply_qk_norm_rope_(q, k, table, 3, q_weight=wq)
        return q, k

    torch._dynamo.reset()
    qo, ko = torch.compile(fn, fullgraph=True)(q, k, v, kc, vc)
    check(qo, want_q, torch.float32)
    check(ko, want_k, torch.float32)
    if cache:
        assert torch.equal(kc[:, :, 3:8], ko) and torch.equal(vc[:, :, 3:8], v)


# ------------------------------------------------------------ fp8 q scales
@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), [1.0, 0.0], [1.0, float("-inf")]],
                         ids=["zero", "negative", "nan", "inf", "head-zero", "head-neg-inf"])
def test_q_fp8_scale_must_be_finite_and_positive(scale):
    """As k_scale and v_scale: otherwise q came back as all +-448, NaN or
    sign-flipped."""
    f = rotary.freqs_table(D, 16)
    q, k = randn((1, 2, 3, D), seed=81), randn((1, 1, 3, D), seed=82)
    s = torch.tensor(scale, dtype=torch.float32)
    head = " at head 1" if isinstance(scale, list) else ""
    with pytest.raises(ValueError, match=r"apply_qk_norm_rope: q_fp8_scale must be finite and > 0 \(q is returned "
                                         rf"as x / scale\), got .*{head}"):
        rotary.apply_qk_norm_rope(q, k, f, 1, q_fp8_scale=s)


# ------------------------------------------------------------- zero heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("empty", ["q", "k"])
@pytest.mark.parametrize("norm", ["head", "heads"])
@pytest.mark.parametrize("op", ["out_of_place", "in_place", "cache"])
def test_zero_heads_on_one_side(dtype, empty, norm, op):
    """A rank of an uneven head split can hold no q (or k) heads. The 16-bit
    per-head norm read two head vectors ahead whatever the head count: a
    crash on an empty tensor, a read past a zero-width slice of a real buffer.
    The empty side is a [:, H:H] slice of a poisoned buffer; the other side
    gives the reference and the buffer is left as it was."""
    f = rotary.freqs_table(D, 16)
    buf = torch.full((1, 2, 3, D), 7.5, dtype=dtype)  # the zero-width slice's neighbours
    full = randn((1, 2, 3, D), seed=31).to(dtype)
    q, k = (buf[:, 2:2], full) if empty == "q" else (full, buf[:, 2:2])
    w = weight(32) if norm == "head" else 1.0 + 0.5 * randn((2 * D,), seed=32)  # "heads": [heads * head_dim]
    want = ref_prologue(full, w, D, start=1, norm=norm)
    w_empty = w if norm == "head" else w[:0]
    kw = dict(q_weight=w_empty if empty == "q" else w, k_weight=w_empty if empty == "k" else w, norm=norm)
    if op == "out_of_place":
        outs = rotary.apply_qk_norm_rope(q, k, f, 1, **kw)
    elif op == "in_place":
        rotary.apply_qk_norm_rope_(q, k, f, 1, **kw)
        outs = (q, k)
    else:
        v = randn((1, 2 if empty == "q" else 0, 3, D), seed=33).to(dtype)
        caches = [torch.zeros(1, 2 if empty == "q" else 0, 8, D, dtype=dtype) for _ in range(2)]
        rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, *caches, f, 1, **kw)
        outs = (q, k)
        if empty == "q":
            check(caches[0][:, :, 1:4], want, dtype)
            assert torch.equal(caches[1][:, :, 1:4], v)
    got = outs[1] if empty == "q" else outs[0]
    check(got, want, dtype)
    assert outs[0 if empty == "q" else 1].numel() == 0
    assert torch.equal(buf, torch.full_like(buf, 7.5)), "the buffer around the empty side changed"


def test_a_side_needing_no_gradient_is_not_saved():
    """Only q, k needs no gradient: k and its weight are not saved, so k
    changed in place after the call (a buffer reused) leaves q's backward
    as the unfused route's, and q's side still is (its change is caught)."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, kw = torch.randn(1, 3, 1, 8, dtype=torch.float64, generator=g), torch.randn(8, dtype=torch.float64, generator=g)
    qw = torch.randn(8, dtype=torch.float64, generator=g)
    freqs = rotary.freqs_table(8, 64)

    def loss(q):
        oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, 2, layout="BSHD", q_weight=qw, k_weight=kw)
        with torch.no_grad():
            k.mul_(2)
            kw.mul_(2)
        return (oq * torch.arange(8, dtype=torch.float64)).sum()

    got = torch.autograd.grad(loss(q), q)[0]
    # The float64 reference: the loss's gradient at the norm's output is the
    # inverse rotation of its weights, then back through torch's RMSNorm.
    weights = torch.arange(8, dtype=torch.float64).expand(1, 3, 2, 8)
    at_norm = ref_rope4(weights, start=2, interleaved=True, inverse=True, layout="BSHD")
    qd = q.detach().requires_grad_()
    want = torch.autograd.grad((torch.nn.functional.rms_norm(qd, (8,), qw, 1e-6) * at_norm).sum(), qd)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # a complex64 table
    oq, _ = rotary.apply_qk_norm_rope(q, k, freqs, 2, layout="BSHD", q_weight=qw)
    with torch.no_grad():
        qw.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        oq.sum().backward()


def test_forward_over_reverse_gradients_carry_the_inputs_tangents():
    """The norm's backward reads q and its weight: under a dual level (a
    gradient taken of dual inputs, forward over reverse) it read the saved
    primals, so the gradient's tangent was None or lacked their part (off by
    up to 2). Against the differentiable float64 reference."""
    import torch.autograd.forward_ad as fwAD

    from rotary_testing.prologue_reference import ref_norm_rope

    f = rotary.freqs_table(8, 64)
    q, k, W, tq = (randn((1, 2, 3, 8), dtype=torch.float64, seed=s) for s in (401, 402, 403, 404))
    w, tw = randn((8,), dtype=torch.float64, seed=405), randn((8,), dtype=torch.float64, seed=406)

    def tangents(rope, loss):
        with fwAD.dual_level():
            x = fwAD.make_dual(q.clone().requires_grad_(), tq)
            xw = fwAD.make_dual(w.clone().requires_grad_(), tw)
            grads = torch.autograd.grad(loss(rope(x, xw)), (x, xw), create_graph=True)
            return [fwAD.unpack_dual(g).tangent for g in grads]

    for loss in (lambda o: (o * W).sum(), lambda o: (o ** 2).sum()):
        got = tangents(lambda x, xw: rotary.apply_qk_norm_rope(x, k, f, 3, q_weight=xw)[0], loss)
        want = tangents(lambda x, xw: ref_norm_rope(x, xw, 3), loss)
        for g, r in zip(got, want):
            assert g is not None and r.abs().max() > 1e-3
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)  # the table is complex64
    args = (q.clone().requires_grad_(), k.clone().requires_grad_(), w.clone().requires_grad_())
    assert torch.autograd.gradgradcheck(lambda a, b, c: rotary.apply_qk_norm_rope(a, b, f, 3, q_weight=c), args,
                                        check_fwd_over_rev=True)
