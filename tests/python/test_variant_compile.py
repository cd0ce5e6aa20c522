"""torch.compile(fullgraph=True, backend="aot_eager") of the in-place ops on
packed qkv / varlen / partial inputs, and varlen forward + backward."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import (
    op_positions,
    assert_close_ref,
    gen,
    randn,
    VARLEN_LENS,
    cu_from_lens,
    ref_rope4,
)

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# torch.compile(fullgraph=True, backend="aot_eager")
# ---------------------------------------------------------------------------
def test_compile_inplace_qk_on_packed_qkv(tables):
    B, S, H, D = 2, 5, 2, 16
    f = tables(D)

    def fn(qkv, pos):
        q, k, v = qkv.split(H, dim=2)
        rotary.apply_rope_qk_(q, k, f, interleaved=False, layout="BSHD", **op_positions(1, pos))
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
        q2, k2 = rotary.apply_rope_qk(q, k, f, interleaved=False, cu_seqlens=cu, **op_positions(0, ids, packed=True))
        starts = torch.arange(len(VARLEN_LENS)) * 2  # one per sequence
        return ((q2 * k2).sum(-1).relu() + rotary.apply_rope(q, f, 3, cu_seqlens=cu, inverse=True).sum(-1)
                + rotary.apply_rope(k, f, 1, cu_seqlens=cu, offsets=starts).sum(-1))

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q = randn((T, 2, D), seed=114).requires_grad_()
    k = randn((T, 2, D), seed=115).requires_grad_()
    out, ref = compiled(q, k), fn(q, k)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k)), torch.autograd.grad(ref.sum(), (q, k))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
