"""from_hf_config for families served once their own rotary class and apply
function were read and matched here: GLM-4.1V / GLM-OCR text (chunked M-RoPE
sections, (2j, 2j+1) pairs, a partial span) and Moonshine's decoders ((2j,
2j+1) pairs from repeat_interleave'd halves). Each against transformers' own
code, in every rule, with the config object and its dict."""

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_config import ATOL, SMALL, inputs, make_config, modeling
from test_hf_review_fixes import SCALED, assert_matches

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

RULES = {"default": {"rope_type": "default", "rope_theta": 1e4}, **SCALED}  # dynamic: below its switch point

# (modeling module, config class, rotary class)
GLM = [("glm4v", "Glm4vTextConfig", "Glm4vTextRotaryEmbedding"),
       ("glm_ocr", "GlmOcrTextConfig", "GlmOcrTextRotaryEmbedding")]
MOONSHINE = [("moonshine", "MoonshineConfig", "MoonshineRotaryEmbedding"),
             ("moonshine_streaming", "MoonshineStreamingConfig", "MoonshineStreamingRotaryEmbedding")]


def _theirs(mt, rot, cfg, q, k, pos):
    m = modeling(mt)
    cos, sin = getattr(m, rot)(config=cfg)(q, pos)
    return m.apply_rotary_pos_emb(q, k, cos, sin)


def _check(mt, rot, cfg, head_dim, nd, seed):
    q, k, pos = inputs(head_dim, nd, seed)
    want = _theirs(mt, rot, cfg, q, k, pos)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert rope.interleaved
    assert_matches(rope(q, k, position_ids=pos), want)
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)
    return rope, (q, k, pos), want


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mt,cls,rot", GLM, ids=[g[0] for g in GLM])
def test_glm_vision_text_models(mt, cls, rot, rule):
    params = dict(RULES[rule], partial_rotary_factor=0.5)  # GLM-4.1V's own share: 64 of 128 dims
    cfg = make_config(cls, **dict(SMALL, hidden_size=512), rope_parameters=params)
    assert cfg.model_type == f"{mt}_text" and "mrope_section" not in cfg.rope_parameters  # the class's (8, 12, 12)
    rope, (q, k, pos), want = _check(mt, rot, cfg, 128, True, 11)
    assert rope.dim == 64
    # The pairing matters: rotate_half's pairs miss transformers by far.
    kw = rope_kwargs_from_hf_config(cfg)
    half = rotary.RotaryEmbedding(**dict(kw, interleaved=False))(q, k, position_ids=pos)
    assert (half[0] - want[0]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("cls", ["Glm4vConfig", "GlmOcrConfig"])
def test_glm_composites_read_their_text_config(cls):
    text = dict(SMALL, hidden_size=512, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                         "partial_rotary_factor": 0.5})
    cfg = make_config(cls, text_config=text)
    for given in (cfg, cfg.to_dict()):
        assert rope_kwargs_from_hf_config(given) == rope_kwargs_from_hf_config(cfg.text_config)
    assert rope_kwargs_from_hf_config(cfg)["theta"] == 5e5


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mt,cls,rot", MOONSHINE, ids=[m[0] for m in MOONSHINE])
def test_moonshine_decoders(mt, cls, rot, rule):
    cfg = make_config(cls, rope_parameters=dict(RULES[rule], partial_rotary_factor=0.8), **(
        dict(hidden_size=160, decoder_num_attention_heads=4, encoder_num_attention_heads=4)
        if mt == "moonshine" else {}))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope, _, _ = _check(mt, rot, cfg, head_dim, False, 12)
    assert rope.dim == int(head_dim * 0.8) < head_dim  # a leading span, the rest passed through


def test_moonshine_default_share_and_odd_spans():
    cfg = make_config("MoonshineConfig", hidden_size=144, decoder_num_attention_heads=4,
                      encoder_num_attention_heads=4)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.9  # the class's own default
    assert _check("moonshine", "MoonshineRotaryEmbedding", cfg, 36, False, 13)[0].dim == 32
    # int(10 * 0.9) = 9: transformers widens an odd span to 10 with base^(-2j/9); refused, not approximated.
    odd = make_config("MoonshineConfig", hidden_size=40, decoder_num_attention_heads=4, encoder_num_attention_heads=4)
    with pytest.raises(ValueError, match=r"head_dim 10 \* partial_rotary_factor 0.9 gives rotary dim 9"):
        rotary.RotaryEmbedding.from_hf_config(odd)


