"""rotary.integrations.transformers over a model's life: a dynamic-NTK
state handed over at patch and at unpatch (transformers' module keeps its
grown frequencies until a call shorter than the original length), a rule
for a layer type no layer has (transformers never builds it), and q and k
of different dtypes under autocast (transformers' formula promotes)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")
from rotary.integrations.transformers import apply_rotary_to_model, unpatch  # noqa: E402
from rotary_testing.hf_sweep import _calls, causal_lm_classes  # noqa: E402
from rotary_testing.hf_tiny import tiny_model  # noqa: E402
from test_hf_integration import (  # noqa: E402,F401 - the autouse fixtures apply here too
    FP32_ATOL,
    VOCAB,
    _nothing_left_patched,
    _one_thread,
    make_model,
)

pytestmark = pytest.mark.filterwarnings("ignore")


@torch.no_grad()
def _generate(model, ids, n):
    out = model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def _ids(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("patch_at,unpatch_at", [(None, None), (1, None), (0, 1), (0, None)],
                         ids=["never", "after the first call", "for the first call only", "throughout"])
def test_a_dynamic_state_is_handed_over(patch_at, unpatch_at):
    """max_position_embeddings 16, factor 2: the first generate grows the
    rule to 29 rows; the second reaches 20, inside the grown range, where
    the fresh rule's frequencies differ (by 0.73 in the logits when the
    state was not handed over). Every history gives the unpatched logits."""
    results = []
    for patched_at, unpatched_at in ((None, None), (patch_at, unpatch_at)):
        config = make_model("llama", "dynamic").config
        config.max_position_embeddings = 16  # the rotary module reads it when built
        torch.manual_seed(3)
        model = type(make_model())(config).eval()
        outs = []
        for step, (ids, n) in enumerate(((_ids(9, 1), 20), (_ids(20, 5), 3))):
            if step == patched_at:
                apply_rotary_to_model(model)
            if step == unpatched_at:
                unpatch(model)
            outs.append(_generate(model, ids, n))
        unpatch(model)
        results.append(outs)
    (ref_first, ref_second), (first, second) = results
    assert int(ref_first[0].shape[1]) == 29  # the rule grew past 16 on the first call
    for (rs, rl), (s, lg) in ((ref_first, first), (ref_second, second)):
        assert torch.equal(s, rs)
        torch.testing.assert_close(lg, rl, atol=FP32_ATOL, rtol=0.0)


def test_an_unpatched_dynamic_rule_is_transformers_own_bit_for_bit():
    """Grown while patched, then unpatched: transformers' module holds the
    frequencies its own update would have built (seq_len a tensor, as
    max(position_ids) + 1 is; an int rounded the base one ulp apart)."""
    config = make_model("llama", "dynamic").config
    config.max_position_embeddings = 16
    torch.manual_seed(3)
    ref = type(make_model())(config).double().eval()
    model = copy.deepcopy(ref)
    ids = _ids(30, 7)
    with torch.no_grad():
        want = ref(ids).logits
        apply_rotary_to_model(model)
        model(ids)
        unpatch(model)
        got = model(ids).logits
    emb, ref_emb = model.model.rotary_emb, ref.model.rotary_emb
    assert torch.equal(emb.inv_freq, ref_emb.inv_freq)
    assert int(emb.max_seq_len_cached) == int(ref_emb.max_seq_len_cached) == 30
    assert torch.equal(got, want)


def test_a_rule_for_a_layer_type_no_layer_has_is_not_read():
    """Gemma 3 with sliding layers only and a full-attention rule that could
    not be built (four long factors for eight pairs): transformers never
    reads it, so the patch serves the model."""
    params = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
              "full_attention": dict(rope_type="longrope", rope_theta=1e6, original_max_position_embeddings=8,
                                     short_factor=[1.0] * 3, long_factor=[2.0] * 3)}
    model = tiny_model("gemma3_text", "Gemma3ForCausalLM",
                       dict(rope_parameters=params, layer_types=["sliding_attention", "sliding_attention"]))
    ids = _ids(8, 1)
    ref = _generate(model, ids, 4)
    apply_rotary_to_model(model)
    try:
        got = _generate(model, ids, 4)
    finally:
        unpatch(model)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], atol=FP32_ATOL, rtol=0.0)


@pytest.mark.parametrize("family", ["hy_v4", "zaya", "dots3_note_text"])
def test_q_and_k_of_different_dtypes_under_autocast(family):
    """Under torch.autocast(bfloat16) these families hand the rotation a bf16
    q and a float32 k (HY-V4's indexer casts k to the float32 residual
    dtype). The patch promotes as transformers' formula does: the patched
    logits are no further from the float32 ones than transformers' own
    autocast logits (1.5x and a bf16 step of slack)."""
    model, calls, _ = _calls(family, causal_lm_classes()[family])
    with torch.no_grad():
        exact = model(**calls[1]).logits.double()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = model(**calls[1]).logits.double()
            apply_rotary_to_model(model)
            try:
                ours = model(**calls[1]).logits.double()
            finally:
                unpatch(model)
    err_theirs, err_ours = (theirs - exact).abs().mean(), (ours - exact).abs().mean()
    assert err_ours <= 1.5 * err_theirs + 2**-8 * exact.abs().mean(), (float(err_ours), float(err_theirs))


@pytest.mark.parametrize("family,rope", [("llama", "default"), ("llama", "dynamic"), ("qwen3", "default")])
def test_a_model_patched_while_on_meta_runs_after_loading(family, rope):
    """Patched on a meta-initialised model (our table built on meta, outside
    the module tree that to_empty and load_state_dict reach), then loaded:
    the first forward failed in torch's "Cannot copy out of meta tensor".
    The table is built from the options on first use: the logits are those
    of the same model patched on the CPU (patched = unpatched is the sweep's).
    Qwen3's q/k norms are probed with a stand-in weight (the probe read the
    meta weight, failed, and left the model half patched)."""
    ref = make_model(family, rope)
    with torch.device("meta"):
        model = make_model(family, rope)
    apply_rotary_to_model(model)
    apply_rotary_to_model(ref)
    assert bool(model._rotary_integration_state.norms) == (family == "qwen3")
    try:
        model.to_empty(device="cpu")
        model.load_state_dict(ref.state_dict())
        ids = _ids(300, 5)  # past max_position_embeddings (256): a dynamic rule grows
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
    finally:
        unpatch(model)
        unpatch(ref)


def test_a_patch_that_fails_leaves_the_model_as_it_was(monkeypatch):
    """The q/k norms are installed last: a failure there left the rotary
    embedding's forward and the module's apply_rotary_pos_emb patched, with
    no state for unpatch to undo. Now everything done is undone."""
    from rotary.integrations import _qk_norm
    from transformers.models.qwen3 import modeling_qwen3

    model = make_model("qwen3", "default")
    function = modeling_qwen3.apply_rotary_pos_emb

    def fail(model):
        raise RuntimeError("install failed")

    monkeypatch.setattr(_qk_norm, "install", fail)
    with pytest.raises(RuntimeError, match="install failed"):
        apply_rotary_to_model(model)
    assert not hasattr(model, "_rotary_integration_state")
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert modeling_qwen3.apply_rotary_pos_emb is function


def test_a_patched_model_collected_without_unpatch_gives_its_functions_back():
    """A patched model dropped without unpatch left transformers'
    apply_rotary_pos_emb wrapped for good. Collected, it counts as
    unpatched: the function is restored once no patched model (a deep copy
    included) uses it; a collection while the patch lock is held is
    released by the next patch or unpatch."""
    import copy
    import gc

    from rotary.integrations import _hf_functions
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    a, b = make_model("llama", "default"), make_model("llama", "default")
    b.load_state_dict(a.state_dict())
    ids = _ids(12, 3)
    with torch.no_grad():
        want = a(ids).logits
    apply_rotary_to_model(a)
    apply_rotary_to_model(b)
    c = copy.deepcopy(b)
    del a
    gc.collect()
    assert modeling_llama.apply_rotary_pos_emb is not original  # b and c use it
    unpatch(b)
    del b
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(c(ids).logits, want, rtol=0, atol=FP32_ATOL)  # c still patched, still right
    with _hf_functions.lock:  # as if collected inside a locked section
        del c
        gc.collect()
        assert modeling_llama.apply_rotary_pos_emb is not original
    d = make_model("llama", "default")
    apply_rotary_to_model(d)
    unpatch(d)  # drains c's release, then its own
    assert modeling_llama.apply_rotary_pos_emb is original and not _hf_functions.module_patches
