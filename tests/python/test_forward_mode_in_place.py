"""Forward-mode AD of the in-place ops: apply_rope_, apply_rope_qk_ and
apply_qk_norm_rope_ rotate (normalize) the tangent with the primal, the new
tangent computed before the primal is written, so a refused call leaves
both. Against the float64 reference, by forward_ad, jvp and jacfwd."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import rotary
from rotary_testing.prologue_reference import ref_norm_rope
from rotary_testing.rope_testing import randn, ref_rope4

D, S = 8, 4
FREQS = rotary.freqs_table(D, 16)
TOL = dict(rtol=1e-6, atol=1e-6)


def heads(seed, h=2, dtype=torch.float64):
    return randn((1, h, S, D), dtype, seed=seed)


def test_forward_mode_ad_in_place():
    """apply_rope_ and apply_rope_qk_ rotate the tangent with the primal: x
    alone, q and k as views of one packed qkv whose tangent they view (v's
    part stays), and through torch.func.jvp and jacfwd of a function that
    writes a copy in place. A refused call leaves primal and tangent as they
    were."""
    x, t = heads(1), heads(3)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.clone(), t.clone())
        rotary.apply_rope_(dual, FREQS, 1)
        got, got_t = fwAD.unpack_dual(dual)
        torch.testing.assert_close(got, ref_rope4(x, start=1), **TOL)
        torch.testing.assert_close(got_t, ref_rope4(t, start=1), **TOL)
    qkv, tqkv = randn((1, S, 4, D), torch.float64, seed=9), randn((1, S, 4, D), torch.float64, seed=10)
    with fwAD.dual_level():
        dual = fwAD.make_dual(qkv.clone(), tqkv.clone())
        rotary.apply_rope_qk_(dual[:, :, :2], dual[:, :, 2:3], FREQS, 1, layout="BSHD")
        got, got_t = fwAD.unpack_dual(dual)
        for have, want in ((got, qkv), (got_t, tqkv)):
            torch.testing.assert_close(have[:, :, :3], ref_rope4(want[:, :, :3], start=1, layout="BSHD"), **TOL)
            assert torch.equal(have[:, :, 3:], want[:, :, 3:])
    _, jt = torch.func.jvp(lambda a: rotary.apply_rope_(a.clone(), FREQS, 1), (x,), (t,))
    torch.testing.assert_close(jt, ref_rope4(t, start=1), **TOL)
    jac = torch.func.jacfwd(lambda a: rotary.apply_rope_qk_(a.clone(), a[:, :1].clone(), FREQS, 1)[0])(x[:, :1])
    basis = torch.eye(S * D, dtype=torch.float64).reshape(S * D, 1, 1, S, D)
    want_jac = torch.stack([ref_rope4(e, start=1) for e in basis]).reshape(S * D, S * D).T
    torch.testing.assert_close(jac.reshape(S * D, S * D), want_jac, **TOL)
    far = torch.tensor([[0, 1, 2, 99]])  # past the 16-row table
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.clone(), t.clone())
        with pytest.raises(IndexError, match=r"^apply_rope_: token \(batch 0, seq 3\) has position 99"):
            rotary.apply_rope_(dual, FREQS, position_ids=far)
        got, got_t = fwAD.unpack_dual(dual)
        assert torch.equal(got, x) and torch.equal(got_t, t)


def test_prologue_forward_mode_in_place():
    """apply_qk_norm_rope_ with tangents on q, k and the weight: q's and k's
    tangents become the jvp of the float64 reference, the primals its
    outputs; with the norm over every head too. A refused call (a position
    past the table) leaves primals and tangents, and names the op."""
    q, k, w = heads(1), heads(2, h=1), torch.rand(D, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) + 0.5
    tq, tk, tw = heads(3), heads(4, h=1), torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    want_out, want_t = torch.func.jvp(lambda q, k, w: (ref_norm_rope(q, w, 3), ref_norm_rope(k, w, 3)),
                                      (q, k, w), (tq, tk, tw))
    with fwAD.dual_level():
        dq, dk = fwAD.make_dual(q.clone(), tq.clone()), fwAD.make_dual(k.clone(), tk.clone())
        rotary.apply_qk_norm_rope_(dq, dk, FREQS, 3, q_weight=fwAD.make_dual(w, tw), k_weight=fwAD.make_dual(w, tw))
        for dual, out, t in zip((dq, dk), want_out, want_t):
            got, got_t = fwAD.unpack_dual(dual)
            torch.testing.assert_close(got, out, **TOL)
            torch.testing.assert_close(got_t, t, **TOL)
    wh = w.repeat(2)
    _, got_h = torch.func.jvp(
        lambda q: rotary.apply_qk_norm_rope_(q.clone(), k.clone(), FREQS, 3, q_weight=wh, norm="heads")[0], (q,), (tq,))
    _, want_h = torch.func.jvp(lambda q: ref_norm_rope(q, wh, 3, heads=True), (q,), (tq,))
    torch.testing.assert_close(got_h, want_h, **TOL)
    with fwAD.dual_level():
        dq, dk = fwAD.make_dual(q.clone(), tq.clone()), fwAD.make_dual(k.clone(), tk.clone())
        with pytest.raises(IndexError, match=r"^apply_qk_norm_rope_: token \(batch 0, seq 3\) has position 99"):
            rotary.apply_qk_norm_rope_(dq, dk, FREQS, position_ids=torch.tensor([[0, 1, 2, 99]]))
        for dual, x, t in ((dq, q, tq), (dk, k, tk)):
            got, got_t = fwAD.unpack_dual(dual)
            assert torch.equal(got, x) and torch.equal(got_t, t)
