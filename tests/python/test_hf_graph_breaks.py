"""The patch adds no torch.compile graph break, for each form of the
patched rotation function: GPT-J's one-tensor form (codegen), complex
freqs_cis (deepseek_v2), q and k rotated apart (gemma3n_text), packed qkv with
partial rotary (phi3), fused q/k norms (qwen3) and M-RoPE (qwen2_vl).
``python -m rotary_testing.hf_graph_breaks`` runs every served family."""

import pytest

pytest.importorskip("transformers")

from rotary_testing import hf_graph_breaks, hf_sweep  # noqa: E402

FAMILIES = ["codegen", "deepseek_v2", "gemma3n_text", "phi3", "qwen3", "qwen2_vl"]


@pytest.fixture(scope="module")
def families():
    return hf_sweep.swept_families()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_patch_adds_no_graph_break(model_type, families):
    line, worse = hf_graph_breaks.check(model_type, families[model_type])
    assert not worse, line
