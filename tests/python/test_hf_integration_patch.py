"""rotary.integrations.transformers: the patch itself. Our op is what
rotates (transformers' rotate_half never runs), the RotaryEmbedding built
from the config, unpatch restoring bit-identical logits and the original
function, the context manager, several models sharing the module function,
a model moved after patching, refusals, deepcopy, and re-patching with other
options or pickling refused. Split from test_hf_integration.py, whose tiny
models, inputs and tolerances these tests use.
"""

import copy
import io

import pytest
import torch

import rotary

pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402
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
from test_hf_integration import (  # noqa: E402,F401 - the autouse fixtures apply here too
    FP32_ATOL_FAR,
    MAX_POS,
    SEQ,
    VOCAB,
    _nothing_left_patched,
    _one_thread,
    inputs,
    make_model,
    max_diff,
    run_calls,
)

pytestmark = pytest.mark.filterwarnings("ignore")


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


@pytest.mark.parametrize("seq", [5, 4])  # seq == heads: a dim read the wrong way would go unnoticed
def test_unsqueeze_dim_given_positionally(seq):
    """apply_rotary_pos_emb(q, k, cos, sin, 2) on [batch, seq, heads, dim]
    tensors: the patched function reads unsqueeze_dim from its position, as
    the original does."""
    model = make_model("llama", "default")
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, seq, 4, 16, generator=g) for _ in range(2))
    pos = torch.arange(seq).expand(2, seq)
    cos, sin = model.model.rotary_emb(q, pos)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, 2)
    with rotary_patched(model):
        cos, sin = model.model.rotary_emb(q, pos)
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("first", ["causal_lm", "base_model"])
def test_a_rotary_embedding_patched_through_another_model_object_is_refused(first):
    """The causal LM and its base model share one rotary_emb: patching both
    saved the first patch's forward as the one to restore, and unpatching in
    the order applied left a model that failed (or rotated through rotary
    while reporting itself unpatched). The second patch is refused by name."""
    model = make_model("llama", "llama3")
    calls = inputs()
    before = run_calls(model, calls)
    original = modeling_llama.apply_rotary_pos_emb
    one, other = (model, model.model) if first == "causal_lm" else (model.model, model)
    apply_rotary_to_model(one)
    with pytest.raises(ValueError, match=r"rotary: \w+'s rotary embedding \(LlamaRotaryEmbedding\) is already "
                                         r"patched through another model object that holds it"):
        apply_rotary_to_model(other)
    assert is_patched(one) and not is_patched(other)
    unpatch(other)  # not patched: a no-op
    unpatch(one)
    assert modeling_llama.apply_rotary_pos_emb is original and "forward" not in model.model.rotary_emb.__dict__
    assert all(torch.equal(a, b) for a, b in zip(before, run_calls(model, calls)))


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
