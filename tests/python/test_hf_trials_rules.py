"""from_hf_config on the configs a trial found silently wrong, continued from
test_hf_trials.py (which holds the shared helpers): rule names and keys as
transformers' config classes rewrite them, and the sub-models of packages
that rotate elsewhere, refused by name."""

import importlib

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_trials import SMALL, assert_same_rule, config, modeling

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


# ------------------------------------------------------ rule names and keys
@pytest.mark.parametrize("name", ["yarn", "su"])
def test_phi3_renames_its_old_rules_to_longrope(name):
    d = dict(SMALL, model_type="phi3", max_position_embeddings=4096, original_max_position_embeddings=256,
             rope_theta=1e4, rope_scaling={"type": name, "original_max_position_embeddings": 256,
                                           "short_factor": [1.0 + 0.05 * j for j in range(8)],
                                           "long_factor": [1.0 + 1.7 * j for j in range(8)]})
    cfg = config("Phi3Config", **d)
    theirs = modeling("phi3").Phi3RotaryEmbedding(cfg)
    for given in (d, cfg):
        ours = rotary.RotaryEmbedding.from_hf_config(given)
        assert ours.scaling["rope_type"] == "longrope"
        assert_same_rule(ours, theirs)


def test_a_shipped_qwen2_vl_config_is_read():
    """rope_scaling {"type": "mrope"} beside the rope_type "default" transformers adds."""
    cfg = config("Qwen2VLTextConfig", **SMALL, rope_theta=1e6,
                 rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert ours.mrope_section == [2, 3, 3]
    assert_same_rule(ours, modeling("qwen2_vl").Qwen2VLRotaryEmbedding(cfg))


def gemma3(full):
    return config("Gemma3TextConfig", **dict(SMALL, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                             sliding_window=512, original_max_position_embeddings=32,
                                             rope_parameters={"full_attention": full, "sliding_attention": {
                                                 "rope_type": "default", "rope_theta": 1e4}}))


def test_a_layer_types_rule_keeps_its_own_original_max_position_embeddings():
    """Nested, transformers only fills it in; the top-level 32 is not read."""
    cfg = gemma3({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64})
    ours = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type="full_attention")
    assert ours.scaling["original_max_position_embeddings"] == 64
    emb = modeling("gemma3").Gemma3RotaryEmbedding(cfg)
    torch.testing.assert_close(ours.inv_freq, emb.full_attention_inv_freq.double(), rtol=1e-6, atol=0)


def test_truncate_in_a_layer_types_yarn_rule_is_refused():
    """transformers reads truncate from the top-level dict only."""
    cfg = gemma3({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
                  "truncate": False})
    with pytest.raises(ValueError, match=r"truncate=False in a layer type's yarn rule"):
        rotary.RotaryEmbedding.from_hf_config(cfg, layer_type="full_attention")


def test_yarn_truncate_none_does_not_truncate():
    """transformers' .get("truncate", True) is None: falsy."""
    params = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
              "truncate": None}
    cfg = config("LlamaConfig", **SMALL, rope_parameters=params)
    ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert ours.scaling["truncate"] is False
    assert_same_rule(ours, modeling("llama").LlamaRotaryEmbedding(cfg))


def test_esm_rotates_only_with_rotary_positions_and_its_top_level_base():
    """EsmRotaryEmbedding exists only under position_embedding_type="rotary"
    and reads the top-level rope_theta alone: a rule given anyway is never
    read, so it is refused rather than served."""
    from transformers.models.esm import modeling_esm as m

    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32, vocab_size=33)
    with pytest.raises(ValueError, match=r"esm with position_embedding_type='absolute' builds no rotary embedding"):
        rope_kwargs_from_hf_config(config("EsmConfig", **small))
    cfg = config("EsmConfig", **small, position_embedding_type="rotary", rope_theta=500.0)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16)
    pos = torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    cos, sin = m.EsmRotaryEmbedding(config=cfg)(q, pos)
    want = m.apply_rotary_pos_emb(q, k, cos, sin)
    for given in (cfg, cfg.to_dict()):
        got = rotary.RotaryEmbedding.from_hf_config(given)(q, k, position_ids=pos)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=3e-5, rtol=0)
    ruled = config("EsmConfig", **small, position_embedding_type="rotary", rope_parameters={"rope_type": "linear",
                                                                                           "factor": 2.0})
    for given in (ruled, ruled.to_dict()):
        with pytest.raises(ValueError, match=r"esm's rotary class reads only the top-level rope_theta"):
            rope_kwargs_from_hf_config(given)


# Sub-models of packages that rotate elsewhere, and the class transformers builds from each.
NO_ROPE_SUB_MODELS = {
    "moshi_depth": ("moshi", "MoshiDepthDecoder"),
    "idefics_vision": ("idefics.vision", "IdeficsVisionTransformer"),
    "mllama_vision_model": ("mllama", "MllamaVisionModel"),
    "qwen2_5_omni_audio_encoder": ("qwen2_5_omni", "Qwen2_5OmniAudioEncoder"),
    "phi4_multimodal_vision": ("phi4_multimodal", "Phi4MultimodalVisionModel"),
    "sam2_video_mask_decoder": ("sam2_video", "Sam2VideoMaskDecoder"),
    "hunyuan_vl_vision": ("hunyuan_vl", "HunYuanVLVisionTransformer"),
    "unlimited_ocr_vision_encoder": ("unlimited_ocr", "UnlimitedOcrVisionEncoder"),
    "gemma4_audio": ("gemma4", "Gemma4AudioModel"),
}


@pytest.mark.parametrize("model_type", sorted(NO_ROPE_SUB_MODELS))
def test_a_sub_model_without_rotary_embedding_is_refused(model_type):
    """Their packages rotate in the text model, so their modeling code has
    rotary code; the model built from these configs has none (built on meta)."""
    package, name = NO_ROPE_SUB_MODELS[model_type]
    module = package if "." in package else f"{package}.modeling_{package}"
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    cfg = transformers.CONFIG_MAPPING[model_type]()
    with torch.device("meta"):
        model = cls(cfg)
    rotary_modules = [n for n, sub in model.named_modules() if "Rotary" in type(sub).__name__]
    rotary_modules += [n for n, sub in model.named_modules() if getattr(sub, "rotary_emb", None) is not None]
    assert not rotary_modules
    with pytest.raises(ValueError, match=rf"model_type '{model_type}' is not supported: the model transformers builds "
                                         r"from it has no rotary embedding"):
        rope_kwargs_from_hf_config(cfg)


def test_the_no_rope_sub_models_are_transformers_model_types():
    from rotary._hf_refusals import NOT_1D

    listed = {mt for mt, why in NOT_1D.items() if "has no rotary embedding" in why}
    assert set(NO_ROPE_SUB_MODELS) <= listed
    assert listed <= set(transformers.CONFIG_MAPPING)


def test_diffusion_gemma_refuses_a_share_its_attention_cannot_run():
    # Its default rule reads the share, but its attention rotates the whole
    # head with the narrower table (transformers fails).
    rp = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
          "full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    cfg = transformers.CONFIG_MAPPING["diffusion_gemma_text"](
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, num_experts=4, moe_intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rp)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.25: transformers' diffusion_gemma_text rotary "
                                         r"class builds a table int\(head_dim \* partial_rotary_factor\) wide, but "
                                         r"its attention rotates the whole head"):
        rope_kwargs_from_hf_config(cfg.per_layer_config["full_attention"], layer_type="full_attention")
