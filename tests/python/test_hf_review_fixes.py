"""from_hf_config against transformers' own rotary code where a review found
it silently wrong: MiMo-V2-Flash's scaled rules and top-level
partial_rotary_factor, the Perception Encoder's (2j, 2j+1) pairs, vision
towers' "axial" rules, M-RoPE text models whose sections default in their
rotary class, and configs with no 1-D RoPE at all (refused by name)."""

import copy
import pathlib

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_config import ATOL, SMALL, hf_std, inputs, make_config, modeling

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
SCALED = {"linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "yarn": YARN,
          "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
          "llama3": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
MIMO = dict(SMALL, head_dim=32, num_hidden_layers=2)


def assert_matches(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


# ------------------------------------------------ 1. MiMo-V2-Flash partial share
@pytest.mark.parametrize("rule", sorted(SCALED))
def test_mimo_scaled_rules_rotate_the_whole_head(rule):
    # Its default rule defaults the share to 0.334; ROPE_INIT_FUNCTIONS' rules to 1.0.
    params = {"full_attention": dict(SCALED[rule]), "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = make_config("MiMoV2FlashConfig", **MIMO, rope_parameters=params)
    m = modeling("mimo_v2_flash")
    emb = m.MiMoV2FlashRotaryEmbedding(cfg)
    q, k, pos = inputs(32, False, 3)
    for layer_type, dim in (("full_attention", 32), ("sliding_attention", 10)):
        want = m.apply_rotary_pos_emb(q, k, *emb(q, pos, layer_type))
        rope = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type=layer_type)
        assert rope.dim == dim
        assert_matches(rope(q, k, position_ids=pos), want)


@pytest.mark.parametrize("cls,model_type", [("MiMoV2FlashConfig", "mimo_v2_flash"), ("LagunaConfig", "laguna"),
                                            ("BeamConfig", "beam")])
def test_top_level_partial_that_the_class_never_moves_is_refused(cls, model_type):
    # Their convert_rope_params_to_dict is a no-op: transformers never reads the top-level field.
    params = {t: {"rope_type": "default", "rope_theta": 1e4} for t in ("full_attention", "sliding_attention")}
    cfg = make_config(cls, **MIMO, layer_types=["full_attention", "sliding_attention"], rope_parameters=params,
                      partial_rotary_factor=0.5)
    assert "partial_rotary_factor" not in cfg.rope_parameters["full_attention"]
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=rf"partial_rotary_factor=0.5 at the top level: transformers' "
                                             rf"{model_type} config class never moves it"):
            rope_kwargs_from_hf_config(given, layer_type="full_attention")
    if model_type != "beam":  # (Beam's default rule never reads it: refused there anyway)
        # In the layer type's own dict it is read, as transformers reads it.
        cfg.rope_parameters["full_attention"]["partial_rotary_factor"] = 0.5
        assert rope_kwargs_from_hf_config(cfg, layer_type="full_attention")["dim"] == 16


def test_mimo_patched_model_with_a_scaled_rule_matches_unpatched():
    from rotary.integrations.transformers import apply_rotary_to_model, unpatch

    cfg = make_config("MiMoV2FlashConfig", **dict(
        MIMO, vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "dense"],
        rope_parameters={"full_attention": dict(YARN), "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 1e4}}))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MiMoV2FlashForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        apply_rotary_to_model(model)
        try:
            got = model(ids).logits
        finally:
            unpatch(model)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


# ------------------------------------------------ 2. Perception Encoder pairing
PE = [("pe_audio", "PeAudioEncoderConfig", "PeAudioEncoderRotaryEmbedding"),
      ("pe_video", "PeVideoEncoderConfig", "PeVideoEncoderRotaryEmbedding"),
      ("pe_audio_video", "PeAudioVideoEncoderConfig", "PeAudioVideoEncoderRotaryEmbedding")]


@pytest.mark.parametrize("mt,cls,rot", PE, ids=[p[0] for p in PE])
def test_perception_encoder_pairs_two_j(mt, cls, rot):
    cfg = make_config(cls, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=1, intermediate_size=32)
    q, k, pos = inputs(16, False, 5)
    want = hf_std(mt, rot)(cfg, q, k, pos)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert rope.interleaved
    assert_matches(rope(q, k, position_ids=pos), want)
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)


# ------------------------------------------------ 3. vision "axial" rules
def test_pixtral_axial_matches_transformers():
    m = modeling("pixtral")
    cfg = make_config("PixtralVisionConfig", hidden_size=64, num_attention_heads=4, intermediate_size=32,
                      num_hidden_layers=1)
    g = torch.Generator().manual_seed(0)
    hw = torch.randint(0, 30, (12, 2), generator=g)  # (h, w) per patch
    cos, sin = m.PixtralVisionRotaryEmbedding(cfg)(torch.zeros(1), hw)
    q, k = torch.randn(1, 4, 12, 16, generator=g), torch.randn(1, 4, 12, 16, generator=g)
    want = m.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert_matches(rope(q, k, position_ids=hw.T[:, None, :]), want)


# Qwen2-VL's kin are served (test_hf_vision_axial.py); these lay their tables out otherwise.
AXIAL = [("Gemma4VisionConfig", "gemma4_vision", {}), ("MiniMaxM3VLVisionConfig", "minimax_m3_vl_vision", {})]


@pytest.mark.parametrize("cls,model_type,kw", AXIAL, ids=[a[1] for a in AXIAL])
def test_unverified_axial_vision_is_refused_by_name(cls, model_type, kw):
    cfg = make_config(cls, **kw)
    assert cfg.model_type == model_type
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=rf"rope_type 'axial' of model_type {model_type!r} is not supported"):
            rope_kwargs_from_hf_config(given)


# ------------------------------------------------ 4. no 1-D RoPE: refused
NO_ROPE = [("Qwen2_5OmniDiTConfig", {}, r"model_type 'qwen2_5_omni_dit' is not supported: .*head 0"),
           ("DINOv3ViTConfig", {}, r"model_type 'dinov3_vit' is not supported: 2-D RoPE"),
           ("Sapiens2Config", {}, r"model_type 'sapiens2' is not supported: 2-D RoPE"),
           ("Llama4VisionConfig", {}, r"model_type 'llama4_vision_model' is not supported: 2-D RoPE"),
           ("MptConfig", {}, r"model_type 'mpt' is not supported: ALiBi"),
           ("DetrConfig", {}, r"model_type 'detr' is not supported: no RoPE"),
           ("FalconConfig", {"alibi": True}, r"falcon with alibi=True uses ALiBi"),
           ("GraniteMoeHybridConfig", {"position_embedding_type": None},
            r"granitemoehybrid with position_embedding_type=None builds no rotary embedding"),
           ("GPT2Config", {}, r"model_type 'gpt2' is not supported: no RoPE"),
           # Found by the modeling code, not by name: it has no rotary code at all.
           *[(cls, {}, rf"model_type '{mt}' is not supported: transformers' modeling code for it has no rotary "
                       r"embedding") for cls, mt in (("XLMRobertaConfig", "xlm-roberta"), ("T5Config", "t5"),
                                                     ("BartConfig", "bart"), ("DebertaV2Config", "deberta-v2"),
                                                     ("Wav2Vec2Config", "wav2vec2"), ("Mamba2Config", "mamba2"))]]


@pytest.mark.parametrize("cls,kw,match", NO_ROPE, ids=[n[0] for n in NO_ROPE])
def test_configs_without_1d_rope_are_refused_by_name(cls, kw, match):
    cfg = make_config(cls, **kw)
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=match):
            rope_kwargs_from_hf_config(given)


