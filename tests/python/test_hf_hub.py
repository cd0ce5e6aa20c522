"""The Hub route: rotary as the ``kernels`` layer for transformers'
``rotary_pos_emb``. A tiny random-weight Llama kernelized with rotary's layer
matches the unpatched model (fp32 logits and greedy decode with a KV cache),
and so does the model patched the existing way; the layer function matches
transformers' own apply_rotary_pos_emb, and refuses tables it cannot read.

transformers 5.24 turns its ``kernels`` hooks on with 0.18.2 <= kernels <
0.19 (requirements-test.txt pins 0.18.3): its decorators make the function a
module and give every attention module its own copy, which ``kernelize``
swaps. The other decorated layers (RMSNorm, SiLU) keep their own forward
(``use_fallback``)."""

import copy

import numpy as np

import pytest
import torch

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

from rotary.integrations import apply_rotary_to_model, unpatch  # noqa: E402
from rotary.integrations import hub  # noqa: E402
from rotary.integrations.hub import LAYER_NAME, RotaryPosEmb, apply_rotary_transformers, kernel_mapping  # noqa: E402
from rotary_testing.rope_testing import gen, randn  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

TOL = 2e-5


def tiny_llama(**extra):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return modeling_llama.LlamaForCausalLM(cfg).eval()


def rotations(model):
    """The per-attention copies of the hub function that kernelize swaps."""
    funcs = [m._kernel_funcs[hub.LAYER_NAME] for m in model.modules()
             if hub.LAYER_NAME in getattr(m, "_kernel_funcs", {})]
    assert funcs, "transformers' kernels hooks are off: they need 0.18.2 <= kernels < 0.19"
    return funcs


def assert_swapped(model):
    for f in rotations(model):
        assert f.forward.__func__ is RotaryPosEmb.forward  # swapped in, not a fallback


def kernelize(model, mode):
    with kernels.use_kernel_mapping(kernel_mapping()):
        kernels.kernelize(model, mode=mode, device="cpu")
    assert_swapped(model)


