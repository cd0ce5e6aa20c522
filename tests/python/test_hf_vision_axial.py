"""from_hf_config for vision towers whose "axial" rule gives h and w each its
own spectrum over half the head (Qwen2-VL's vision tower and its kin,
hf_families.AXIAL_OWN): rotary's axes_dim [head_dim / 2, head_dim / 2] under
rotate_half. Each against its own rotary class and apply_rotary_pos_emb_vision,
with its config object and its dict, at another base than the default."""

import copy
import importlib
import inspect

import pytest
import torch

import rotary
from rotary import hf_families
from rotary.hf import rope_kwargs_from_hf_config

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

N, HEADS = 24, 2


def _modeling(config):
    return importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))


def _rotary_class(module):
    (cls,) = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and "Vision" in n]
    return cls


SERVED_TOWERS = [
    "cohere_compass_vision", "dots3_note_vision_encoder", "ernie4_5_vl_moe_vision", "exaone4_5_vision",
    "glm4v_moe_vision", "glm4v_vision", "glm5_next_vision", "glm_ocr_vision", "lfm3_vl_vision",
    "muse_glimmer_vision", "muse_spark_vision", "paddleocr_vl_vision", "qwen2_5_omni_vision_encoder",
    "qwen2_5_vl_vision", "qwen2_vl_vision", "qwen3_5_moe_vision", "qwen3_5_vision", "qwen3_omni_moe_vision_encoder",
    "qwen3_vl_moe_vision", "qwen3_vl_vision", "qwen4_exp_vision", "video_llama_3_vision",
]


def test_the_served_towers_are_named_here():
    """The tower tests below are drawn from the table they test: a tower dropped
    from it would drop its test too, so the list is pinned here."""
    assert sorted(hf_families.AXIAL_OWN) == sorted(SERVED_TOWERS)


@pytest.mark.parametrize("model_type", sorted(hf_families.AXIAL_OWN))
def test_tower_matches_transformers(model_type):
    config = transformers.CONFIG_MAPPING[model_type]()
    config.rope_parameters = dict(config.rope_parameters, rope_theta=500.0)  # the base must flow through
    module = _modeling(config)
    # Its attention rotates through the function compared here.
    assert "apply_rotary_pos_emb_vision(" in inspect.getsource(module).split("def apply_rotary_pos_emb_vision", 1)[1]
    g = torch.Generator().manual_seed(7)
    hw = torch.randint(0, 48, (N, 2), generator=g)  # (h, w) per patch
    theirs = _rotary_class(module)(config)
    width = 4 * theirs.inv_freq.shape[0]
    q, k = (torch.randn(N, HEADS, width, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = theirs(q, hw)
    want = module.apply_rotary_pos_emb_vision(q, k, cos, sin)
    for given in (config, config.to_dict()):
        kw = rope_kwargs_from_hf_config(given)
        assert (kw["dim"], kw["theta"], kw["interleaved"]) == (width, 500.0, False)
        assert kw["axes_dim"] == [width // 2, width // 2] and not kw.get("axes_shared_spectrum")
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        got = rope(q[None], k[None], position_ids=hw.T[:, None, :], layout="BSHD")  # [1, N, heads, width]
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_[0], w_.double(), atol=2e-5, rtol=0)
    # The layout matters: Pixtral's shared spectrum or (2j, 2j+1) pairs miss by far.
    for other in (dict(kw, axes_shared_spectrum=True), dict(kw, interleaved=True)):
        miss = rotary.RotaryEmbedding(**other)(q[None], position_ids=hw.T[:, None, :], layout="BSHD")[0]
        assert (miss - want[0]).abs().max() > 1e-2


def test_qwen2_vl_tower_cuts_heads_from_embed_dim():
    # Its hidden_size is the merger's output width; its heads are embed_dim / num_heads wide.
    config = transformers.Qwen2VLVisionConfig(embed_dim=320, hidden_size=1024, num_heads=4)
    assert rope_kwargs_from_hf_config(config)["dim"] == 80
    assert rope_kwargs_from_hf_config(config.to_dict())["dim"] == 80
    with pytest.raises(ValueError, match=r"the config has no head_dim, and no embed_dim and num_attention_heads"):
        rope_kwargs_from_hf_config({"model_type": "qwen2_vl_vision", "hidden_size": 1536, "num_heads": 16,
                                    "rope_parameters": {"rope_type": "axial", "rope_theta": 1e4}})


def test_a_share_is_not_read_and_a_narrower_table_is_refused():
    module = _modeling(transformers.Qwen2_5_VLVisionConfig())
    # Its axial rule never reads partial_rotary_factor: the whole head turns, in transformers too.
    config = transformers.Qwen2_5_VLVisionConfig(hidden_size=320, num_heads=4)
    config.rope_parameters = dict(config.rope_parameters, partial_rotary_factor=0.5)
    assert 4 * _rotary_class(module)(config).inv_freq.shape[0] == 80
    assert rope_kwargs_from_hf_config(config)["dim"] == 80
    # A head_dim other than hidden_size / num_heads: its table and its heads differ, and transformers fails.
    config = transformers.Qwen2_5_VLVisionConfig(hidden_size=320, num_heads=4, head_dim=64)
    with pytest.raises(ValueError, match=r"head_dim=64: transformers' qwen2_5_vl_vision rotary class builds its table "
                                         r"head_dim wide, but its attention cuts heads hidden_size / num_heads = 80"):
        rope_kwargs_from_hf_config(config)


@pytest.mark.parametrize("model_type", ["gemma4_vision", "minimax_m3_vl_vision", "kimi_k25_vision", "step3p5_vision",
                                        "inkling2_vision"])
def test_other_towers_stay_refused(model_type):
    # Laid out otherwise (t, h, w axes; 2-D interleaved tables; other widths): refused by name.
    config = transformers.CONFIG_MAPPING[model_type]()
    for given in (config, config.to_dict()):
        with pytest.raises(ValueError, match=rf"rope_type 'axial' of model_type {model_type!r} is not supported"):
            rope_kwargs_from_hf_config(given)
    assert model_type not in hf_families.AXIAL_OWN


def test_a_scaled_rule_on_a_tower_is_refused():
    config = copy.deepcopy(transformers.CONFIG_MAPPING["qwen2_5_vl_vision"]())
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"rope_type 'linear' for model_type 'qwen2_5_vl_vision': its rotary class "
                                         r"runs only its axial rule"):
        rope_kwargs_from_hf_config(config)


# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = set(hf_families.AXIAL_OWN)
