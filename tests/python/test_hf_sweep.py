"""The Hugging Face sweep (rotary_testing/hf_sweep.py): every causal-LM family
of the installed transformers with rotary embeddings, patched vs unpatched.
Support is what it finds: the generated table and the docs must say the
same, and the patch refuses every family that did not pass, by name."""

import pytest
import torch

pytest.importorskip("transformers")

from rotary_testing import hf_sweep  # noqa: E402

from rotary.integrations import hf_support  # noqa: E402
from rotary.integrations.transformers import apply_rotary_to_model, is_patched, unpatch  # noqa: E402

REGENERATE = "regenerate with: PYTHONPATH=python:tests python -m rotary_testing.hf_sweep --write"


@pytest.fixture(scope="module")
def results():
    return hf_sweep.sweep()


def test_sweep_matches_the_generated_table(results, capsys):
    table = hf_sweep.render_table(results)
    with capsys.disabled():
        print("\n" + table)
    assert hf_sweep.render_module(results) == hf_sweep.TABLE.read_text(), "hf_support.py is stale; " + REGENERATE
    doc = hf_sweep.DOC.read_text()
    assert hf_sweep.splice_doc(doc, table) == doc, "docs/transformers.md's table is stale; " + REGENERATE


def test_the_popular_families_pass(results):
    for family in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "olmo2", "qwen2_vl", "qwen3_vl", "qwen3_5",
                   "mllama", "ernie4_5_vl_moe"):
        assert results[family] is None, f"{family}: {results[family]}"


def test_a_family_the_sweep_refused_is_refused_by_name():
    """Every family the sweep refused for a reason of its own (not for want of
    a tiny model) stays refused by that reason, even with allow_unverified."""
    refused = sorted(k for k, v in hf_support.REFUSED.items() if not v.startswith("the sweep builds no tiny model"))
    assert refused, "the sweep refused nothing: this test has nothing to check"
    model = hf_sweep.tiny_model("llama", "LlamaForCausalLM")
    for model_type in refused:
        model.config.model_type = model_type
        for allow in (False, True):  # never through, even when asked
            with pytest.raises(ValueError, match=rf"model_type {model_type!r} is not supported: .*HF sweep"):
                apply_rotary_to_model(model, allow_unverified=allow)
            assert not is_patched(model)


def test_an_untested_family_needs_allow_unverified():
    model = hf_sweep.tiny_model("llama", "LlamaForCausalLM")
    model.config.model_type = "llama_like_unknown"
    with pytest.raises(ValueError, match=r"'llama_like_unknown' is not verified: it is not in the HF sweep"):
        apply_rotary_to_model(model)
    assert not is_patched(model)
    ids = torch.randint(3, hf_sweep.VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        apply_rotary_to_model(model, allow_unverified=True)
        try:
            torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=0, atol=hf_sweep.TOL)
        finally:
            unpatch(model)


@pytest.mark.parametrize("family", ["hy_v4", "llama"])
def test_a_wrong_rotation_fails_the_sweep_where_the_logits_hide_it(monkeypatch, family):
    """The rotation check can fail: with every patched position off by one,
    HY-V4 (whose tiny model's logits move by 1.4e-5 with position, under the
    logit tolerance) and Llama both fail, by the rotation or the logits."""
    from rotary.integrations import _positions

    def shifted(q, k, freqs, start, interleaved, position_ids=None, **kw):
        return _positions.apply_rope_qk(q, k, freqs, start, interleaved, position_ids=position_ids + 1, **kw)

    monkeypatch.setattr(_positions, "_apply_qk", shifted)
    reason, diff, _ = hf_sweep.check_family(family, hf_sweep.swept_families()[family], None)
    assert diff is None and reason is not None
    if family == "hy_v4":
        assert reason.startswith("a patched rotation differs from transformers'"), reason
