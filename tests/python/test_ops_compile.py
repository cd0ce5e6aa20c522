"""torch.compile (aot_eager, inductor, dynamic shapes) and torch.export of
apply_rope / apply_rope_qk and the module, forward and backward, against
eager and the float64 reference. (Split from the old
test_autograd_compile.py by concern: gradients are in test_ops_gradients.py,
opcheck in test_ops_registration.py.)"""

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
    positions_tensor,
    randn,
)
from rotary_testing.devices import needs_cuda


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


def test_a_host_driven_module_breaks_the_graph_once():
    """A dynamic rule rebuilds its tables on the host: one graph break at
    that call, and the code around it still compiled (a refusal raised
    while traced made Dynamo drop the whole calling frame)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.rope = rotary.RotaryEmbedding(8, 16, scaling={"rope_type": "dynamic", "factor": 2.0})

        def forward(self, x):
            return torch.tanh(self.b(self.rope(torch.relu(self.a(x)), 20)))

    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    block, x = Block(), make_heads(1, 1, 4, 8, seed=150)
    eager = Block()
    eager.load_state_dict(block.state_dict())
    compiled = torch.compile(block, backend=backend)
    for s in (4, 1):  # reach 24 grows the rule, and the grown tables stay for reach 21 (as transformers keeps them)
        x = make_heads(1, 1, s, 8, seed=150 + s)
        torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)
        assert block.rope.rope_state == eager.rope.rope_state == 24
    ops = set().union(*graphs)
    assert any("relu" in op for op in ops) and any("tanh" in op for op in ops), graphs


@pytest.mark.parametrize("rule", ["dynamic", "longrope"])
@pytest.mark.parametrize("form", ["position_ids", "offsets"])
def test_a_host_driven_module_compiles_with_position_tensors(rule, form):
    """The export-only refusal (position tensors cannot be traced) fired
    under plain torch.compile too, where is_exporting() is true while Dynamo
    traces: the call breaks the graph and rotates as eagerly."""
    scaling = {"dynamic": {"rope_type": "dynamic", "factor": 2.0},
               "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 8,
                            "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}}[rule]
    rope, eager = (rotary.RotaryEmbedding(8, 16, scaling=scaling) for _ in range(2))
    compiled = torch.compile(lambda x, p: rope(x, **{form: p}))
    for s, at in ((3, 20), (1, 9)):
        x = make_heads(1, 2, s, 8, seed=170 + s)
        p = torch.arange(s)[None] + at if form == "position_ids" else torch.tensor([at])
        torch.testing.assert_close(compiled(x, p), eager(x, **{form: p}), rtol=0, atol=0)
        assert rope.rope_state == eager.rope_state


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
