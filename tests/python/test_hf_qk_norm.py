"""The patched route of the Hugging Face families that normalize q and k:
their q_norm / k_norm run inside the rotation (rotary.apply_qk_norm_rope).
Logits and gradients against the unpatched model; refusals where the model
does not fit."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from rotary_testing import hf_sweep  # noqa: E402

import rotary  # noqa: E402
from rotary.integrations import _positions, _qk_norm, hf_support  # noqa: E402
from rotary.integrations import transformers as rt  # noqa: E402

FAMILIES = [("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
            ("gemma3_text", "Gemma3ForCausalLM"), ("olmo2", "Olmo2ForCausalLM")]


def _randomize_norms(model, g):
    with torch.no_grad():
        for m in model.modules():
            for name in ("q_norm", "k_norm"):
                norm = getattr(m, name, None)
                if norm is not None:
                    norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))


@pytest.mark.parametrize("model_type, cls_name", FAMILIES)
def test_fused_route_matches_unpatched(model_type, cls_name, monkeypatch):
    assert model_type in hf_support.QK_NORM_FUSED
    g = torch.Generator().manual_seed(0)
    model = hf_sweep.tiny_model(model_type, cls_name)
    _randomize_norms(model, g)  # the init weights (0 or 1) would hide a wrong offset
    ids = torch.randint(3, hf_sweep.VOCAB, (2, 9), generator=g)
    pos = torch.arange(9).expand(2, 9) + torch.tensor([[30], [4]])

    def run():
        model.zero_grad()
        out = model(input_ids=ids, position_ids=pos).logits
        out.pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n or "q_proj" in n}
        return out.detach(), grads

    ref_logits, ref_grads = run()
    calls = []
    fused = rotary.apply_qk_norm_rope
    monkeypatch.setattr(_positions, "_apply_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    with rt.rotary_patched(model):  # fuse_qk_norm's default: the sweep's verified families
        assert rt.is_patched(model) and model._rotary_integration_state.norms
        logits, grads = run()
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(logits, ref_logits, rtol=2e-5, atol=2e-5)
    assert grads.keys() == ref_grads.keys() and any("q_norm" in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    # Unpatched: the norms run their own forward again.
    assert not any("forward" in m.__dict__ for m in model.modules() if m.__class__.__name__.endswith("RMSNorm"))


def test_fuse_can_be_turned_off(monkeypatch):
    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM")
    calls = []
    monkeypatch.setattr(_positions, "_apply_fused", lambda *a, **k: calls.append(1))
    with rt.rotary_patched(model, fuse_qk_norm=False), torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert not calls


class _Norm(nn.Module):
    def __init__(self, n, kind):
        super().__init__()
        self.weight, self.variance_epsilon, self.kind = nn.Parameter(torch.rand(n) + 0.5), 1e-6, kind

    def forward(self, x):
        if self.kind == "layer":  # centred: not an RMSNorm
            x = x - x.mean(-1, keepdim=True)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return y * (1 + self.weight if self.kind == "gemma" else self.weight)


def test_probe_reads_the_formula():
    assert _qk_norm.probe(_Norm(8, "plain")).offset == 0.0
    assert _qk_norm.probe(_Norm(8, "gemma")).offset == 1.0
    assert _qk_norm.probe(_Norm(8, "layer")) is None  # left alone: runs its own forward


class _NoRopeAttention(nn.Module):
    """Normalizes q and k but never rotates them (a NoPE layer)."""

    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = _Norm(4, "plain"), _Norm(4, "plain")

    def forward(self, q, k):
        return self.q_norm(q), self.k_norm(k)


def test_a_deferred_norm_that_never_reaches_the_rotation_raises():
    m = _NoRopeAttention()
    done = _qk_norm.install(m)
    try:
        with pytest.raises(RuntimeError, match="_NoRopeAttention's q/k norm ran but its output never reached"):
            m(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4))
    finally:
        _qk_norm.remove(done)
    q = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(m(q, q)[0], _Norm.forward(m.q_norm, q))  # restored


def test_a_transformed_q_is_refused():
    m = _NoRopeAttention()
    done = _qk_norm.install(m)
    try:
        q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
        _qk_norm._enter(m, ())  # as inside m's forward
        m.q_norm(q), m.k_norm(k)
        with pytest.raises(RuntimeError, match="the q reaching apply_rotary_pos_emb is not the q_norm input"):
            _qk_norm.take(q * 2, k)
    finally:
        _qk_norm._leave(m, (), None)
        _qk_norm.remove(done)


def _rms(x, norm):
    """float64 RMSNorm with the norm's weight and eps."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()


def test_a_fused_norm_called_outside_its_attention_runs_its_own_forward():
    """Outside its attention module's forward (an analysis script), a patched
    q_norm normalizes; inside, it defers to the rotation (returns its input)."""
    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM")
    _randomize_norms(model, torch.Generator().manual_seed(1))
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, model.config.num_attention_heads, model.config.head_dim)
    returned_input = []
    with rt.rotary_patched(model), torch.no_grad():
        assert model._rotary_integration_state.norms
        deferred = attn.q_norm.forward
        attn.q_norm.forward = lambda y: returned_input.append(deferred(y) is y) or deferred(y)
        torch.testing.assert_close(attn.q_norm(x).double(), _rms(x, attn.q_norm), rtol=1e-6, atol=1e-6)
        attn.q_norm.forward = deferred
        torch.testing.assert_close(attn.k_norm(x).double(), _rms(x, attn.k_norm), rtol=1e-6, atol=1e-6)
    assert returned_input == [False]


