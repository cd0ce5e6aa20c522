"""Gradients of apply_rope / apply_rope_qk (C++ autograd): gradcheck and
gradgradcheck in float64, the gradient as the inverse rotation against the
float64 reference, one output or one input only, no_grad / inference mode,
saved positions changed in place; on every device, against the CPU. (Split
from the old test_autograd_compile.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import (
    op_positions,
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    assert_close_ref,
    make_heads,
    positions_tensor,
    randn,
)
from rotary_testing.devices import assert_matches_cpu
from test_ops_compile import _reset_dynamo  # noqa: F401  (autouse: dynamo reset around every test)


L = 24


@pytest.fixture(scope="module")
def freqs():
    return rotary.freqs_table(6, L)


def _leaf(B, H, S, D, layout, seed, dtype=torch.float64):
    return make_heads(B, H, S, D, dtype, layout, seed=seed).requires_grad_()


# ---------------------------------------------------------------------------
# gradcheck / gradgradcheck (fp64)
# ---------------------------------------------------------------------------
GRAD_CASES = [
    # (interleaved, positions kind, inverse, layout, start_pos)
    (True, "none", False, "contiguous", 0),
    (False, "none", False, "contiguous", 5),
    (True, "batch", False, "transposed", 2),
    (False, "ids", False, "stride2", 1),
    (True, "scalar", True, "qkv_slice", 3),
    (False, "ids_noncontig", True, "transposed", 0),
]
GRAD_IDS = [f"{'inter' if c[0] else 'half'}-{c[1]}-{'inv' if c[2] else 'fwd'}-{c[3]}" for c in GRAD_CASES]


@pytest.mark.parametrize("interleaved,kind,inverse,layout,start", GRAD_CASES, ids=GRAD_IDS)
def test_gradcheck_apply_rope(freqs, interleaved, kind, inverse, layout, start):
    B, S = 2, 3
    pos = positions_tensor(kind, B, S, room=L - start, seed=70)
    x = _leaf(B, 2, S, 6, layout, 71)

    def fn(x):
        return rotary.apply_rope(x, freqs, interleaved=interleaved, inverse=inverse, **op_positions(start, pos))

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("interleaved,kind,inverse,layout,start", GRAD_CASES, ids=GRAD_IDS)
def test_gradcheck_apply_rope_qk(freqs, interleaved, kind, inverse, layout, start):
    B, S = 2, 3
    pos = positions_tensor(kind, B, S, room=L - start, seed=72)
    q = _leaf(B, 3, S, 6, layout, 73)  # Hq = 3
    k = _leaf(B, 1, S, 6, "contiguous", 74)  # Hk = 1

    def fn(q, k):
        return rotary.apply_rope_qk(q, k, freqs, interleaved=interleaved, inverse=inverse, **op_positions(start, pos))

    assert torch.autograd.gradcheck(fn, (q, k))
    assert torch.autograd.gradgradcheck(fn, (q, k))


def test_gradcheck_conj_table(freqs):
    x = _leaf(2, 2, 3, 6, "contiguous", 75)
    assert torch.autograd.gradcheck(lambda x: rotary.apply_rope(x, freqs.conj(), 4), (x,))
    assert torch.autograd.gradgradcheck(lambda x: rotary.apply_rope(x, freqs.conj(), 4), (x,))


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_grad_is_inverse_rotation(freqs, interleaved, dtype):
    """d(sum(w * rope(x)))/dx = rope^-1(w), against the float64 reference."""
    x = _leaf(2, 3, 4, 6, "transposed", 76, dtype)
    w = randn((2, 3, 4, 6), dtype, seed=77)
    (rotary.apply_rope(x, freqs, 7, interleaved) * w).sum().backward()
    assert_close_ref(x.grad, rope_reference(w, 7, interleaved, inverse=True), dtype)


def test_grad_of_sum_expanded_grad_output(freqs):
    """out.sum() hands the backward a stride-0 (expanded) gradient."""
    x = _leaf(2, 3, 4, 6, "contiguous", 78, torch.float32)
    rotary.apply_rope(x, freqs, 2, False).sum().backward()
    ones = torch.ones(2, 3, 4, 6)
    assert_close_ref(x.grad, rope_reference(ones, 2, False, inverse=True), torch.float32)


@pytest.mark.parametrize("which", ["q", "k"])
def test_grad_through_one_of_q_k(freqs, which):
    q = make_heads(2, 3, 4, 6, torch.float32, seed=79)
    k = make_heads(2, 1, 4, 6, torch.float32, seed=80)
    target = q if which == "q" else k
    target.requires_grad_()
    wq = randn(q.shape, seed=81)
    wk = randn(k.shape, seed=82)
    oq, ok = rotary.apply_rope_qk(q, k, freqs, 3, True)
    ((oq * wq).sum() + (ok * wk).sum()).backward()
    other = k if which == "q" else q
    assert other.grad is None
    w = wq if which == "q" else wk
    assert_close_ref(target.grad, rope_reference(w, 3, True, inverse=True), torch.float32)


def test_grad_uses_only_one_output(freqs):
    q = make_heads(2, 3, 4, 6, torch.float32, seed=83).requires_grad_()
    k = make_heads(2, 1, 4, 6, torch.float32, seed=84).requires_grad_()
    wk = randn(k.shape, seed=85)
    oq, ok = rotary.apply_rope_qk(q, k, freqs, interleaved=False, **op_positions(3, torch.tensor([1, 4])))
    (ok * wk).sum().backward()
    assert q.grad is None or not q.grad.any()
    assert_close_ref(k.grad, rope_reference(wk, 3, False, torch.tensor([1, 4]), inverse=True), torch.float32)


def test_module_backward():
    m = rotary.RotaryEmbedding(6, L, interleaved=False)
    x = _leaf(2, 2, 5, 6, "transposed", 86, torch.float32)
    w = randn(x.shape, seed=87)
    (m(x, start_pos=4) * w).sum().backward()
    assert_close_ref(x.grad, rope_reference(w, 4, False, inverse=True), torch.float32)
    assert not m.freqs.requires_grad


def test_no_grad_mode(freqs):
    x = _leaf(2, 2, 3, 6, "contiguous", 88)
    with torch.no_grad():
        out = rotary.apply_rope(x, freqs, 1)
    assert not out.requires_grad
    out = rotary.apply_rope(x, freqs, 1)
    assert out.requires_grad and out.grad_fn is not None


def test_inference_mode(freqs):
    x = make_heads(2, 2, 3, 6, torch.float32, seed=89)
    with torch.inference_mode():
        out = rotary.apply_rope(x, freqs, interleaved=False, **op_positions(1, torch.tensor(2)))
    assert out.is_inference()
    assert_close_ref(out, rope_reference(x, 1, False, torch.tensor(2)), torch.float32)


def test_saved_positions_modified_in_place_is_detected(freqs):
    """backward must not silently use positions changed after forward."""
    x = _leaf(2, 2, 3, 6, "contiguous", 89, torch.float32)
    pos = torch.tensor([1, 2])
    out = rotary.apply_rope(x, freqs, **op_positions(0, pos))
    pos.add_(5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_gradcheck(device, interleaved):
    f = rotary.freqs_table(6, 24).to(device)
    q = make_heads(2, 3, 4, 6, torch.float64, "transposed", seed=240, device=device).requires_grad_()
    k = make_heads(2, 1, 4, 6, torch.float64, seed=241, device=device).requires_grad_()
    pos = torch.tensor([2, 9], device=device)
    fn1 = lambda q: rotary.apply_rope(q, f, interleaved=interleaved, **op_positions(3, pos))  # noqa: E731
    fn2 = lambda q, k: rotary.apply_rope_qk(q, k, f, 1, interleaved)  # noqa: E731
    assert torch.autograd.gradcheck(fn1, (q,))
    assert torch.autograd.gradgradcheck(fn1, (q,))
    assert torch.autograd.gradcheck(fn2, (q, k))
    assert torch.autograd.gradgradcheck(fn2, (q, k))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_matches_cpu(device, dtype):
    f = rotary.freqs_table(64, 64)
    q_cpu = make_heads(2, 4, 9, 64, dtype, "transposed", seed=242).requires_grad_()
    k_cpu = make_heads(2, 2, 9, 64, dtype, seed=243)  # no grad through k
    w = randn((2, 4, 9, 64), dtype, seed=244)
    q_dev = q_cpu.detach().to(device).requires_grad_()
    k_dev = k_cpu.to(device)
    for q, k, fr, ww in ((q_cpu, k_cpu, f, w), (q_dev, k_dev, f.to(device), w.to(device))):
        oq, ok = rotary.apply_rope_qk(q, k, fr, 11, False)
        ((oq * ww).sum() + ok.sum()).backward()
    assert k_dev.grad is None
    assert_close_ref(q_dev.grad, rope_reference(w, 11, False, inverse=True), dtype)
    assert_matches_cpu(q_dev.grad, q_cpu.grad, dtype)