def test_moonshine_with_unequal_encoder_and_decoder_heads_is_refused():
    # transformers' attention sets config.num_attention_heads as it builds each stack.
    cfg = make_config("MoonshineConfig", hidden_size=288, encoder_num_attention_heads=4, decoder_num_attention_heads=8)
    for given in (cfg, cfg.to_dict()):
        with pytest.raises(ValueError, match=r"moonshine with encoder_num_attention_heads=4 and "
                                             r"decoder_num_attention_heads=8"):
            rope_kwargs_from_hf_config(given)


def test_moonshine_streaming_encoder_is_refused_by_name():
    cfg = make_config("MoonshineStreamingConfig").encoder_config
    with pytest.raises(ValueError, match=r"moonshine_streaming_encoder.*its encoder has no RoPE"):
        rope_kwargs_from_hf_config(cfg)


def _phimoe(**params):
    rule = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0 + j / 8 for j in range(8)],
            "long_factor": [2.0 + j for j in range(8)], "original_max_position_embeddings": 32,
            "short_mscale": 1.25, "long_mscale": 1.25, **params}
    return make_config("PhimoeConfig", **SMALL, rope_parameters={k: v for k, v in rule.items() if v is not None})


@pytest.mark.parametrize("top", [20, 59])  # below and past original_max_position_embeddings
def test_phimoe_longrope_is_its_short_factors_scaled_by_its_mscale(top):
    # Its class recomputes the longrope table with no sequence length (the
    # short factors, at every length) and scales cos/sin by its own mscale.
    cfg = _phimoe()
    q, k, _ = inputs(16, False, 14)
    pos = torch.randint(0, top + 1, (2, 7), generator=torch.Generator().manual_seed(15))
    pos[0, 0] = top
    want = _theirs("phimoe", "PhimoeRotaryEmbedding", cfg, q, k, pos)
    for given in (cfg, cfg.to_dict()):
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        assert_matches(rope(q, k, position_ids=pos), want)
        assert_matches(rope(q, k, position_ids=pos), want)  # the state a first call left
    # Its long factors or the rule's own attention factor would be far off.
    rule = {k: v for k, v in cfg.rope_parameters.items() if k not in ("rope_theta", "short_mscale", "long_mscale")}
    plain = rotary.RotaryEmbedding(16, 128, 1e4, False, dict(rule, max_position_embeddings=128))
    assert (plain(q, k, position_ids=pos)[0] - want[0]).abs().max() > 100 * ATOL


def test_phimoe_default_rule_ignores_its_mscales():
    cfg = make_config("PhimoeConfig", **SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                "short_mscale": 3.0, "long_mscale": 4.0})
    q, k, pos = inputs(16, False, 16)
    want = _theirs("phimoe", "PhimoeRotaryEmbedding", cfg, q, k, pos)
    assert_matches(rotary.RotaryEmbedding.from_hf_config(cfg)(q, k, position_ids=pos), want)


@pytest.mark.parametrize("params,match", [
    (dict(long_mscale=1.5), r"short_mscale=1.25 and long_mscale=1.5: phimoe's scale switches between them at "
                            r"original_max_position_embeddings"),
    (dict(short_mscale=None), r"rope_parameters\['short_mscale'\]=None: phimoe's class scales cos/sin by it"),
    (dict(long_mscale=0.0), r"rope_parameters\['long_mscale'\]=0.0: .*a finite number > 0"),
    (dict(long_factor=None), r"the longrope rule lacks long_factor: transformers' config validation requires it"),
])
def test_phimoe_scales_it_cannot_serve_are_refused(params, match):
    rule = _phimoe().rope_parameters
    rule.update(params)
    for key in [key for key, value in params.items() if value is None]:
        del rule[key]  # its config class refuses the object: the dict form
    with pytest.raises(ValueError, match=match):
        rope_kwargs_from_hf_config(dict(_phimoe().to_dict(), rope_parameters=rule))


def test_phimoe_other_scaled_rules_are_refused():
    cfg = _phimoe(rope_type="yarn", factor=2.0, short_factor=None, long_factor=None)
    with pytest.raises(ValueError, match=r"rope_type 'yarn' for phimoe: its class builds that rule's table without "
                                         r"a sequence length and scales cos/sin by short_mscale / long_mscale"):
        rotary.RotaryEmbedding.from_hf_config(cfg)


