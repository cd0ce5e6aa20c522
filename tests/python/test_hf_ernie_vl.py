"""from_hf_config for ERNIE-4.5-VL's text model: (2j, 2j+1) pairs whose
frequencies its class pre-permutes so that h and w alternate over the first
pairs and t takes the rest, served as an explicit pair_axes. Against
transformers' own rotary class and apply function, with the config object,
its dict and the composite; what its class cannot run is refused by name.
The whole model, patched, is in the HF sweep (rotary_testing.hf_tiny)."""

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_config import ATOL, SMALL, inputs, make_config, modeling
from test_hf_review_fixes import assert_matches

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

MT = "ernie4_5_vl_moe"


def _config(**params):
    rope = dict({"rope_type": "default", "rope_theta": 1e4}, **params)
    return make_config("Ernie4_5_VLMoeTextConfig", **dict(SMALL, hidden_size=512), rope_parameters=rope)


def _theirs(cfg, q, k, pos):
    m = modeling(MT)
    cos, sin = m.Ernie4_5_VLMoeTextRotaryEmbedding(config=cfg)(q, pos)
    return m.apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("sections", [None, [16, 16, 32], [30, 30, 4]])
def test_text_model_matches_transformers(sections):
    cfg = _config(**({} if sections is None else {"mrope_section": sections}))  # None: the class's (22, 22, 20)
    q, k, pos = inputs(128, True, 31)
    want = _theirs(cfg, q, k, pos)
    h, _, t = sections or (22, 22, 20)
    for given in (cfg, cfg.to_dict()):
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        assert rope.dim == 128 and rope.interleaved and rope.mrope_section is None
        assert rope.pair_axes == [1, 2] * h + [0] * t
        assert_matches(rope(q, k, position_ids=pos), want)
        # Text tokens ([B, S] ids, which its model expands to three equal rows).
        text = pos[0]
        assert_matches(rope(q, k, position_ids=text), _theirs(cfg, q, k, text.expand(3, *text.shape)))


def test_the_map_matters():
    # The same sections chunked (Qwen2-VL's layout), or the pairs rotate_half'd, miss by far.
    cfg = _config()
    q, k, pos = inputs(128, True, 32)
    want = _theirs(cfg, q, k, pos)
    kw = rope_kwargs_from_hf_config(cfg)
    others = [dict(kw, interleaved=False),
              {key: v for key, v in kw.items() if key != "pair_axes"} | {"mrope_section": [22, 22, 20]}]
    for other in others:
        got = rotary.RotaryEmbedding(**other)(q, k, position_ids=pos)
        assert (got[0] - want[0]).abs().max() > 100 * ATOL


def test_composite_reads_its_text_config():
    text = dict(SMALL, hidden_size=512, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg = make_config("Ernie4_5_VLMoeConfig", text_config=text)
    for given in (cfg, cfg.to_dict()):
        assert rope_kwargs_from_hf_config(given) == rope_kwargs_from_hf_config(cfg.text_config)
    assert rope_kwargs_from_hf_config(cfg)["theta"] == 5e5
    # The class default base (500000) where the config gives none; a dict without it is refused.
    assert rotary.RotaryEmbedding.from_hf_config(make_config("Ernie4_5_VLMoeTextConfig")).theta == 5e5
    bare = dict(SMALL, model_type="ernie4_5_vl_moe_text")
    with pytest.raises(ValueError, match=r"rope_theta"):
        rope_kwargs_from_hf_config(bare)


@pytest.mark.parametrize("params,match", [
    ({"mrope_section": [20, 24, 20]}, r"mrope_section=\[20, 24, 20\]: transformers' ernie4_5_vl_moe_text pairs h "
                                      r"with w and needs \(h, w, t\) with h == w, t >= 1 and h \+ w \+ t = "
                                      r"head_dim / 2 = 64; it fails on others"),
    # transformers runs it (every pair by t), rotary's map cannot say it.
    ({"mrope_section": [0, 0, 64]}, r"mrope_section=\[0, 0, 64\]: every pair turns by t, which rotary's pair_axes "
                                    r"cannot say"),
    ({"mrope_section": None}, r"rope_parameters\['mrope_section'\] is None: transformers' ernie4_5_vl_moe_text "
                              r"fails on it; drop the key for its default sections \[22, 22, 20\]"),
    ({"mrope_section": 22}, r"mrope_section must be a list of ints, got 22"),
    ({"mrope_section": [32, 32, 0]}, r"mrope_section=\[32, 32, 0\]: .* t >= 1"),
    ({"mrope_section": [8, 8, 8]}, r"h \+ w \+ t = head_dim / 2 = 64"),
    ({"mrope_section": [16, 16]}, r"mrope_section=\[16, 16\]"),
    ({"mrope_section": [22, 22, 20], "mrope_interleaved": True}, r"mrope_interleaved'\]=True is not read by "
                                                                 r"transformers' ernie4_5_vl_moe_text"),
    ({"rope_type": "linear", "factor": 2.0}, r"rope_type 'linear': transformers' ernie4_5_vl_moe_text accepts only default"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
])
def test_what_its_class_cannot_run_is_refused(params, match):
    with pytest.raises(ValueError, match=match):
        rotary.RotaryEmbedding.from_hf_config(_config(**params))


# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {"ernie4_5_vl_moe_text"}
