"""rotary.integrations.transformers: a patched transformers model against the
same model unpatched.

Tiny models built in code (nothing downloaded): hidden 64, 2 layers, 4 heads,
2 kv heads (GQA), head_dim 16, vocab 128, random weights from a fixed seed,
initializer_range 0.2 so attention scores are O(1) and depend on positions
(HF's default 0.02 gives nearly uniform attention, which would hide rotation
errors; test_tolerance_is_meaningful checks the tolerances are far below what
a wrong rotation does).

What is compared, patched vs unpatched, on the same inputs in the same order
(so the host-driven rules go through the same states):
- logits of three forward calls: positions 0..23; a batch with explicit
  position_ids reaching 323 (row 0 jumps from 211 to 312, row 1 is
  left-padded under an attention_mask), past max_position_embeddings 256, so
  `dynamic` grows and `longrope` switches to long factors; positions 0..23
  again (they switch back);
- greedy generate with use_cache=True on a left-padded batch: same tokens and
  per-step logits (also against the patched model without a cache), and
  decoding across max_position_embeddings with a 64-row table;
- gradients of a loss; torch.compile(fullgraph=True) tracing;
- unpatch: bit-identical logits, the original function back, state_dict
  keys unchanged throughout.

Tolerances (logits are O(1), up to about 7 here; measured on CPU):
- fp32: max |diff| <= FP32_ATOL = 2e-5 at positions < 40 and FP32_ATOL_FAR =
  1e-4 for the call reaching position 323. transformers forms the angles
  pos * inv_freq in fp32 (about 3.5e-8 * pos rad of error); ours are float64.
  Measured: <= 6e-6 near 0 and <= 5.3e-5 at 323 (qwen2-yarn), and the latter
  is transformers' own error: its float64 model (angles still fp32) is up to
  4.1e-5 from the exact float64 rotation there, while our fp32 model is
  within 1.0e-5 of it at every position (test_fp32_close_to_float64 holds
  ours to 3e-5).
- bf16: max |diff| <= BF16_ATOL = 0.5 and mean |diff| <= BF16_MEAN = 0.04
  (measured <= 0.234 and <= 0.025 on the cases tested; a bf16 ulp at 4..8 is
  0.031). transformers rounds cos/sin and every product to bf16, we rotate in
  fp32 and round once, and the bf16 matmuls amplify either.
  test_bf16_not_less_accurate checks the patched bf16 model is, on average, no
  farther from the fp32 model than transformers' own bf16 (measured closer in
  all ten cases, e.g. mean 0.0251 vs 0.0300 for llama-default).
"""

import copy
import io

import pytest
import torch

import rotary

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama import modeling_llama  # noqa: E402

from rotary.integrations import _positions  # noqa: E402
from rotary.integrations import transformers as rt  # noqa: E402
from rotary.integrations import (  # noqa: E402
    apply_rotary_to_model,
    is_patched,
    patch_llama,
    rotary_embedding_of,
    rotary_patched,
    unpatch,
)

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: intra-op threads only add overhead, and on a
    loaded machine their spinning makes each forward ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _nothing_left_patched():
    """No test leaves a transformers modeling function replaced."""
    original = modeling_llama.apply_rotary_pos_emb
    yield
    assert not rt._module_patches
    assert modeling_llama.apply_rotary_pos_emb is original

FP32_ATOL, FP32_ATOL_FAR = 2e-5, 1e-4
BF16_ATOL, BF16_MEAN = 0.5, 0.04

VOCAB, SEQ, MAX_POS = 128, 24, 256
SHORT = [1.0 + 0.05 * j for j in range(8)]
LONG = [1.0 + 1.5 * j for j in range(8)]

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=MAX_POS,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # q/k RMSNorm before the rotation
    # packed qkv, partial rotary below; its top-level original_max_position_embeddings wins
    "phi3": (Phi3Config, Phi3ForCausalLM, {"original_max_position_embeddings": 64}),
}

