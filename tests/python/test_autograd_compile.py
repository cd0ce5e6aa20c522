"""Gradients (C++ autograd), torch.library.opcheck, torch.compile."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import (
    op_positions,
    PAIRING_IDS,
    PAIRINGS,
    assert_close_ref,
    make_heads,
    make_packed_qkv,
    positions_tensor,
    randn,
)
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES
from rotary_testing.devices import assert_matches_cpu, needs_cuda

L = 24


@pytest.fixture(scope="module")
def freqs():
    return rotary.freqs_table(6, L)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


# ---------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------
def _opcheck_samples():
    f8 = rotary.freqs_table(8, 32)
    s = []
    s.append(("fp32", (make_heads(2, 3, 5, 8, seed=90).requires_grad_(), f8, 2, True), {}))
    s.append(("bf16-half", (make_heads(2, 3, 5, 8, torch.bfloat16, seed=91), f8, 0, False), {}))
    s.append((
        "fp32-positions-batch-inverse-transposed",
        (make_heads(2, 3, 5, 8, layout="transposed", seed=92).requires_grad_(), f8, 1, False),
        {"offsets": torch.tensor([3, 7]), "inverse": True},
    ))
    s.append((
        "bf16-ids-stride2",
        (make_heads(2, 2, 4, 8, torch.bfloat16, "stride2", seed=93).requires_grad_(), f8, 0, True),
        {"position_ids": torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(1))},
    ))
    s.append(("fp32-scalar-pos", (make_heads(1, 2, 3, 8, seed=94), f8), {"offsets": torch.tensor(5)}))
    s.append(("fp32-int32-ids-seq", (make_heads(2, 2, 3, 8, seed=102), f8),
              {"position_ids": torch.tensor([9, 0, 4], dtype=torch.int32)}))
    return s


def _opcheck_qk_samples():
    f8 = rotary.freqs_table(8, 32)
    s = []
    s.append((
        "fp32-gqa",
        (make_heads(2, 4, 5, 8, seed=95).requires_grad_(), make_heads(2, 2, 5, 8, seed=96).requires_grad_(), f8, 3, True),
        {},
    ))
    s.append((
        "bf16-half-inverse",
        (make_heads(2, 2, 5, 8, torch.bfloat16, seed=97), make_heads(2, 1, 5, 8, torch.bfloat16, seed=98), f8, 0, False),
        {"inverse": True},
    ))
    _, q, k, _ = make_packed_qkv(2, 6, 2, 8, seed=99)
    s.append((
        "fp32-packed-qkv-ids",
        (q.detach().requires_grad_(), k.detach().requires_grad_(), f8, 0, False),
        {"position_ids": torch.randint(0, 25, (2, 6), generator=torch.Generator().manual_seed(2))},
    ))
    s.append((
        "bf16-batch-positions",
        (make_heads(2, 3, 4, 8, torch.bfloat16, "transposed", seed=100).requires_grad_(),
         make_heads(2, 3, 4, 8, torch.bfloat16, seed=101).requires_grad_(), f8, 1, True),
        {"offsets": torch.tensor([0, 9])},
    ))
    return s


_ROPE_SAMPLES = _opcheck_samples()
_QK_SAMPLES = _opcheck_qk_samples()


@pytest.mark.parametrize("args,kwargs", [s[1:] for s in _ROPE_SAMPLES], ids=[s[0] for s in _ROPE_SAMPLES])
def test_opcheck_apply_rope(args, kwargs):
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, args, kwargs)


@pytest.mark.parametrize("args,kwargs", [s[1:] for s in _QK_SAMPLES], ids=[s[0] for s in _QK_SAMPLES])
def test_opcheck_apply_rope_qk(args, kwargs):
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk.default, args, kwargs)


def test_fake_tensor_shapes_and_strides():
    """The Meta kernel agrees with the CPU kernel on shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = rotary.freqs_table(8, 32)
    x = make_heads(2, 3, 5, 8, torch.bfloat16, "transposed", seed=102)
    k = make_heads(2, 1, 5, 8, torch.bfloat16, "stride2", seed=103)
    real = rotary.apply_rope_qk(x, k, f, 3)
    with FakeTensorMode() as mode:
        fx, fk, ff = mode.from_tensor(x), mode.from_tensor(k), mode.from_tensor(f)
        fake = rotary.apply_rope_qk(fx, fk, ff, 3)
        with pytest.raises(ValueError, match="head_dim"):
            rotary.apply_rope(mode.from_tensor(randn((1, 1, 2, 7))), ff)
    for r, fa in zip(real, fake):
        assert fa.shape == r.shape and fa.dtype == r.dtype and fa.stride() == r.stride()


