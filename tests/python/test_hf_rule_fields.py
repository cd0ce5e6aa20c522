"""from_hf_config on rule fields where a review found it served numbers that
transformers does not: a top-level partial_rotary_factor over a proportional
rule keyed by layer type (transformers' rule reads it there), a partial share
under a scaled rule of a family whose attention rotates the whole head (it
fails in transformers), and configs transformers' validation refuses. Each
case runs transformers' own code as the judge."""

import copy

import pytest
import torch

import rotary
from test_hf_config import ATOL, inputs, make_config, modeling

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "rope_theta": 10000.0}
PHI3 = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "pad_token_id": 0, "max_position_embeddings": 256, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}
SF, LF = [1.0] * 8, [2.0] * 8


def test_top_level_share_reaches_a_layer_types_proportional_rule():
    d = dict(model_type="gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], intermediate_size=64,
             vocab_size=32, max_position_embeddings=64, partial_rotary_factor=0.25,
             rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg = make_config("Gemma3TextConfig", **{k: v for k, v in copy.deepcopy(d).items() if k != "model_type"})
    ours = [rotary.RotaryEmbedding.from_hf_config(given, layer_type="full_attention")
            for given in (copy.deepcopy(cfg), copy.deepcopy(d))]
    m = modeling("gemma3")
    q, k, pos = inputs(16, False, 21)
    want = m.apply_rotary_pos_emb(q, k, *m.Gemma3RotaryEmbedding(cfg)(q, pos, "full_attention"))
    for rope in ours:
        assert rope.inv_freq[2:].eq(0).all() and rope.inv_freq[:2].ne(0).all()  # 2 of 8 pairs turn
        for got, w in zip(rope(q, k, position_ids=pos), want):
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("rule", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("cls,mt", [("LlamaConfig", "llama"), ("Qwen2Config", "qwen2")])
def test_a_share_under_a_scaled_rule_of_a_whole_head_family_is_refused(cls, mt, rule):
    cfg = make_config(cls, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      rope_parameters=dict(rule, rope_theta=1e4, partial_rotary_factor=0.5))
    m = modeling(mt)
    q, k, pos = inputs(16, False, 22)
    cos, sin = getattr(m, f"{cls[:-6]}RotaryEmbedding")(cfg)(q, pos)
    with pytest.raises(RuntimeError, match="must match the size"):  # transformers cannot run it
        m.apply_rotary_pos_emb(q, k, cos, sin)
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=rf"partial_rotary_factor=0.5: transformers' {mt} attention is not "
                                             rf"known to slice a narrower table \(the {rule['rope_type']} rule"):
            rotary.RotaryEmbedding.from_hf_config(given)


REFUSED = [  # (base config, rope_scaling, what rotary names)
    (LLAMA, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
     r"the llama3 rule lacks low_freq_factor, high_freq_factor"),
    (LLAMA, {"rope_type": "yarn", "original_max_position_embeddings": 64}, r"the yarn rule lacks factor"),
    (LLAMA, {"rope_type": "dynamic"}, r"the dynamic rule lacks factor"),
    (LLAMA, {"rope_type": "longrope", "short_factor": SF, "original_max_position_embeddings": 64},
     r"the longrope rule lacks long_factor"),
    (LLAMA, {"rope_type": None, "type": "linear", "factor": 2.0}, r"rope_type None: transformers keeps it"),
    (LLAMA, {"rope_type": "linear", "factor": 2.0, "rope_theta": None}, r"rope_parameters\['rope_theta'\] is None"),
    (LLAMA, {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": None},
     r"rope_parameters\['partial_rotary_factor'\] is None"),
    (dict(LLAMA, rope_theta=None), {"rope_type": "linear", "factor": 2.0}, r"rope_theta is None: transformers' config "
                                                                         r"class puts it into the rule"),
    (PHI3, {"rope_type": "linear", "factor": 2.0}, r"rope_type 'linear': transformers' phi3 accepts "
                                                    r"only default / longrope"),
    (PHI3, {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1, "high_freq_factor": 4,
            "original_max_position_embeddings": 64}, r"rope_type 'llama3': .* accepts only default / longrope"),
    (PHI3, {"type": "su", "short_factor": SF, "long_factor": LF},
     r"rope_type 'su' without original_max_position_embeddings in the rule"),
]


@pytest.mark.parametrize("base,rule,match", REFUSED, ids=[f"{b['model_type']}-{i}" for i, (b, _, _) in
                                                           enumerate(REFUSED)])
def test_configs_transformers_refuses_are_refused_by_name(base, rule, match):
    d = dict(base, rope_scaling=rule)
    with pytest.raises(Exception):  # transformers: its config validation, or its rotary class, fails
        cfg = transformers.CONFIG_MAPPING[d["model_type"]](**{k: v for k, v in copy.deepcopy(d).items()
                                                             if k != "model_type"})
        m = modeling(d["model_type"])
        rot = getattr(m, "LlamaRotaryEmbedding" if d["model_type"] == "llama" else "Phi3RotaryEmbedding")(cfg)
        rot(torch.zeros(1), torch.arange(4)[None])
    with pytest.raises(ValueError, match=match):
        rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(d))


@pytest.mark.parametrize("rule", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0}])
def test_sarvam_moe_rotates_a_partial_span_as_glm4_moe(rule):
    """Sarvam-MoE runs Glm4MoeForCausalLM, whose rotary class and attention
    take partial_rotary_factor: served (the review found it refused)."""
    cfg = make_config("SarvamMoEConfig", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                      rope_parameters=dict(rule, rope_theta=1e4, partial_rotary_factor=0.5))
    m = modeling("glm4_moe")
    q, k, pos = inputs(16, False, 24)
    want = m.apply_rotary_pos_emb(q, k, *m.Glm4MoeRotaryEmbedding(cfg)(q, pos))
    for given in (cfg, cfg.to_dict()):
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        assert rope.dim == 8
        for got, w in zip(rope(q, k, position_ids=pos), want):
            torch.testing.assert_close(got, w, atol=ATOL, rtol=0)