def test_falcon_and_granitemoehybrid_with_rope_are_still_served():
    for cfg in (make_config("FalconConfig", alibi=False),
                make_config("GraniteMoeHybridConfig", position_embedding_type="rope")):
        assert rope_kwargs_from_hf_config(cfg)["dim"] > 0


# ------------------------------------------------ 6. M-RoPE sections defaulted by the rotary class
MROPE = [  # (modeling module, config class, rotary class, kwargs, head dim), no mrope_section given
    ("glm_image", "GlmImageTextConfig", "GlmImageTextRotaryEmbedding",
     dict(SMALL, hidden_size=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}), 128),
    ("glm4v_moe", "Glm4vMoeTextConfig", "Glm4vMoeTextRotaryEmbedding", dict(SMALL, hidden_size=512, n_routed_experts=2),
     128),
    ("paddleocr_vl", "PaddleOCRTextConfig", "PaddleOCRRotaryEmbedding", dict(SMALL, head_dim=128), 128),
    ("qwen2_5_omni", "Qwen2_5OmniTextConfig", "Qwen2_5OmniRotaryEmbedding", dict(SMALL, hidden_size=512), 128),
    ("qwen2_5_omni", "Qwen2_5OmniTalkerConfig", "Qwen2_5OmniRotaryEmbedding", dict(SMALL, hidden_size=512), 128),
    ("qwen3_vl_moe", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextRotaryEmbedding", dict(SMALL, head_dim=128), 128),
    ("qwen3_omni_moe", "Qwen3OmniMoeTextConfig", "Qwen3OmniMoeThinkerTextRotaryEmbedding",
     dict(SMALL, head_dim=128), 128),
    ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextConfig", "Qwen3OmniMoeTalkerRotaryEmbedding",
     dict(SMALL, head_dim=128), 128),
    ("cosmos3_edge", "Cosmos3EdgeTextConfig", "Cosmos3EdgeTextRotaryEmbedding", dict(SMALL, head_dim=128), 128),
]


@pytest.mark.parametrize("case", MROPE, ids=[c[1] for c in MROPE])
def test_mrope_text_with_the_rotary_class_sections(case):
    mt, cls, rot, kw, head_dim = case
    cfg = make_config(cls, **kw)
    cfg.rope_parameters.pop("mrope_section", None)  # the rotary class's own default, as a config may omit it
    q, k, pos = inputs(head_dim, True, 9)
    want = hf_std(mt, rot)(cfg, q, k, pos)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert_matches(rope(q, k, position_ids=pos), want)


# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {"pe_audio_encoder", "pe_video_encoder", "pe_audio_video_encoder", "glm_image_text", "glm4v_moe_text",
          "paddleocr_vl_text", "qwen2_5_omni_text", "qwen2_5_omni_talker", "qwen3_vl_moe_text",
          "qwen3_omni_moe_text", "qwen3_omni_moe_talker_text", "cosmos3_edge_text"}


# ------------------------------------------------ 5. the docs' pairing claim
def test_docs_do_not_claim_rotate_half_for_every_family():
    pairs = {c.model_type: rope_kwargs_from_hf_config(c)["interleaved"] for c in (
        make_config("GPTJConfig", n_embd=64, n_head=4, rotary_dim=8), make_config("CohereConfig"),
        make_config("DeepseekV3Config"), make_config("LlamaConfig"))}
    assert pairs == {"gptj": True, "cohere": True, "deepseek_v3": True, "llama": False}
    scaling = (ROOT / "docs" / "scaling.md").read_text()
    assert "It uses `interleaved=False`, transformers' `rotate_half` pairing" not in scaling
    assert "rotate_half for the verified families" not in (ROOT / "docs" / "transformers.md").read_text()
