"""Gradients (fp64 gradcheck / gradgradcheck, and the gradient as the
inverse rotation) through varlen, partial rotary, layouts, positions and
inv_freq."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import (
    op_positions,
    assert_close_ref,
    randn,
    _inv,
    ref_rope4,
    ref_varlen,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


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


def _op_kwargs(c, kw):
    """kw with its reference-convention positions as the op's arguments."""
    kw = dict(kw)
    positions = kw.pop("positions")
    return {**kw, **op_positions(c.get("start", 1), positions, packed="cu" in c)}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradcheck_variants(name):
    c = GRAD_CASES[name]
    f = rotary.freqs_table(c["r"], 12)
    kw = _grad_kwargs(c)
    start = c.get("start", 1)
    x = randn(c["shape"], torch.float64, seed=80).requires_grad_()
    k_shape = list(c["shape"])
    k_shape[-2 if kw["layout"] != "BHSD" or "cu" in c else 1] = 1  # one k head
    k = randn(k_shape, torch.float64, seed=81).requires_grad_()

    op_kw = _op_kwargs(c, kw)

    def one(x):
        return rotary.apply_rope(x, f, interleaved=c["interleaved"], **op_kw)

    def both(q, k):
        return rotary.apply_rope_qk(q, k, f, interleaved=c["interleaved"], **op_kw)

    assert torch.autograd.gradcheck(one, (x,))
    assert torch.autograd.gradgradcheck(one, (x,))
    assert torch.autograd.gradcheck(both, (x, k))
    assert torch.autograd.gradgradcheck(both, (x, k))


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_grad_is_inverse_rotation_variants(name):
    c = GRAD_CASES[name]
    f = rotary.freqs_table(c["r"], 12)
    kw = _grad_kwargs(c)
    start = c.get("start", 1)
    x = randn(c["shape"], torch.float32, seed=82).requires_grad_()
    w = randn(c["shape"], torch.float32, seed=83)
    (rotary.apply_rope(x, f, interleaved=c["interleaved"], **_op_kwargs(c, kw)) * w).sum().backward()
    inv = not kw["inverse"]
    if "cu" in c:
        ref = ref_varlen(w, kw["cu_seqlens"], c["r"], start, c["interleaved"], kw["positions"], inv)
    else:
        ref = ref_rope4(w, c["r"], start, c["interleaved"], kw["positions"], inv, kw["layout"])
    assert_close_ref(x.grad, ref, torch.float32)
    assert torch.equal(x.grad[..., c["r"] :], w[..., c["r"] :])  # pass-through dims: identity