# (family, rope, extra rope_parameters)
CASES = [
    ("llama", "default", {}),
    ("llama", "linear", {}),
    ("llama", "yarn", {}),
    ("llama", "llama3", {}),
    ("llama", "dynamic", {}),
    ("llama", "longrope", {}),
    ("mistral", "default", {}),
    ("qwen2", "yarn", {}),
    ("qwen3", "default", {}),
    # Phi3: rotary dim 8 of head_dim 16 (partial rotary), LongRoPE with 4 factors
    ("phi3", "longrope", {"partial_rotary_factor": 0.5, "short_factor": SHORT[:4], "long_factor": LONG[:4]}),
]
CASE_IDS = [f"{f}-{r}" for f, r, _ in CASES]


def make_model(family="llama", rope="default", extra=None, dtype=torch.float32, attn="sdpa", seed=0):
    config_cls, model_cls, kw = FAMILIES[family]
    params = dict(ROPES[rope])
    params.update(extra or {})
    config = config_cls(**COMMON, **kw, rope_parameters=params)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    return model.to(dtype)


def inputs(seed=1):
    """Three calls: (input_ids, attention_mask, position_ids). The second is a
    batch with explicit ids reaching 323: row 0 jumps halfway (200..211 then
    312..323), which no shift of 0..23 reproduces (RoPE is relative, so a
    per-row shift would not show in the logits); row 1 is left-padded (3 pads)
    continuing at position 300."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0) + 300
    half = SEQ // 2
    pos[0, :half] = torch.arange(200, 200 + half)
    pos[0, half:] = torch.arange(324 - half, 324)
    return [(ids, None, None), (ids, mask, pos), (ids.flip(0), None, None)]


def valid(logits, mask):
    return logits if mask is None else logits[mask.bool()]


@torch.no_grad()
def run_calls(model, calls):
    out = []
    for ids, mask, pos in calls:
        out.append(valid(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float(), mask))
    return out


def max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def mean_diff(a, b):
    return max((x.double() - y.double()).abs().mean().item() for x, y in zip(a, b))


def fp32_tol(call_index):
    return FP32_ATOL_FAR if call_index == 1 else FP32_ATOL


# ----------------------------------------------------------------------------
# Logits
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("family,rope,extra", CASES, ids=CASE_IDS)
def test_logits_fp32(family, rope, extra):
    model = make_model(family, rope, extra)
    calls = inputs()
    ref = run_calls(model, calls)
    with rotary_patched(model):
        got = run_calls(model, calls)
    for i, (r, g) in enumerate(zip(ref, got)):
        torch.testing.assert_close(g, r, atol=fp32_tol(i), rtol=0.0, msg=lambda m: f"call {i}: {m}")


@pytest.mark.parametrize("family,rope,extra", [CASES[i] for i in (0, 3, 9)], ids=[CASE_IDS[i] for i in (0, 3, 9)])
def test_fp32_close_to_float64(family, rope, extra):
    """The patched fp32 model against the patched float64 one (our kernel in
    float64 math with the exact table): 3e-5 at every position (measured
    <= 1.0e-5), including 323 where transformers' fp32 angles alone are off
    by ~4e-5."""
    model = make_model(family, rope, extra)
    calls = inputs()
    exact_model = copy.deepcopy(model).double()
    with rotary_patched(model), rotary_patched(exact_model):
        got, exact = run_calls(model, calls), run_calls(exact_model, calls)
    assert max_diff(got, exact) <= 3e-5


@pytest.mark.parametrize("family,rope,extra", [CASES[i] for i in (0, 2, 3, 6, 9)],
                         ids=[CASE_IDS[i] for i in (0, 2, 3, 6, 9)])
def test_logits_bf16(family, rope, extra):
    model = make_model(family, rope, extra, dtype=torch.bfloat16)
    calls = inputs()
    ref = run_calls(model, calls)
    with rotary_patched(model):
        got = run_calls(model, calls)
    assert max_diff(got, ref) <= BF16_ATOL
    assert mean_diff(got, ref) <= BF16_MEAN


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_bf16_not_less_accurate(rope):
    """Against the fp32 model, patched bf16 is on average no farther than
    transformers' bf16 (5% slack; measured 0.0251 vs 0.0300 and 0.0241 vs 0.0278)."""
    fp32 = make_model("llama", rope)
    calls = inputs()
    exact = run_calls(fp32, calls)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    hf_err = mean_diff(run_calls(bf16, calls), exact)
    with rotary_patched(bf16):
        ours_err = mean_diff(run_calls(bf16, calls), exact)
    assert ours_err <= 1.05 * hf_err, (ours_err, hf_err)