@torch.no_grad()
def outputs(model):
    device = next(model.parameters()).device
    ids = torch.randint(3, 128, (2, 12), generator=gen(1)).to(device)
    pos = (torch.arange(12).expand(2, 12) + torch.tensor([[40], [7]])).to(device)
    logits = [model(input_ids=ids).logits, model(input_ids=ids, position_ids=pos).logits]
    tokens = model.generate(input_ids=ids[:1, :6], max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    return logits, tokens


def assert_same(got, ref):
    for g, r in zip(got[0], ref[0]):
        torch.testing.assert_close(g, r, rtol=TOL, atol=TOL)
    assert torch.equal(got[1], ref[1])


def test_kernelized_llama_matches_unpatched_and_patched(monkeypatch):
    ref = outputs(tiny_llama())
    model = tiny_llama()
    assert all(f.forward.__func__ is not RotaryPosEmb.forward for f in rotations(model))
    kernelize(model, kernels.Mode.INFERENCE)
    calls = []
    original = hub.apply_rope_cos_sin
    monkeypatch.setattr(hub, "apply_rope_cos_sin", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    assert_same(outputs(model), ref)
    assert len(calls) >= 2 * 2  # both layers of both forwards rotated through rotary
    monkeypatch.undo()
    patched = apply_rotary_to_model(tiny_llama())
    try:
        assert_same(outputs(patched), ref)
    finally:
        unpatch(patched)


def test_kernelized_for_training_and_compile():
    """The layer is registered for every mode: kernelize accepts training
    and torch.compile, and gradients equal transformers' own."""
    ref = tiny_llama().train()
    ids = torch.randint(3, 128, (1, 8), generator=gen(2))
    ref(input_ids=ids, labels=ids).loss.backward()
    model = tiny_llama().train()
    kernelize(model, kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE)
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_transformers_kernel_config_reads_the_repository():
    """transformers' own loader (from_pretrained(use_kernels=True,
    kernel_config=...)) validates hub.kernel_config()'s mapping against the
    model's registered layer; it loads kernels on GPU devices only (see the
    CUDA test)."""
    kc = hub.kernel_config()
    kc.sanitize_kernel_mapping(tiny_llama())
    assert kc.kernel_mapping == {hub.LAYER_NAME: f"{hub.kernel_repository()}:RotaryPosEmb"} and kc.use_local_kernel


def test_kernel_config_survives_from_pretrained_rewrite(monkeypatch):
    """from_pretrained(use_kernels=True) first rewrites the mapping
    (register_kernel_replacements_and_fusions: entries become (repository,
    metadata)), then builds the kernels mapping for the model's device; the
    local repository must come through both (the device taken as CUDA: the
    step builds the mapping only, nothing runs there)."""
    from kernels import LocalLayerRepository, Mode
    from transformers.integrations.hub_kernels import register_kernel_replacements_and_fusions
    from transformers.utils import kernel_config as kc_module

    model, kc = tiny_llama(), hub.kernel_config()
    register_kernel_replacements_and_fusions(type(model), model.config, kc)
    monkeypatch.setattr(kc_module, "infer_device", lambda m: "cuda")
    kc.sanitize_kernel_mapping(model)
    kc.create_compatible_mapping(model)
    repo = kc.kernel_mapping[hub.LAYER_NAME]["cuda"][Mode.INFERENCE]
    assert isinstance(repo, LocalLayerRepository) and repo.layer_name == "RotaryPosEmb"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers loads kernels on GPU devices only")
def test_from_pretrained_use_kernels_cuda(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda", use_kernels=True,
                                                               kernel_config=hub.kernel_config()).eval()
    assert_swapped(loaded)
    ref = outputs(model.cuda())
    assert_same(outputs(loaded), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_layer_function_matches_transformers(dtype, unsqueeze_dim):
    """apply_rotary_transformers against transformers' apply_rotary_pos_emb,
    with the cos/sin of its own rotary embedding (llama3 rule, batch rows at
    different positions); in bf16 rotary rounds once, transformers several
    times, so each is held against a float64 evaluation."""
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    emb = modeling_llama.LlamaRotaryEmbedding(cfg)
    x = randn((2, 4, 6, 16), torch.float32, 3)
    pos = torch.arange(6).expand(2, 6) + torch.tensor([[0], [100]])
    cos, sin = emb(x, pos)
    q, k = randn((2, 4, 6, 16), dtype, 4), randn((2, 2, 6, 16), dtype, 5)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    got = apply_rotary_transformers(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim)
    exact = modeling_llama.apply_rotary_pos_emb(q.double(), k.double(), cos.to(dtype).double(),
                                                sin.to(dtype).double(), unsqueeze_dim)
    for g, w, e in zip(got, want, exact):
        assert g.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        else:
            assert (g.double() - e).abs().max() <= (w.double() - e).abs().max()


def test_layer_refuses_what_it_cannot_read():
    """An interleaved (repeat_interleave) table is an error, not a wrong
    rotation; so is an unsqueeze_dim rotary does not serve."""
    q, k = randn((1, 2, 4, 8), torch.float32, 6), randn((1, 2, 4, 8), torch.float32, 7)
    a = torch.rand(1, 4, 4, generator=gen(8)) * 3
    cos, sin = a.cos().repeat_interleave(2, -1), a.sin().repeat_interleave(2, -1)
    with pytest.raises(ValueError, match="must be rotate_half tables.*leave its rotary_pos_emb unkernelized"):
        apply_rotary_transformers(q, k, cos, sin)
    q2, _ = apply_rotary_transformers(q, k, torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1), np.int64(1))
    assert torch.equal(q2, apply_rotary_transformers(q, k, torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1))[0])
    for bad in (0, True, 1.0):  # True and 1.0 are not 1 (bool and float refused, as elsewhere)
        with pytest.raises(ValueError, match="unsqueeze_dim 1 .* or 2"):
            apply_rotary_transformers(q, k, torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1), bad)
    # gpt-oss's one value per pair, scaled: at position 0 its halves repeat, and its
    # first half would have been read as a partial-rotary table.
    half_cos, half_sin = torch.full((1, 4, 4), 1.3466), torch.zeros(1, 4, 4)
    with pytest.raises(ValueError, match=r"cos and sin must be \[batch, seq, head_dim\] = \[\*, \*, 8\]"):
        apply_rotary_transformers(q, k, half_cos, half_sin)
    # A 2-D table broadcasts against q's dim 1 in transformers: not the sequence.
    with pytest.raises(ValueError, match=r"got cos of shape \(4, 8\)"):
        apply_rotary_transformers(q, k, torch.cat([a[0].cos()] * 2, -1), torch.cat([a[0].sin()] * 2, -1))