# ---------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------
def _attention_fn(q, k, v, freqs, start_pos, interleaved, positions=None):
    q, k = rotary.apply_rope_qk(q, k, freqs, interleaved=interleaved, **op_positions(start_pos, positions))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    one = rotary.apply_rope(v, freqs, interleaved=interleaved, inverse=True, **op_positions(start_pos, positions))
    return torch.softmax(scores, dim=-1) @ v + one


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("kind", ["none", "ids"])
def test_compile_function_aot_eager(interleaved, kind):
    f = rotary.freqs_table(16, 64)
    pos = positions_tensor(kind, 2, 6, room=60, seed=104)
    q = make_heads(2, 4, 6, 16, layout="transposed", seed=105).requires_grad_()
    k = make_heads(2, 2, 6, 16, seed=106).requires_grad_()
    v = make_heads(2, 4, 6, 16, seed=107)
    compiled = torch.compile(_attention_fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, f, 3, interleaved, pos)
    ref = _attention_fn(q, k, v, f, 3, interleaved, pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), (q, k))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _TinyAttention(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, max_seq_len=64, interleaved=True):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.rope = rotary.RotaryEmbedding(self.hd, max_seq_len, interleaved=interleaved)

    def forward(self, x, start_pos: int = 0):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, S, self.kvh, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, S, self.kvh, self.hd).transpose(1, 2)
        q, k = self.rope(q, k, start_pos=start_pos)
        single = self.rope(q, start_pos=start_pos)
        out = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, S, -1) + single.transpose(1, 2).reshape(B, S, -1)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_compile_module_aot_eager(interleaved):
    torch.manual_seed(0)
    model = _TinyAttention(interleaved=interleaved)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = randn((2, 7, 32), seed=108)
    out = compiled(x, start_pos=5)
    ref = model(x, start_pos=5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    g_compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref.sum().backward()
    for a, p in zip(g_compiled, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-5)


def test_compile_module_after_half_cast():
    model = _TinyAttention().to(torch.bfloat16)
    assert model.rope.freqs.dtype == torch.complex64
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = randn((1, 5, 32), torch.bfloat16, seed=109)
    torch.testing.assert_close(compiled(x, start_pos=2), model(x, start_pos=2))


def test_compile_dynamic_start_pos_and_seq_len():
    """dynamic=True: new start_pos / seq_len values neither break nor recompile."""
    f = rotary.freqs_table(16, 64)
    cnt = CompileCounterWithBackend("aot_eager")

    def fn(q, k, freqs, start_pos):
        a, b = rotary.apply_rope_qk(q, k, freqs, start_pos, False)
        c = rotary.apply_rope(b, freqs, start_pos, False, inverse=True)
        return a * 2, b, c

    compiled = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=True)
    for i, (start, S) in enumerate([(0, 5), (3, 5), (9, 8), (40, 24), (2, 3), (61, 3)]):
        q = make_heads(2, 4, S, 16, seed=110 + i)
        k = make_heads(2, 1, S, 16, seed=120 + i)
        a, b, c = compiled(q, k, f, start)
        assert_close_ref(a / 2, rope_reference(q, start, False), torch.float32)
        assert_close_ref(b, rope_reference(k, start, False), torch.float32)
        torch.testing.assert_close(c, k, rtol=1e-5, atol=1e-5)
        for got, want in zip((a, b, c), fn(q, k, f, start)):
            assert torch.equal(got, want)
    assert cnt.frame_count == 1, f"recompiled {cnt.frame_count} times"


def test_compile_dynamic_module_and_decode_loop():
    model = rotary.RotaryEmbedding(16, 64, interleaved=True)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=True)
    for start, S in [(0, 6), (6, 4), (10, 9), (19, 2)]:
        x = make_heads(1, 2, S, 16, seed=130 + start)
        torch.testing.assert_close(compiled(x, start_pos=start), model(x, start_pos=start), rtol=0, atol=0)
    assert cnt.frame_count == 1
    # Decode steps (S == 1 may specialise once more, but must stay correct).
    for start in range(20, 26):
        x = make_heads(1, 2, 1, 16, seed=140 + start)
        assert_close_ref(compiled(x, start_pos=start), rope_reference(x, start, True), torch.float32)
    assert cnt.frame_count <= 2


def test_compile_dynamic_positions_tensor():
    f = rotary.freqs_table(16, 64)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda x, p: rotary.apply_rope(x, f, interleaved=True, **op_positions(0, p)), backend=cnt, fullgraph=True, dynamic=True
    )
    for i, S in enumerate([4, 7, 12]):
        x = make_heads(2, 2, S, 16, seed=150 + i)
        p = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(i))
        assert_close_ref(compiled(x, p), rope_reference(x, 0, True, p), torch.float32)
    assert cnt.frame_count == 1