def test_eager_attention_and_base_model():
    """eager attention, and patching the bare LlamaModel (no LM head)."""
    model = make_model("llama", "yarn", attn="eager")
    base = model.model
    ids = inputs()[0][0]
    with torch.no_grad():
        ref = base(input_ids=ids).last_hidden_state
        with rotary_patched(base):
            got = base(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, ref, atol=FP32_ATOL, rtol=0.0)


def test_tolerance_is_meaningful():
    """A wrong rotation (linear factor 2 instead of 1, same weights) moves the
    logits far more than FP32_ATOL / BF16_ATOL."""
    a, b = make_model("llama", "default"), make_model("llama", "linear")
    b.load_state_dict(a.state_dict())
    calls = inputs()
    assert max_diff(run_calls(a, calls), run_calls(b, calls)) > 10 * BF16_ATOL


# ----------------------------------------------------------------------------
# Generation with a KV cache
# ----------------------------------------------------------------------------
def _generate(model, ids, mask, use_cache=True, n=8):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             use_cache=use_cache, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, [x.float() for x in out.logits]


@pytest.mark.parametrize("family,rope,extra", [CASES[i] for i in (0, 2, 4, 6, 8, 9)],
                         ids=[CASE_IDS[i] for i in (0, 2, 4, 6, 8, 9)])
def test_greedy_generate_with_cache(family, rope, extra):
    model = make_model(family, rope, extra)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding
    ref_seq, ref_logits = _generate(model, ids, mask)
    with rotary_patched(model):
        seq, logits = _generate(model, ids, mask)
        nocache_seq, nocache_logits = _generate(model, ids, mask, use_cache=False)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(nocache_seq, seq)
    for step, (r, o, n) in enumerate(zip(ref_logits, logits, nocache_logits)):
        torch.testing.assert_close(o, r, atol=FP32_ATOL, rtol=0.0, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(n, o, atol=FP32_ATOL, rtol=0.0, msg=lambda m: f"step {step} (no cache): {m}")


def test_generate_past_max_position_embeddings():
    """Decode with the cache across max_position_embeddings (yarn): positions
    past the table rows are computed from inv_freq."""
    model = make_model("llama", "yarn")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefix = torch.randint(3, VOCAB, (1, MAX_POS - 24), generator=torch.Generator().manual_seed(3))
        ids = torch.cat([prefix, ids], 1)
    ref_seq, ref_logits = _generate(model, ids, torch.ones_like(ids), n=20)
    with rotary_patched(model, max_seq_len=64):  # table rows end far before the sequence
        seq, logits = _generate(model, ids, torch.ones_like(ids), n=20)
    assert seq.shape[1] > MAX_POS and torch.equal(seq, ref_seq)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=FP32_ATOL_FAR, rtol=0.0)


def test_compile_fullgraph():
    """A patched model with a static rule traces into one graph: the
    positions handle and our op go through dynamo without a break (the eager
    backend keeps this fast; inductor is exercised by the op's own tests)."""
    model = make_model("llama", "yarn")
    ids = inputs()[0][0]
    with rotary_patched(model), torch.no_grad():
        eager = model(input_ids=ids).logits
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids).logits
        finally:
            torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0.0)


# ----------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------
def _grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if "proj" in n}


