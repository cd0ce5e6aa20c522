"""torch.library.opcheck of the four ops with varlen, positions, partial
rotary, layouts and inv_freq."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import (
    gen,
    randn,
    _inv,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------
def _opcheck_samples():
    f8, f4 = rotary.freqs_table(8, 32), rotary.freqs_table(4, 32)
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    T = 7
    ids = torch.randint(0, 30, (T,), generator=gen(12))
    def g(shape, seed, dtype=torch.float32):  # a leaf that requires grad
        return randn(shape, dtype, seed=seed).requires_grad_()

    one = [
        ("varlen", lambda: (g((T, 2, 8), 90), f8, 1, True), dict(cu_seqlens=cu)),
        ("varlen-ids-bf16", lambda: (randn((T, 2, 8), torch.bfloat16, seed=91), f8, 0, False),
         dict(cu_seqlens=cu.long(), position_ids=ids)),
        ("ids-int32-seq", lambda: (g((2, 2, 3, 8), 102), f8, 0, True),
         dict(position_ids=torch.tensor([4, 0, 7], dtype=torch.int32))),
        ("offsets-int16", lambda: (g((2, 2, 3, 8), 103), f8, 2, False), dict(offsets=torch.tensor([1, 3], dtype=torch.int16))),
        ("partial", lambda: (g((2, 2, 3, 8), 92), f4, 2, False), {}),
        ("bshd", lambda: (g((2, 3, 2, 8), 93), f8, 0, True), dict(layout="BSHD", offsets=torch.tensor([1, 5]))),
        ("sbhd-partial-inverse", lambda: (randn((3, 2, 2, 8), seed=94), f4, 1, True), dict(layout="SBHD", inverse=True)),
        ("inv-freq", lambda: (randn((1, 2, 3, 8), seed=95), f8, 1000, True), dict(inv_freq=_inv(8))),
    ]
    two = [
        ("varlen", lambda: (g((T, 2, 8), 96), g((T, 1, 8), 97), f8, 1, True), dict(cu_seqlens=cu)),
        ("varlen-seq-offsets", lambda: (g((T, 2, 8), 106), g((T, 1, 8), 107), f8, 1, True),
         dict(cu_seqlens=cu, offsets=torch.tensor([3, 0, 20], dtype=torch.int32))),
        ("partial-bshd", lambda: (g((2, 3, 4, 8), 98), randn((2, 3, 2, 8), seed=99), f4, 0, False), dict(layout="BSHD")),
        ("sbhd-ids", lambda: (randn((3, 2, 2, 8), seed=100), randn((3, 2, 1, 8), seed=101), f8, 0, True),
         dict(layout="SBHD", position_ids=torch.tensor([[0, 9, 3], [2, 2, 2]]))),
        ("ids-int32", lambda: (g((2, 2, 3, 8), 104), g((2, 1, 3, 8), 105), f8, 0, False),
         dict(position_ids=torch.tensor([[5, 1, 2], [0, 0, 9]], dtype=torch.int32))),
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