def test_compile_range_error_at_runtime():
    """Out-of-table start_pos is still caught when the op runs compiled."""
    f = rotary.freqs_table(16, 16)
    compiled = torch.compile(lambda x, s: rotary.apply_rope(x, f, s), backend="aot_eager", fullgraph=True, dynamic=True)
    x = make_heads(1, 1, 4, 16, seed=160)
    compiled(x, 3)
    with pytest.raises(IndexError, match="start_pos"):
        compiled(x, 14)


def test_compile_inductor():
    """One inductor case (slow to build on 2 cores): the op as an extern
    kernel between fused pointwise ops, forward and backward."""
    f = rotary.freqs_table(16, 64)

    def fn(q, k):
        q2, k2 = rotary.apply_rope_qk(q * 1.5, k + 1.0, f, interleaved=False, **op_positions(4, torch.tensor([0, 7])))
        return (q2.sum(1, keepdim=True) * k2).relu()

    q = make_heads(2, 2, 6, 16, layout="transposed", seed=161).requires_grad_()
    k = make_heads(2, 1, 6, 16, seed=162).requires_grad_()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    out = compiled(q, k)
    ref = fn(q, k)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.sum(), (q, k))
    g_ref = torch.autograd.grad(ref.sum(), (q, k))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_export():
    model = _TinyAttention()
    x = randn((2, 5, 32), seed=163)
    ep = torch.export.export(model, (x,), {"start_pos": 3})
    assert any("rotary" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x, start_pos=3), model(x, start_pos=3))


@pytest.mark.parametrize("strict", [False, True])
def test_export_serves_positions_past_the_table(strict):
    """A dynamic seq_len or start_pos exports unbounded by max_seq_len (the
    module's eager fast path once became a guard in a strict trace)."""
    from torch.export import Dim

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = rotary.RotaryEmbedding(16, 64)

        def forward(self, q, k, start_pos):
            return self.rope(q, k, start_pos=start_pos)

    q, k = randn((1, 4, 8, 16), seed=170), randn((1, 2, 8, 16), seed=171)
    seq = Dim("seq", min=1, max=1024)
    ep = torch.export.export(Rope(), (q, k, 5), dynamic_shapes=({2: seq}, {2: seq}, Dim.DYNAMIC), strict=strict)
    for s, start in ((100, 0), (1, 64), (3, 500)):
        q, k = randn((1, 4, s, 16), seed=172), randn((1, 2, s, 16), seed=173)
        oq, ok = ep.module()(q, k, start)
        assert_close_ref(oq, rope_reference(q, start), torch.float32)
        assert_close_ref(ok, rope_reference(k, start), torch.float32)


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


def _opcheck_samples(device):
    f = rotary.freqs_table(64, 64).to(device)
    return [
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, seed=250, device=device).requires_grad_(), f, 2, True), {}),
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, torch.bfloat16, "transposed", seed=251, device=device), f, 0, False),
         {"offsets": torch.tensor([1, 30], device=device), "inverse": True}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 4, 5, 64, seed=252, device=device).requires_grad_(),
          make_heads(2, 2, 5, 64, seed=253, device=device, layout="stride2").requires_grad_(), f, 0, False),
         {"position_ids": torch.randint(3, 53, (2, 5), generator=torch.Generator().manual_seed(3)).to(device)}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 2, 5, 64, torch.bfloat16, seed=254, device=device),
          make_heads(2, 2, 5, 64, torch.bfloat16, seed=255, device=device), f, 1, True), {}),
    ]


@pytest.mark.parametrize("i", range(4))
def test_opcheck(device, i):
    op, args, kwargs = _opcheck_samples(device)[i]
    torch.library.opcheck(op, args, kwargs)


# On the CPU, inductor is test_compile_inductor (slow to build on 2 cores).
@pytest.mark.parametrize("device,backend", [
    ("cpu", "aot_eager"),
    pytest.param("cuda", "aot_eager", marks=needs_cuda),
    pytest.param("cuda", "inductor", marks=needs_cuda),
])
def test_compile(device, backend):
    torch._dynamo.reset()
    f = rotary.freqs_table(64, 128).to(device)

    def fn(q, k, pos):
        q2, k2 = rotary.apply_rope_qk(q * 0.5, k, f, interleaved=False, **op_positions(3, pos))
        return torch.softmax(q2 @ k2.transpose(-1, -2), dim=-1)

    q = make_heads(2, 4, 16, 64, layout="transposed", seed=260, device=device).requires_grad_()
    k = make_heads(2, 4, 16, 64, seed=261, device=device).requires_grad_()
    pos = torch.tensor([0, 40], device=device)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    out, ref = compiled(q, k, pos), fn(q, k, pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), (q, k))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
