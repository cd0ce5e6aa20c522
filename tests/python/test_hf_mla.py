"""from_hf_config against transformers' own rotary code for the MLA families
beyond test_hf_config.py's: those whose attention always calls
apply_rotary_pos_emb_interleave (no rope_interleave field), Sarvam's config
for DeepSeek-V3's model, and the sparse-attention indexers, whose pairing is
their own function's (Family.function_pairing). The same inputs and tolerance
as test_hf_config.py; the sweep checks the whole models."""

import inspect

import pytest
import torch

import rotary
from rotary import hf_families
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_config import ATOL, MLA, deinterleave, hf_and_ours, inputs, make_config, modeling

pytestmark = pytest.mark.filterwarnings("ignore")
DSA = dict(MLA, q_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4)
# LongCat-Flash's rotary class sizes its table by its own head_dim (not set from qk_rope_head_dim).
LONGCAT = dict(MLA, q_lora_rank=16, head_dim=8)
# Mistral 4's by head_dim x partial_rotary_factor, which its config sets to
# qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim): head_dim is their sum.
MISTRAL4 = dict(MLA, q_lora_rank=16, head_dim=20)
# Its default rule's table is head_dim wide, whatever the factor.
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def hf_mla_interleave(mt, rotary_cls):
    def run(cfg, q, k, pos):  # the attention's split / apply_rotary_pos_emb_interleave / cat
        m, nope = modeling(mt), cfg.qk_nope_head_dim
        cos, sin = getattr(m, rotary_cls)(cfg)(q, pos)
        q_pe, k_pe = m.apply_rotary_pos_emb_interleave(q[..., nope:], k[..., nope:], cos, sin)
        return torch.cat([q[..., :nope], q_pe], -1), torch.cat([k[..., :nope], k_pe], -1)
    return run


# (id, model_type, config class, kwargs, adapter, head dim of q / k, 3-D positions), as in test_hf_config
CASES = [
    ("sarvam_mla", "sarvam_mla", "SarvamMLAConfig", MLA, hf_mla_interleave("deepseek_v3", "DeepseekV3RotaryEmbedding"),
     20, False),
    ("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaConfig", DSA, hf_mla_interleave("glm_moe_dsa", "GlmMoeDsaRotaryEmbedding"),
     20, False),
    ("bailing_hybrid", "bailing_hybrid", "BailingHybridConfig", MLA,
     hf_mla_interleave("bailing_hybrid", "BailingHybridRotaryEmbedding"), 20, False),
    ("deepseek_v32", "deepseek_v32", "DeepseekV32Config", DSA,
     hf_mla_interleave("deepseek_v32", "DeepseekV32RotaryEmbedding"), 20, False),
    ("axk2", "axk2", "AXK2Config", DSA, hf_mla_interleave("axk2", "AXK2RotaryEmbedding"), 20, False),
    ("longcat_flash", "longcat_flash", "LongcatFlashConfig", LONGCAT,
     hf_mla_interleave("longcat_flash", "LongcatFlashRotaryEmbedding"), 20, False),
    ("mistral4", "mistral4", "Mistral4Config", MISTRAL4, hf_mla_interleave("mistral4", "Mistral4RotaryEmbedding"),
     20, False),
    ("mistral4-default", "mistral4", "Mistral4Config", dict(MISTRAL4, head_dim=8, rope_parameters=DEFAULT),
     hf_mla_interleave("mistral4", "Mistral4RotaryEmbedding"), 20, False),
]
# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {c[1] for c in CASES} | {"dots3_note_text"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(case):
    cfg, rope, _, want, got = hf_and_ours(case, seed=len(case[0]))
    assert rope.interleaved and rope.rotary_offset == cfg.qk_nope_head_dim
    # Same pairs; transformers writes them de-interleaved (test_hf_config's deepseek_v3).
    for g, w in zip(got, want):
        torch.testing.assert_close(deinterleave(g, rope.rotary_offset), w, atol=ATOL, rtol=0)
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)