def test_the_served_forms_of_those_rules_still_match():
    """The same rules with their required keys (and Phi-3's su with its own
    original length) are served, to transformers' numbers."""
    cases = [(LLAMA, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "llama", "LlamaRotaryEmbedding"),
             (PHI3, {"type": "su", "short_factor": SF, "long_factor": LF, "original_max_position_embeddings": 64},
              "phi3", "Phi3RotaryEmbedding")]
    for base, rule, mt, rot in cases:
        d = dict(base, rope_scaling=rule)
        cfg = transformers.CONFIG_MAPPING[mt](**{k: v for k, v in copy.deepcopy(d).items() if k != "model_type"})
        m = modeling(mt)
        q, k, _ = inputs(16, False, 23)
        pos = torch.arange(100, 107).expand(2, 7)  # past the original length: the long factors
        want = m.apply_rotary_pos_emb(q, k, *getattr(m, rot)(cfg)(q, pos))
        for given in (cfg, copy.deepcopy(d)):
            got = rotary.RotaryEmbedding.from_hf_config(given)(q, k, position_ids=pos)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def _solar_open(rope_parameters):
    return make_config("SolarOpenConfig", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=128, max_position_embeddings=128, num_hidden_layers=1,
                       moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                       rope_parameters=rope_parameters)


def test_a_share_where_the_attention_rotates_the_whole_head_is_refused():
    """SolarOpen's rotary class reads partial_rotary_factor, its attention
    does not slice the narrower table: transformers fails, rotary served it."""
    cfg = _solar_open({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    model = transformers.AutoModel.from_config(cfg).eval()
    with pytest.raises(RuntimeError, match="must match the size"), torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5: transformers' solar_open rotary class "
                                             r"builds a table .* but its attention rotates the whole head"):
            rotary.RotaryEmbedding.from_hf_config(given)
    whole = _solar_open({"rope_type": "default", "rope_theta": 1e6})  # the whole head: served
    assert rotary.RotaryEmbedding.from_hf_config(whole).dim == 16


def test_a_vision_tower_runs_only_its_axial_rule():
    """Vision towers whose class makes "default" axial: another rule fails in
    transformers ("supports only axial rope") and was served as a 1-D RoPE; a
    Pixtral dict without rope_parameters is read as its class reads it."""
    kw = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1)
    cfg = make_config("Qwen2_5_VLVisionConfig", **kw, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e4})
    with pytest.raises(ValueError, match="supports only axial rope"):
        transformers.AutoModel.from_config(cfg)
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=r"rope_type 'linear' for model_type 'qwen2_5_vl_vision': its rotary "
                                             r"class runs only its axial rule"):
            rotary.RotaryEmbedding.from_hf_config(given)
    pixtral = make_config("PixtralVisionConfig", **kw)
    bare = {k: v for k, v in pixtral.to_dict().items() if k != "rope_parameters"}
    from rotary.hf import rope_kwargs_from_hf_config
    assert rope_kwargs_from_hf_config(bare) == rope_kwargs_from_hf_config(pixtral)
    assert rope_kwargs_from_hf_config(pixtral)["axes_dim"]