@pytest.mark.parametrize("kind", ["forward", "pre", "global"])
def test_a_hooked_norm_is_not_deferred(kind, monkeypatch):
    """A deferred norm returns its input: a forward hook read the raw q, and
    one editing the output in place edited the raw q, which the fused norm
    then scaled away (logits off by 5, silently). While any hook would see a
    norm, neither of its module's norms defers; the others still fuse."""
    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM")
    g = torch.Generator().manual_seed(2)
    _randomize_norms(model, g)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)  # positions show in the logits
    attn = model.model.layers[0].self_attn
    ids = torch.randint(3, hf_sweep.VOCAB, (1, 6), generator=g)
    seen = []

    def triple(mod, args, out=None):
        if mod is attn.q_norm:
            if out is None:  # a pre-hook: the input, tripled
                return (args[0] * 3,)
            seen.append(_rms(args[0], mod).float().sub(out).abs().max().item())
            out.mul_(3)

    register = {"forward": lambda: attn.q_norm.register_forward_hook(triple),
                "pre": lambda: attn.q_norm.register_forward_pre_hook(triple),
                "global": lambda: torch.nn.modules.module.register_module_forward_hook(triple)}[kind]
    hook = register()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        calls = []
        fused = rotary.apply_qk_norm_rope
        monkeypatch.setattr(_positions, "_apply_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
        with rt.rotary_patched(model):
            got = model(input_ids=ids).logits
    hook.remove()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-4)
    assert kind == "pre" or max(seen) < 1e-4  # the hook saw the normalized q
    assert len(calls) == (0 if kind == "global" else model.config.num_hidden_layers - 1)


def test_a_fused_norm_reads_eps_at_each_call():
    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with rt.rotary_patched(model):
            for m in model.modules():
                if hasattr(m, "q_norm"):
                    m.q_norm.variance_epsilon = m.k_norm.variance_epsilon = 0.25
            patched = model(input_ids=ids).logits
            model.model.layers[0].self_attn.k_norm.variance_epsilon = 0.5
            with pytest.raises(RuntimeError, match=r"q_norm and k_norm have different eps \(0.25 and 0.5\)"):
                model(input_ids=ids)
            model.model.layers[0].self_attn.k_norm.variance_epsilon = 0.25
        torch.testing.assert_close(patched, model(input_ids=ids).logits, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("model_type, cls_name", [FAMILIES[0], FAMILIES[2]])
def test_fused_route_compiles_into_one_graph(model_type, cls_name):
    """torch.compile(fullgraph=True) traces the deferred norms, their memory
    check and the fused op into one graph per forward, one op per layer;
    logits and gradients (through AOT autograd) equal the unpatched model's."""
    g = torch.Generator().manual_seed(1)
    model = hf_sweep.tiny_model(model_type, cls_name)
    _randomize_norms(model, g)
    ids = torch.randint(3, hf_sweep.VOCAB, (2, 7), generator=g)

    def run(m):
        model.zero_grad()
        out = m(input_ids=ids).logits
        out.pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "norm" in n}

    ref_logits, ref_grads = run(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    with rt.rotary_patched(model):
        torch._dynamo.reset()
        try:
            logits, grads = run(torch.compile(model, backend=backend, fullgraph=True))
        finally:
            torch._dynamo.reset()
    assert len(graphs) == 1
    fused = [n for n in graphs[0].graph.nodes if "apply_qk_norm_rope" in str(n.target)]
    assert len(fused) == model.config.num_hidden_layers
    torch.testing.assert_close(logits, ref_logits, rtol=2e-5, atol=2e-5)
    assert any("q_norm" in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_transformed_q_is_refused_under_compile():
    """The memory check holds in a compiled forward too: q scaled between its
    norm and the rotation is refused (the error surfaces from the graph break)."""
    m = _NoRopeAttention()
    done = _qk_norm.install(m)

    def attention(q, k):
        qn, kn = m.q_norm(q), m.k_norm(k)
        return _qk_norm.take(qn * 2, kn)

    try:
        torch._dynamo.reset()
        _qk_norm._enter(m, ())  # as inside m's forward
        with pytest.raises(RuntimeError, match="the q reaching apply_rotary_pos_emb is not the q_norm input"):
            torch.compile(attention, backend="eager")(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4))
        # Views only: the norms come back, q's then k's.
        sq, sk = torch.compile(lambda q, k: _qk_norm.take(m.q_norm(q).transpose(1, 2), m.k_norm(k)),
                               backend="eager")(torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4))
        assert sq.module is m.q_norm and sk.module is m.k_norm
    finally:
        _qk_norm._leave(m, (), None)
        torch._dynamo.reset()
        _qk_norm.remove(done)


@pytest.mark.parametrize("strict", [False, True])
def test_fused_route_exports(strict):
    """torch.export of a patched Qwen3 (the deferred norms traced like
    torch.compile's): one fused op per layer in the exported graph, and the
    exported program's logits equal the unpatched model's."""
    g = torch.Generator().manual_seed(2)
    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM")
    _randomize_norms(model, g)
    ids = torch.randint(3, hf_sweep.VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        with rt.rotary_patched(model):
            ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=strict)
        got = ep.module()(input_ids=ids, use_cache=False).logits
    ops = [n for n in ep.graph.nodes if n.op == "call_function" and "apply_qk_norm_rope" in str(n.target)]
    assert len(ops) == model.config.num_hidden_layers
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