def test_gradients_match():
    model = make_model("llama", "llama3")
    ids = inputs()[0][0]
    ref = _grads(model, ids)
    with rotary_patched(model):
        got = _grads(model, ids)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # Gradient checkpointing recomputes each layer in backward with the same handle.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with rotary_patched(model):
        ckpt = _grads(model, ids)
    for name in ref:
        torch.testing.assert_close(ckpt[name], ref[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"ckpt {name}: {m}")


# ----------------------------------------------------------------------------
# The patch itself
# ----------------------------------------------------------------------------
def test_kernel_is_used(monkeypatch):
    """Every layer rotates through our op once per forward; transformers'
    rotate_half is never reached."""
    model = make_model("llama", "default")
    calls = []
    real = _positions._apply_qk

    def counting(*args, **kwargs):
        calls.append(kwargs["position_ids"].shape)
        return real(*args, **kwargs)

    def forbidden(x):
        raise AssertionError("transformers' rotate_half ran in a patched model")

    monkeypatch.setattr(_positions, "_apply_qk", counting)
    ids, mask, pos = inputs()[1]
    with rotary_patched(model):
        monkeypatch.setattr(modeling_llama, "rotate_half", forbidden)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        monkeypatch.undo()
    assert calls == [torch.Size([2, SEQ])] * 2


def test_patch_builds_rope_from_config():
    model = make_model("llama", "yarn")
    apply_rotary_to_model(model)
    try:
        rope = rotary_embedding_of(model)
        assert isinstance(rope, rotary.RotaryEmbedding)
        assert rope.dim == 16 and rope.interleaved is False and rope.max_seq_len == MAX_POS
        assert rope.scaling["rope_type"] == "yarn"
        hf = model.model.rotary_emb
        assert rope.attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-6)
        torch.testing.assert_close(rope.inv_freq.float(), hf.inv_freq, rtol=2e-6, atol=0.0)
        cos, sin = hf(torch.zeros(1), torch.arange(4)[None])
        assert isinstance(cos, rt.RotaryPositions) and cos is sin
        assert "RotaryPositions" in repr(cos)
    finally:
        unpatch(model)


def test_unpatch_restores_exactly():
    model = make_model("llama", "llama3")
    calls = inputs()
    keys = list(model.state_dict())
    before = run_calls(model, calls)
    original = modeling_llama.apply_rotary_pos_emb
    emb = model.model.rotary_emb

    assert patch_llama(model) is model and is_patched(model)
    assert patch_llama(model) is model  # idempotent
    assert modeling_llama.apply_rotary_pos_emb is not original
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is original
    assert "forward" in emb.__dict__
    assert list(model.state_dict()) == keys  # our table is not in the state_dict
    run_calls(model, calls)

    assert unpatch(model) is model and not is_patched(model)
    assert unpatch(model) is model  # no-op
    assert modeling_llama.apply_rotary_pos_emb is original
    assert "forward" not in emb.__dict__
    assert list(model.state_dict()) == keys
    after = run_calls(model, calls)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_context_manager_restores_on_error():
    model = make_model("llama", "default")
    original = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="boom"):
        with rotary_patched(model):
            raise RuntimeError("boom")
    assert not is_patched(model) and modeling_llama.apply_rotary_pos_emb is original
    # Already patched before entering: stays patched after leaving.
    apply_rotary_to_model(model)
    with rotary_patched(model):
        pass
    assert is_patched(model)
    unpatch(model)
    assert modeling_llama.apply_rotary_pos_emb is original


def test_two_models_and_an_unpatched_one():
    """The module function is shared: patched models with different rules keep
    their own tables, and an unpatched model of the same family (real cos/sin)
    goes through transformers' own code, bit for bit."""
    original = modeling_llama.apply_rotary_pos_emb
    a, b, plain = make_model("llama", "default"), make_model("llama", "yarn", seed=1), make_model("llama", "llama3")
    calls = inputs()
    ref_a, ref_b, ref_plain = run_calls(a, calls), run_calls(b, calls), run_calls(plain, calls)
    apply_rotary_to_model(a)
    apply_rotary_to_model(b)
    try:
        assert all(torch.equal(x, y) for x, y in zip(run_calls(plain, calls), ref_plain))
        assert max_diff(run_calls(a, calls), ref_a) < FP32_ATOL_FAR
        assert max_diff(run_calls(b, calls), ref_b) < FP32_ATOL_FAR
        unpatch(a)
        assert modeling_llama.apply_rotary_pos_emb is not original  # b still uses it
        assert all(torch.equal(x, y) for x, y in zip(run_calls(a, calls), ref_a))
        assert max_diff(run_calls(b, calls), ref_b) < FP32_ATOL_FAR
    finally:
        unpatch(a)
        unpatch(b)
    assert modeling_llama.apply_rotary_pos_emb is original


def test_model_moved_after_patching():
    """The table follows the layers' device lazily (here: a dtype move and a
    same-device .to(), on CUDA a real device move)."""
    model = make_model("llama", "default")
    calls = inputs()
    ref = run_calls(model, calls)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with rotary_patched(model):
        model.to(device)
        got = run_calls(model, [tuple(None if t is None else t.to(device) for t in c) for c in calls])
    torch.testing.assert_close([g.cpu() for g in got], ref, atol=FP32_ATOL_FAR, rtol=0.0)


