"""rotary.integrations.transformers: a patched transformers model against the
same model unpatched, in logits and gradients. This file also holds the tiny
models, inputs, tolerances and autouse fixtures that
test_hf_integration_generate.py (generate with a KV cache, torch.compile) and
test_hf_integration_patch.py (patching, unpatching, refusals) import.

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

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
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

from rotary.integrations import rotary_patched  # noqa: E402
from rotary.integrations import transformers as rt  # noqa: E402

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


@pytest.mark.parametrize("rope", ["longrope", "dynamic"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_recomputes_with_the_forwards_own_tables(rope, reentrant):
    """Two forwards on either side of the rule's switch (longrope's factors,
    dynamic's growth), one backward: recomputation ran the first layer with
    the tables of the second forward (gradients 15-85% off, or a
    CheckpointError); transformers recomputes with the cos/sin it saved."""
    ref = make_model("llama", rope)
    g = torch.Generator().manual_seed(3)
    long_ids = torch.randint(3, VOCAB, (1, MAX_POS + 8), generator=g)
    short_ids = torch.randint(3, VOCAB, (1, 10), generator=g)
    grads = []
    for patched in (False, True):
        model = copy.deepcopy(ref).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with rotary_patched(model) if patched else contextlib.nullcontext():
            (model(long_ids, labels=long_ids).loss + model(short_ids, labels=short_ids).loss).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "proj" in n})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