@pytest.mark.parametrize("mt,cls,fn", [
    ("deepseek_v32", "DeepseekV32Config", "apply_rotary_pos_emb"), ("axk2", "AXK2Config", "apply_rotary_pos_emb"),
    ("glm_moe_dsa", "GlmMoeDsaConfig", "apply_rotary_pos_emb_interleave"),
])
def test_indexer_pairs_as_its_function(mt, cls, fn):
    """The indexer rotates q_rot / k_rot (BSHD, unsqueeze_dim=2) with the same
    cos / sin through fn: the pairing the patch gives fn (function_pairing,
    else the family's) is fn's."""
    cfg = make_config(cls, **DSA)
    m = modeling(mt)
    indexer = getattr(m, next(n for n in dir(m) if n.endswith("Indexer")))
    assert f"{fn}(q_rot, k_rot, cos, sin, unsqueeze_dim=2)" in inspect.getsource(indexer)
    kw = rope_kwargs_from_hf_config(cfg)
    pairing = dict(hf_families.FAMILIES[mt].function_pairing).get(fn)
    interleaved = kw["interleaved"] if pairing is None else pairing == "interleaved"
    q, k, pos = inputs(kw["dim"], False, 4)
    q, k = q.transpose(1, 2), k[:, :1].transpose(1, 2)  # [B, S, H, rope], one shared k head
    cos, sin = getattr(m, next(n for n in dir(m) if n.endswith("RotaryEmbedding")))(cfg)(q, pos)
    want = getattr(m, fn)(q, k, cos, sin, unsqueeze_dim=2)
    ours = rotary.RotaryEmbedding(**{**kw, "interleaved": interleaved, "rotary_offset": 0})
    got = ours(q, k, position_ids=pos, layout="BSHD")
    for g, w in zip(got, want):
        torch.testing.assert_close(deinterleave(g, 0) if fn.endswith("_interleave") else g, w, atol=ATOL, rtol=0)


def test_longcat_flash_head_dim_must_be_the_rope_span():
    cfg = make_config("LongcatFlashConfig", **dict(LONGCAT, head_dim=16))
    with pytest.raises(ValueError, match=r"head_dim=16: longcat_flash's rotary class sizes its default table by "
                                         r"head_dim, which must equal qk_rope_head_dim=8"):
        rope_kwargs_from_hf_config(cfg)


def test_mistral4_table_width_must_be_the_rope_span():
    """Its yarn table is head_dim x partial_rotary_factor wide, its default
    one head_dim: each must be qk_rope_head_dim (transformers' own model
    fails on a mismatch; rotary refuses the config)."""
    cfg = make_config("Mistral4Config", **MISTRAL4)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.4 and rotary.RotaryEmbedding.from_hf_config(cfg).dim == 8
    cfg = make_config("Mistral4Config", **dict(MISTRAL4, head_dim=40))
    with pytest.raises(ValueError, match=r"head_dim=40: mistral4's rotary class sizes its yarn table by head_dim x "
                                         r"partial_rotary_factor \(0.4\), which must equal qk_rope_head_dim=8"):
        rope_kwargs_from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"head_dim=20: mistral4's rotary class sizes its default table by head_dim, "
                                         r"which must equal qk_rope_head_dim=8"):
        rope_kwargs_from_hf_config(make_config("Mistral4Config", **dict(MISTRAL4, rope_parameters=DEFAULT)))


def test_dots3_note_span_per_layer_type():
    """Dots3-Note's layer types have their own [nope | rope] heads and tables
    (per_layer_config): each type's config gives its own module, equal to
    transformers' rotation of that type (the sweep's tiny config: nope 8 on
    the indexed layers, 12 on the sliding ones, rope 8, head_dim 20)."""
    from rotary_testing.hf_tiny import _shrink
    from transformers import AutoConfig

    cfg = _shrink(AutoConfig.for_model("dots3_note_text"))
    m = modeling("dots3_note")
    hf_rope = m.Dots3NoteTextRotaryEmbedding(cfg)
    nopes = set()
    for layer_type in sorted(set(cfg.layer_types)):
        layer = cfg.per_layer_config[layer_type]
        rope = rotary.RotaryEmbedding.from_hf_config(layer, layer_type=layer_type)
        nope = layer.qk_nope_head_dim
        nopes.add(nope)
        assert (rope.dim, rope.rotary_offset, rope.interleaved) == (layer.qk_rope_head_dim, nope, True)
        q, k, pos = inputs(nope + rope.dim, False, 5)
        cos, sin = hf_rope(q, pos, layer_type)
        want = [torch.cat([t[..., :nope], r], -1)
                for t, r in zip((q, k), m.apply_rotary_pos_emb_interleave(q[..., nope:], k[..., nope:], cos, sin))]
        for g, w in zip(rope(q, k, position_ids=pos), want):
            torch.testing.assert_close(deinterleave(g, nope), w, atol=ATOL, rtol=0)
    assert len(nopes) == 2  # the two types' spans differ
    with pytest.raises(ValueError, match=r"per_layer_config: dots3_note_text sets .*qk_nope_head_dim.* per layer, "
                                         r"so one table does not serve its layers"):
        rope_kwargs_from_hf_config(cfg, layer_type="sliding_attention")