def test_layer_function_returns_the_promoted_dtype():
    """bf16 q with float32 tables under autocast: transformers' q * cos gives
    float32, and so does the layer, computed in float32."""
    q, k = randn((1, 2, 4, 8), torch.bfloat16, 9), randn((1, 2, 4, 8), torch.bfloat16, 10)
    a = torch.rand(1, 4, 4, generator=gen(11)) * 3
    cos, sin = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = apply_rotary_transformers(q, k, cos, sin)
        want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # bf16 q, float32 k, bf16 tables (HY-V4's indexer): each in its own product's dtype, as
    # transformers' q * cos and k * cos are (the layer promoted q too).
    k32 = k.float()
    got = apply_rotary_transformers(q, k32, cos.bfloat16(), sin.bfloat16())
    want = modeling_llama.apply_rotary_pos_emb(q, k32, cos.bfloat16(), sin.bfloat16())
    exact = modeling_llama.apply_rotary_pos_emb(q.double(), k32.double(), cos.bfloat16().double(),
                                                sin.bfloat16().double())
    assert (got[0].dtype, got[1].dtype) == (want[0].dtype, want[1].dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    # q rounded once from the float32 rotation: within half a bf16 ulp of exact (and float32's error)
    torch.testing.assert_close(got[0].double(), exact[0], rtol=2**-8, atol=1e-6)


def test_layer_compiles_in_one_graph():
    """can_torch_compile: the layer's dtype choice traced (torch.result_type broke the graph)."""
    q, k = randn((1, 4, 6, 8), torch.float32, 16), randn((1, 2, 6, 8), torch.float32, 17)
    a = torch.rand(1, 6, 4, generator=gen(18)) * 3
    cos, sin = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
    torch._dynamo.reset()
    got = torch.compile(RotaryPosEmb(), fullgraph=True, backend="eager")(q, k, cos, sin)
    for g, w in zip(got, modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_kernel_mapping_devices():
    assert list(kernel_mapping("cpu")[LAYER_NAME]) == ["cpu"]
    assert list(kernel_mapping(["cpu", "cuda"])[LAYER_NAME]) == ["cpu", "cuda"]
    with pytest.raises(TypeError, match=r"kernel_mapping: devices must be a device type or a sequence of them, "
                                        r"got 3"):
        kernel_mapping(3)
    # Keys are device types as kernels looks them up, of the devices the ops have kernels for.
    for bad in ("gpu", "cuda:0", "rocm", "mps"):
        with pytest.raises(ValueError, match=rf"kernel_mapping: rotary's layer runs on device types 'cpu' and "
                                             rf"'cuda', got '{bad}'"):
            kernel_mapping(["cpu", bad])


def test_layer_function_keeps_q_dtype_where_transformers_does():
    """OLMo's rotary embedding returns float32 tables for a bf16 model and
    its function casts back to q's dtype: the layer returned float32, and
    attention then met bf16 v ("expected m1 and m2 to have the same dtype")."""
    from transformers.models.olmo2 import modeling_olmo2

    q, k = randn((1, 2, 4, 8), torch.bfloat16, 12), randn((1, 2, 4, 8), torch.bfloat16, 13)
    a = torch.rand(1, 4, 4, generator=gen(14)) * 3
    cos, sin = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
    got = apply_rotary_transformers(q, k, cos, sin)
    want = modeling_olmo2.apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2**-8, atol=2**-8)  # one bf16 rounding apart at most
    cfg = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = modeling_olmo2.Olmo2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    kernelize(model, kernels.Mode.INFERENCE)
    ids = torch.randint(3, 128, (2, 12), generator=gen(15))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0.02, atol=0.02)


def test_layer_function_serves_pixtral():
    """Pixtral calls with unsqueeze_dim=0 and [patches, head_dim] tables,
    which broadcast as BHSD's [seq, head_dim]."""
    from transformers.models.pixtral import modeling_pixtral

    q, k = randn((1, 2, 6, 8), torch.float32, 16), randn((1, 2, 6, 8), torch.float32, 17)
    a = torch.rand(6, 4, generator=gen(18)) * 3
    cos, sin = torch.cat([a.cos()] * 2, -1), torch.cat([a.sin()] * 2, -1)
    got = apply_rotary_transformers(q, k, cos, sin, 0)
    want = modeling_pixtral.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_the_patch_reads_a_hub_function_signature():
    """With the hooks live, apply_rotary_pos_emb is a module whose own
    signature is (*args, **kwargs); the patch reads the function's from its
    forward, so a positional unsqueeze_dim is still found."""
    from rotary.integrations import _hf_functions

    fn = modeling_llama.apply_rotary_pos_emb
    assert isinstance(fn, torch.nn.Module)
    assert _hf_functions._params(fn) == ["q", "k", "cos", "sin", "unsqueeze_dim"]
    unsqueeze_of = _hf_functions._unsqueeze_of(fn, _hf_functions._params(fn), 4)
    assert unsqueeze_of((2,), {}) == 2 and unsqueeze_of((), {}) == 1