def test_recurrent_gemma_runs_its_default_rule_alone():
    # Its rotary class raises on any other rule; its default rotates half the head.
    cfg = make_config("RecurrentGemmaConfig", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=32, vocab_size=32, num_hidden_layers=1)
    q, k, pos = inputs(16, False, 17)
    k = torch.randn_like(q)  # its attention has as many key heads as query heads here
    want = _theirs("recurrent_gemma", "RecurrentGemmaRotaryEmbedding", cfg, q, k, pos)
    for given in (cfg, cfg.to_dict()):
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        assert rope.dim == 8
        assert_matches(rope(q, k, position_ids=pos), want)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_openai_privacy_filter(rule):
    # (2j, 2j+1) pairs over the whole head, in each rule its class runs.
    cfg = make_config("OpenAIPrivacyFilterConfig", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=1, intermediate_size=32, vocab_size=32,
                      max_position_embeddings=128, rope_parameters=dict(RULES[rule]))
    rope, (q, k, pos), want = _check("openai_privacy_filter", "OpenAIPrivacyFilterRotaryEmbedding", cfg, 16, False, 18)
    assert rope.dim == 16


def test_openai_privacy_filter_class_default():
    cfg = make_config("OpenAIPrivacyFilterConfig")  # its own rule and base
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _check("openai_privacy_filter", "OpenAIPrivacyFilterRotaryEmbedding", cfg, head_dim, False, 19)


# Muse's text models: layer_rope_theta only says which layers rotate (0: none);
# its class rotates every other layer at rope_theta.
MUSE = [("muse_glimmer", "MuseGlimmerTextConfig", "MuseGlimmerTextRotaryEmbedding"),
        ("muse_spark", "MuseSparkTextConfig", "MuseSparkTextRotaryEmbedding")]


def _muse(cls, **kw):
    return make_config(cls, **dict(SMALL, head_dim=16, num_hidden_layers=8), **kw)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("mt,cls,rot", MUSE, ids=[m[0] for m in MUSE])
def test_muse_text_models(mt, cls, rot, rule):
    cfg = _muse(cls, rope_parameters=dict(RULES[rule], rope_theta=5e4))
    assert 0 in cfg.layer_rope_theta and 5e4 in cfg.layer_rope_theta  # the class's NoPE layers
    q, k, pos = inputs(16, False, 20)
    want = _theirs(mt, rot, cfg, q, k, pos)
    for given in (cfg, cfg.to_dict()):
        rope = rotary.RotaryEmbedding.from_hf_config(given)
        assert rope.dim == 16 and not rope.interleaved
        assert_matches(rope(q, k, position_ids=pos), want)
    assert rotary.hf.layer_thetas_of(cfg) is None  # one table: not GraniteSWA's per-layer bases


@pytest.mark.parametrize("mt,cls,rot", MUSE, ids=[m[0] for m in MUSE])
def test_muse_layer_bases_other_than_rope_theta_are_refused(mt, cls, rot):
    # The class would rotate the 3e4 layer at rope_theta all the same: serving 3e4 is wrong, serving 1e4 a guess.
    cfg = _muse(cls, layer_rope_theta=[1e4, 3e4, 1e4, 0, 1e4, 1e4, 1e4, 0],
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"layer_rope_theta has bases \[30000.0\] besides 0 and rope_theta 10000: "
                                         r"transformers' muse_\w+_text rotates every such layer at rope_theta"):
        rotary.RotaryEmbedding.from_hf_config(cfg)
    with pytest.raises(ValueError, match="a list of bases >= 0"):
        rotary.RotaryEmbedding.from_hf_config(_muse(cls, layer_rope_theta=[1e4, -1.0] * 4))


@pytest.mark.parametrize("cls,text", [("MuseGlimmerConfig", "MuseGlimmerTextConfig"),
                                      ("MuseSparkConfig", "MuseSparkTextConfig")])
def test_muse_composites_read_their_text_config(cls, text):
    cfg = make_config(cls, text_config={"rope_parameters": {"rope_type": "default", "rope_theta": 2e5}})
    assert type(cfg.text_config).__name__ == text
    for given in (cfg, cfg.to_dict()):
        assert rope_kwargs_from_hf_config(given) == rope_kwargs_from_hf_config(cfg.text_config)
    assert rope_kwargs_from_hf_config(cfg)["theta"] == 2e5


# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {"glm4v_text", "glm_ocr_text", "moonshine", "moonshine_streaming", "phimoe", "recurrent_gemma",
          "openai_privacy_filter", "muse_glimmer_text", "muse_spark_text"}