def test_refusals():
    # an unverified family (gpt_neox itself passes the HF sweep: a model_type it never saw)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                            intermediate_size=64, vocab_size=VOCAB))
    neox.config.model_type = "gpt_neox_unswept"
    with pytest.raises(ValueError, match="not verified"):
        apply_rotary_to_model(neox)
    assert not is_patched(neox)
    # a config from_hf_config cannot represent leaves the model untouched
    model = make_model("llama", "default")
    model.config.rope_parameters = {"rope_type": "nonsense", "rope_theta": 10000.0}
    original = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(ValueError):
        apply_rotary_to_model(model)
    assert not is_patched(model) and "forward" not in model.model.rotary_emb.__dict__
    assert modeling_llama.apply_rotary_pos_emb is original
    # something without a rotary embedding
    with pytest.raises(ValueError):
        apply_rotary_to_model(torch.nn.Linear(2, 2), allow_unverified=True)


def test_deepcopy_of_a_patched_model_is_independent():
    """copy.deepcopy of a patched model copies its tables, rule state and fused
    q/k norms: a long call on the copy leaves the original's dynamic table as
    it was, a copy's changed norm weight is its own, and unpatching one keeps
    the other patched and right."""
    model = make_model("llama", "dynamic")
    calls = inputs()
    ref = run_calls(copy.deepcopy(model), calls)
    apply_rotary_to_model(model)
    clone = copy.deepcopy(model)
    try:
        assert is_patched(clone) and rotary_embedding_of(clone) is not rotary_embedding_of(model)
        long_ids = torch.randint(3, VOCAB, (1, 2 * MAX_POS))
        with torch.no_grad():
            clone(input_ids=long_ids)  # grows the copy's dynamic table past max_position_embeddings
        assert rotary_embedding_of(clone).rope_state == 2 * MAX_POS and rotary_embedding_of(model).rope_state == 0
        assert max_diff(run_calls(model, calls), ref) < FP32_ATOL_FAR
        unpatch(clone)
        assert is_patched(model) and max_diff(run_calls(model, calls), ref) < FP32_ATOL_FAR
    finally:
        unpatch(clone)
        unpatch(model)

    qwen = make_model("qwen3", "default")
    apply_rotary_to_model(qwen)
    twin = copy.deepcopy(qwen)
    try:
        with torch.no_grad():
            twin.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
        unpatched_twin = copy.deepcopy(twin)
        unpatch(unpatched_twin)
        assert max_diff(run_calls(twin, calls), run_calls(unpatched_twin, calls)) < FP32_ATOL_FAR
        plain = copy.deepcopy(qwen)
        unpatch(plain)
        assert max_diff(run_calls(qwen, calls), run_calls(plain, calls)) < FP32_ATOL_FAR
    finally:
        for m in (qwen, twin):
            unpatch(m)


def test_patching_again_with_other_options_or_pickling_is_refused():
    model = make_model("qwen3", "default")
    apply_rotary_to_model(model)
    try:
        assert apply_rotary_to_model(model) is model and apply_rotary_to_model(model, fuse_qk_norm=True) is model
        with pytest.raises(ValueError, match=r"already patched with fuse_qk_norm=True, not False; unpatch it first"):
            apply_rotary_to_model(model, fuse_qk_norm=False)
        with pytest.raises(ValueError, match=r"already patched with max_seq_len=None \(the config's "
                                             r"max_position_embeddings\), not 8"):
            with rotary_patched(model, max_seq_len=8):
                pass
        assert is_patched(model)
    finally:
        unpatch(model)
    apply_rotary_to_model(model)
    try:
        for part in (model, model.model, model.model.layers[0].self_attn.q_norm, model.model.rotary_emb):
            with pytest.raises(TypeError, match=r"a patched model and its modules cannot be pickled; unpatch"):
                torch.save(part, io.BytesIO())
    finally:
        unpatch(model)
    torch.save(model, io.BytesIO())
    with pytest.raises(TypeError, match=r"max_seq_len must be an int, got 2.5"):
        apply_rotary_to_model(model, max_seq_len=2.5)
    assert not is_patched(model)
