"""Autograd modes the ops cannot serve are refused by name, never silently
wrong: forward-mode AD where no tangent is computed (the kernels run below
autograd, so a tangent was dropped: a zero jvp), tables that require grad
(they get no gradient), and a v that requires grad in the cache ops (v_cache
would hold it with no graph). The out-of-place rotations' tangents, and a
compiled-autograd step's gradients, match a float64 reference.
The prologue op's backward under a non-reentrant checkpoint matches a float64
reference (it read its saved tensors twice and raised)."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.utils.checkpoint import checkpoint

import rotary
from rotary_testing.prologue_reference import ref_norm_rope
from rotary_testing.rope_testing import Snapshot, randn, ref_rope4

D, S = 8, 4
FREQS = rotary.freqs_table(D, 16)
ROPE, CPP_ROPE = rotary.RotaryEmbedding(D, 16), rotary.CppRotaryEmbedding(D, 16)
TANGENT = (r"carries a forward-mode tangent \(torch.func.jvp / jacfwd, torch.autograd.forward_ad\); forward mode is "
           r"served for q, k \(x\) of apply_rope, apply_rope_qk, their in-place forms and apply_rope_cos_sin, and "
           r"for q, k and the weights of apply_qk_norm_rope and apply_qk_norm_rope_")


def heads(seed, h=2, dtype=torch.float64):
    return randn((1, h, S, D), dtype, seed=seed)


def cache(seed):
    return randn((1, 1, 8, D), torch.float64, seed=seed)


# Each takes (x, k) and calls one op or module with x in the first tensor slot.
CALLS = {
    "apply_rope": lambda x, k: rotary.apply_rope(x, FREQS, 1),
    "apply_rope_qk": lambda x, k: rotary.apply_rope_qk(x, k, FREQS, 1)[0],
    "apply_rope_": lambda x, k: rotary.apply_rope_(x, FREQS, 1),
    "apply_rope_qk_": lambda x, k: rotary.apply_rope_qk_(x, k, FREQS, 1)[0],
    "apply_qk_norm_rope": lambda x, k: rotary.apply_qk_norm_rope(x, k, FREQS, 1)[0],
    "apply_qk_norm_rope_": lambda x, k: rotary.apply_qk_norm_rope_(x, k, FREQS, 1)[0],
    "apply_rope_cos_sin": lambda x, k: rotary.apply_rope_cos_sin(x, k, FREQS.real.repeat(1, 2), FREQS.imag.repeat(1, 2),
                                                                 position_ids=torch.arange(S)[None], interleaved=False)[0],
    "RotaryEmbedding": lambda x, k: ROPE(x, 1),
    "CppRotaryEmbedding": lambda x, k: CPP_ROPE(x, 1),
    "apply_rope_with_kv_cache_": lambda x, k: rotary.apply_rope_with_kv_cache_(x, k, k.clone(), cache(5), cache(6), FREQS)[0],
    "apply_qk_norm_rope_with_kv_cache_": lambda x, k: rotary.apply_qk_norm_rope_with_kv_cache_(
        x, k, k.clone(), cache(5), cache(6), FREQS)[0],
}
FIRST = {"apply_rope": "x", "apply_rope_": "x", "RotaryEmbedding": "x", "CppRotaryEmbedding": "x"}


# The out-of-place rotations, which compute a tangent; the table's complex64
# (cos, sin) bound their float64 results to about 1e-7.
TOL = dict(rtol=1e-6, atol=1e-6)
TANGENT_CALLS = ["apply_rope", "apply_rope_qk", "apply_rope_cos_sin", "RotaryEmbedding", "CppRotaryEmbedding"]


IN_PLACE_TANGENT_CALLS = ["apply_rope_", "apply_rope_qk_", "apply_qk_norm_rope_"]


@pytest.mark.parametrize("name", [n for n in CALLS if n not in TANGENT_CALLS + IN_PLACE_TANGENT_CALLS
                                  + ["apply_qk_norm_rope"]])
def test_forward_mode_ad_is_refused(name):
    x, k, t = heads(1), heads(2, h=1), heads(3)
    before = x.clone()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        with pytest.raises(NotImplementedError, match=rf"{FIRST.get(name, 'q')} {TANGENT}"):
            CALLS[name](dual, k)
    assert torch.equal(x, before)  # a refused in-place call wrote nothing


def test_func_jvp_and_jacfwd_are_refused():
    x, k, v, t = heads(1), heads(2, h=1), heads(4, h=1), heads(3)
    with pytest.raises(NotImplementedError, match=TANGENT):
        torch.func.jvp(lambda a: rotary.apply_rope_with_kv_cache_(a, k, v, cache(5), cache(6), FREQS)[0], (x,), (t,))
    with pytest.raises(NotImplementedError, match=TANGENT):
        torch.func.jvp(lambda c: rotary.apply_rope(x, c, 1), (FREQS,), (torch.ones_like(FREQS),))


def test_prologue_forward_mode_matches_reference():
    """apply_qk_norm_rope's tangents (q, k and the weight's) are R of the
    norm's derivative: against jvp of the float64 reference, by forward_ad
    and torch.func.jvp, with the primals also in a reverse graph."""
    q, k, w = heads(1), heads(2, h=1), torch.rand(D, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.5
    tq, tk, tw = heads(3), heads(4, h=1), torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ours = lambda q, k, w: rotary.apply_qk_norm_rope(q, k, FREQS, 3, q_weight=w, k_weight=w, eps=1e-6)
    ref = lambda q, k, w: (ref_norm_rope(q, w, 3), ref_norm_rope(k, w, 3))
    ours_heads = lambda q, k, w: rotary.apply_qk_norm_rope(q, k, FREQS, 3, q_weight=w, eps=1e-6, norm="heads")[0]
    want_out, want_t = torch.func.jvp(ref, (q, k, w), (tq, tk, tw))
    got_out, got_t = torch.func.jvp(ours, (q, k, w), (tq, tk, tw))
    for a, b in zip(got_out + got_t, want_out + want_t):
        torch.testing.assert_close(a, b, **TOL)
    _, only_w = torch.func.jvp(lambda w: ours(q, k, w), (w,), (tw,))  # the weight's tangent alone
    _, want_w = torch.func.jvp(lambda w: ref(q, k, w), (w,), (tw,))
    for a, b in zip(only_w, want_w):
        torch.testing.assert_close(a, b, **TOL)
    # OLMo2's norm over every head, its weight [heads * D].
    wh, twh = w.repeat(2), tw.repeat(2) * 0.5
    _, got_h = torch.func.jvp(lambda q, w: ours_heads(q, k, w), (q, wh), (tq, twh))
    _, want_h = torch.func.jvp(lambda q, w: ref_norm_rope(q, w, 3, heads=True), (q, wh), (tq, twh))
    torch.testing.assert_close(got_h, want_h, **TOL)
    want_q = torch.func.jvp(lambda q: ref(q, k, w)[0], (q,), (tq,))[1]
    pq = q.clone().requires_grad_()
    with fwAD.dual_level():
        oq, _ = ours(fwAD.make_dual(pq, tq), k, w)
        torch.testing.assert_close(fwAD.unpack_dual(oq).tangent, want_q, **TOL)
        (oq * heads(8)).sum().backward()
    torch.testing.assert_close(pq.grad, torch.func.grad(lambda q: (ref(q, k, w)[0] * heads(8)).sum())(q), **TOL)


@pytest.mark.parametrize("name", TANGENT_CALLS)
def test_forward_mode_ad_matches_reference(name):
    """The tangent of an out-of-place rotation is the same rotation of the
    input's tangent (the op is linear): against the float64 reference,
    through forward_ad, torch.func.jvp and jacfwd, with the primal also in a
    reverse-mode graph."""
    x, k, t = heads(1), heads(2, h=1), heads(3)
    # CALLS rotate at 1 + s, interleaved; apply_rope_cos_sin's tables: rotate_half at s.
    rope = dict(start=0, interleaved=False) if name == "apply_rope_cos_sin" else dict(start=1)
    want_t, want = ref_rope4(t, **rope), ref_rope4(x, **rope)
    for primal in (x, x.clone().requires_grad_()):
        with fwAD.dual_level():
            out = CALLS[name](fwAD.make_dual(primal, t), k)
            got, got_t = fwAD.unpack_dual(out)
            torch.testing.assert_close(got_t, want_t, **TOL)
            torch.testing.assert_close(got.detach(), want, **TOL)
            if primal.requires_grad:  # reverse mode through the same call
                got.backward(t)
                torch.testing.assert_close(primal.grad, ref_rope4(t, inverse=True, **rope), **TOL)
    got, got_t = torch.func.jvp(lambda a: CALLS[name](a, k), (x,), (t,))
    torch.testing.assert_close(got_t, want_t, **TOL)
    # The Jacobian of one head's S x D outputs: the reference's rotation of each basis vector.
    jac = torch.func.jacfwd(lambda a: CALLS[name](a, k[:, :1]))(x[:, :1]).reshape(S * D, S * D)
    basis = torch.eye(S * D, dtype=torch.float64).reshape(S * D, 1, 1, S, D)
    want_jac = torch.stack([ref_rope4(e, **rope) for e in basis]).reshape(S * D, S * D).T
    torch.testing.assert_close(jac, want_jac, **TOL)


@pytest.mark.parametrize("name", TANGENT_CALLS)
def test_func_reverse_transforms_match_reference(name):
    """torch.func's reverse-mode transforms, which refuse custom Functions:
    under them the rotations record a plain node with the same backward.
    grad, vjp, jacrev, hessian and per-sample gradients (vmap of grad)
    against the float64 reference."""
    x, k, g = heads(1), heads(2, h=1), heads(3)
    rope = dict(start=0, interleaved=False) if name == "apply_rope_cos_sin" else dict(start=1)
    back = ref_rope4(g, inverse=True, **rope)  # the transposed rotation of g
    torch.testing.assert_close(torch.func.grad(lambda a: (CALLS[name](a, k) * g).sum())(x), back, **TOL)
    out, vjp = torch.func.vjp(lambda a: CALLS[name](a, k), x)
    torch.testing.assert_close(out, ref_rope4(x, **rope), **TOL)
    torch.testing.assert_close(vjp(g)[0], back, **TOL)
    jac = torch.func.jacrev(lambda a: CALLS[name](a, k[:, :1]))(x[:, :1]).reshape(S * D, S * D)
    basis = torch.eye(S * D, dtype=torch.float64).reshape(S * D, 1, 1, S, D)
    torch.testing.assert_close(jac, torch.stack([ref_rope4(e, **rope) for e in basis]).reshape(S * D, S * D).T, **TOL)
    # A rotation keeps the norm: the Hessian of |R x|^2 is 2 I.
    hess = torch.func.hessian(lambda a: (CALLS[name](a, k[:, :1]) ** 2).sum())(x[:, :1])
    torch.testing.assert_close(hess.reshape(S * D, S * D), 2 * torch.eye(S * D, dtype=torch.float64), **TOL)
    # d/dx sum(R x * x) = R x + R^T x, per sample of a batch of 3.
    xs = torch.stack([heads(10 + i) for i in range(3)])
    per_sample = torch.func.vmap(torch.func.grad(lambda a: (CALLS[name](a, k) * a).sum()))(xs)
    for a, got in zip(xs, per_sample):
        torch.testing.assert_close(got, ref_rope4(a, **rope) + ref_rope4(a, inverse=True, **rope), **TOL)


def test_ids_changed_in_place_after_the_forward_are_caught():
    """Backward reads the positions the forward read: ids changed in place in
    between are caught, under torch.func (a node) and outside it (a Function)."""
    def f(x, ids):
        out = rotary.apply_rope(x, FREQS, position_ids=ids)
        ids.add_(1)
        return (out * out).sum()

    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        torch.func.grad(f)(heads(1), torch.arange(S)[None].clone())
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        f(heads(1).requires_grad_(), torch.arange(S)[None].clone()).backward()


def test_forward_mode_ad_of_q_or_k_alone():
    """apply_rope_qk with a tangent on one of q and k: the other output's is
    zero."""
    q, k, tq, tk = heads(1), heads(2, h=1), heads(3), heads(4, h=1)
    for dual_q, dual_k in ((True, False), (False, True)):
        with fwAD.dual_level():
            oq, ok = rotary.apply_rope_qk(fwAD.make_dual(q, tq) if dual_q else q,
                                          fwAD.make_dual(k, tk) if dual_k else k, FREQS, 1)
            got_q, got_k = fwAD.unpack_dual(oq).tangent, fwAD.unpack_dual(ok).tangent
            for got, want, dual in ((got_q, tq, dual_q), (got_k, tk, dual_k)):
                if dual:
                    torch.testing.assert_close(got, ref_rope4(want, start=1), **TOL)
                else:
                    assert got is None or not got.any()


def test_inv_freq_that_requires_grad_is_refused():
    """Every position past the 4-row table comes from inv_freq, which would get
    no gradient."""
    inv = rotary.inv_frequencies(D)[0].requires_grad_()
    f, ids = rotary.freqs_table(D, 4), torch.tensor([[10, 20, 30, 40]])
    match = r"inv_freq requires grad, but gradients with respect to the frequencies are not supported"
    for x in (heads(1), heads(1).requires_grad_()):
        with pytest.raises(ValueError, match=match):
            rotary.apply_rope(x, f, position_ids=ids, inv_freq=inv)
    x = heads(1)
    snap = Snapshot(x)
    with pytest.raises(ValueError, match=match):
        rotary.apply_rope_(x, f, position_ids=ids, inv_freq=inv)
    snap.check()
    m = rotary.RotaryEmbedding(D, 4)
    m.inv_freq.requires_grad_()
    with pytest.raises(ValueError, match=match):
        m(heads(1), 10)
    with torch.no_grad():  # no graph: nothing to lose
        assert torch.equal(rotary.apply_rope(x, f, position_ids=ids, inv_freq=inv),
                           rotary.apply_rope(x, f, position_ids=ids, inv_freq=inv.detach()))


@pytest.mark.parametrize("op", ["apply_rope_with_kv_cache_", "apply_qk_norm_rope_with_kv_cache_"])
def test_cache_ops_refuse_v_that_requires_grad(op):
    q, k, v, kc, vc = heads(1), heads(2, h=1), heads(3, h=1).requires_grad_(), cache(4), cache(5)
    snap = Snapshot(q, k, kc, vc)
    with pytest.raises(ValueError, match=rf"{op}: v requires grad; the cache write is not differentiable"):
        getattr(rotary, op)(q, k, v, kc, vc, FREQS)
    snap.check()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_prologue_backward_under_checkpoint(use_reentrant):
    q, k = heads(1).requires_grad_(), heads(2, h=1).requires_grad_()
    w = (torch.rand(D, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.5).requires_grad_()
    g = [heads(8), heads(9, h=1)]

    def body(q, k, w):
        oq, ok = rotary.apply_qk_norm_rope(q, k, FREQS, 3, q_weight=w, k_weight=w, eps=1e-6)
        return (oq * g[0]).sum() + (ok * g[1]).sum()

    checkpoint(body, q, k, w, use_reentrant=use_reentrant).backward()  # reentrant takes no autograd.grad
    got = [t.grad for t in (q, k, w)]
    ref = torch.autograd.grad((ref_norm_rope(q, w, 3) * g[0]).sum() + (ref_norm_rope(k, w, 3) * g[1]).sum(), (q, k, w))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_prologue_under_func_reverse_transforms():
    """The prologue under torch.func.grad, vjp and vmap of grad: q's, k's and
    the weight's gradients against the float64 reference's; a weight changed
    in place after the forward is caught, not read."""
    q, k, g = heads(1), heads(2, h=1), [heads(8), heads(9, h=1)]
    w = torch.rand(D, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.5

    def loss(f, q, k, w):
        oq, ok = f(q, k, w)
        return (oq * g[0]).sum() + (ok * g[1]).sum()

    ours = lambda q, k, w: rotary.apply_qk_norm_rope(q, k, FREQS, 3, q_weight=w, k_weight=w, eps=1e-6)
    ref = lambda q, k, w: (ref_norm_rope(q, w, 3), ref_norm_rope(k, w, 3))
    want = torch.func.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, w)
    got = torch.func.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    _, vjp = torch.func.vjp(ours, q, k, w)
    for a, b in zip(vjp(tuple(g)), want):
        torch.testing.assert_close(a, b, **TOL)
    qs = torch.stack([heads(20 + i) for i in range(3)])
    per_sample = torch.func.vmap(torch.func.grad(lambda q: loss(ours, q, k, w)))(qs)
    for a, got in zip(qs, per_sample):
        torch.testing.assert_close(got, torch.func.grad(lambda q: loss(ref, q, k, w))(a), **TOL)

    def changed_weight(w):
        w = w * 1.0
        oq, _ = ours(q, k, w)
        w.mul_(2)  # after the forward saved it
        return oq.sum()

    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        torch.func.grad(changed_weight)(w)


@pytest.mark.usefixtures("reset_dynamo")
def test_compiled_autograd_matches_reference():
    """A step compiled with compiled autograd (its backward graph traced too):
    q's, k's and the weight's gradients of the prologue and of a rotation after
    it match the float64 reference's."""
    q, k = heads(1).requires_grad_(), heads(2, h=1).requires_grad_()
    w = (torch.rand(D, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.5).requires_grad_()
    g = [heads(8), heads(9, h=1)]

    @torch.compile(backend="eager", fullgraph=False)
    def step(q, k, w):
        oq, ok = rotary.apply_qk_norm_rope(q, k, FREQS, 3, q_weight=w, k_weight=w, eps=1e-6)
        oq, ok = rotary.apply_rope_qk(oq, ok, FREQS, 2, inverse=True)  # back by 2 + s
        loss = (oq * g[0]).sum() + (ok * g[1]).sum()
        loss.backward()

    from torch._dynamo.utils import counters

    counters.clear()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        step(q, k, w)
    assert counters["compiled_autograd"]["captures"] == 1  # the backward went through compiled autograd
    got = [t.grad for t in (q, k, w)]

    def ref(x):  # norm, rotated by 3 + s then back by 2 + s: by 1
        return ref_norm_rope(x, w, 0, positions=torch.ones(S, dtype=torch.float64))

    want = torch.autograd.grad((ref(q) * g[0]).sum() + (ref(k) * g[1]).sum(), (q, k, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fp8_scales_that_require_grad_are_refused():
    """The float8 outputs they scale are not differentiable: a scale that
    requires grad would silently get no gradient."""
    q, k = heads(1, dtype=torch.float32), heads(2, h=1, dtype=torch.float32)
    scale = torch.tensor(0.01, requires_grad=True)
    with pytest.raises(ValueError, match=r"apply_qk_norm_rope: q_fp8_scale requires grad, but the float8 values"):
        rotary.apply_qk_norm_rope(q, k, FREQS, 1, q_fp8_scale=scale)
    v = heads(3, h=1, dtype=torch.float32)
    kc, vc = (torch.zeros(1, 1, 8, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    snap = Snapshot(q, k, kc.view(torch.uint8), vc.view(torch.uint8))
    for op in ("apply_rope_with_kv_cache_", "apply_qk_norm_rope_with_kv_cache_"):
        with pytest.raises(ValueError, match=rf"{op}: k_scale requires grad"):
            getattr(rotary, op)(q, k, v, kc, vc, FREQS, k_scale=scale, v_scale=torch.tensor(0.01))
    snap.check()
    with torch.no_grad():  # no graph: served
        rotary.apply_qk_norm_rope(q, k, FREQS, 1, q_fp8_scale=scale)


def test_negative_rotary_offset_names_the_bound():
    with pytest.raises(ValueError, match=r"apply_rope: rotary_offset must be >= 0, got -2"):
        rotary.apply_rope(heads(1), FREQS, rotary_offset=-2)
