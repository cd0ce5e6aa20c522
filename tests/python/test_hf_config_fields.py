"""How from_hf_config reads a Hugging Face config's fields, and the fields it
refuses; split from test_hf_config.py (which holds the per-family parity
against transformers' rotary code, CASES and the shared helpers).

Regressions of single families (GPT-J's rotary_dim, DeepSeek-V3's trailing
interleaved rope dims, the VL configs read through text_config, M-RoPE
layout contradictions), rope fields and rope_parameters keys no rule reads,
refused families and YaRN fields, the config.json dict form read like the
config object, and the NeoX dicts' generic names their class ignores.
"""

import pathlib
import warnings

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from rotary.hf_families import FAMILIES, VERIFIED_BY_TESTS
from test_hf_config import CASES, MLA, SMALL, hf_and_ours, make_config, modeling

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ regressions
def test_gptj_is_interleaved_over_rotary_dim():
    cfg = make_config("GPTJConfig", n_embd=64, n_head=4, n_layer=1, vocab_size=32, n_positions=128, rotary_dim=8)
    for form in (cfg, cfg.to_dict()):
        kw = rope_kwargs_from_hf_config(form)
        assert (kw["dim"], kw["interleaved"], kw.get("rotary_offset", 0), kw["theta"]) == (8, True, 0, 10000.0)
        assert kw["max_seq_len"] == 128
    with pytest.raises(ValueError, match=r"rope_theta=500000.0: transformers' gptj ignores it"):
        rope_kwargs_from_hf_config({**cfg.to_dict(), "rope_theta": 500000.0})
    # The base it runs anyway, in either place, ignores nothing: served as without it.
    plain = rope_kwargs_from_hf_config(cfg)
    assert rope_kwargs_from_hf_config({**cfg.to_dict(), "rope_theta": 10000.0}) == plain
    rule = {"rope_type": "default", "rope_theta": 10000}
    assert rope_kwargs_from_hf_config({**cfg.to_dict(), "rope_parameters": rule}) == plain
    with pytest.raises(ValueError, match=r"rope_type='linear': transformers' gptj ignores it"):
        rope_kwargs_from_hf_config({**cfg.to_dict(), "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 10000}})
    with pytest.raises(ValueError, match=r"gptj needs rotary_dim.*got None"):
        rope_kwargs_from_hf_config({**cfg.to_dict(), "rotary_dim": None})


def test_deepseek_v3_rotates_the_trailing_rope_dims_interleaved():
    cfg = make_config("DeepseekV3Config", **MLA)
    kw = rope_kwargs_from_hf_config(cfg)
    assert (kw["dim"], kw["rotary_offset"], kw["interleaved"]) == (8, 12, True)
    # A config.json without head_dim (as DeepSeek-V3's own) reads the same.
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("head_dim", "qk_head_dim", "rope_interleave")}
    assert rope_kwargs_from_hf_config(d) == kw
    assert rope_kwargs_from_hf_config({**d, "rope_interleave": False})["interleaved"] is False
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5"):
        rope_kwargs_from_hf_config({**d, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match=r"rope_interleave must be a bool, got 'yes'"):
        rope_kwargs_from_hf_config({**d, "rope_interleave": "yes"})


@pytest.mark.parametrize("cls", ["Qwen2VLConfig", "Qwen2_5_VLConfig", "Qwen3VLConfig"])
def test_vl_config_read_through_text_config(cls):
    cfg = make_config(cls)
    kw = rope_kwargs_from_hf_config(cfg)
    assert kw == rope_kwargs_from_hf_config(cfg.text_config) == rope_kwargs_from_hf_config(cfg.to_dict())
    text = cfg.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert kw["dim"] == head_dim and kw["interleaved"] is False
    assert kw["mrope_section"] == ([24, 20, 20] if cls == "Qwen3VLConfig" else [16, 24, 24])
    assert kw["mrope_interleaved"] == (cls == "Qwen3VLConfig")
    assert rotary.RotaryEmbedding.from_hf_config(cfg, max_seq_len=16).dim == head_dim


def test_mrope_layout_contradiction_refused():
    cfg = make_config("Qwen2VLTextConfig", **dict(SMALL, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True}))
    with pytest.raises(ValueError, match=r"mrope_interleaved=True, but transformers' qwen2_vl_text"):
        rope_kwargs_from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"rope_parameters\['mrope_section'\]=\[2, 3, 3\] is not read for model_type 'llama'"):
        rope_kwargs_from_hf_config({**SMALL, "model_type": "llama",
                                    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}})


@pytest.mark.parametrize("field,value", [
    ("rotary_dim", 8), ("rope_interleave", True), ("qk_rope_head_dim", 8), ("qk_nope_head_dim", 12),
    ("no_rope_layers", [1, 0]), ("rope_local_base_freq", 10000.0), ("use_rope", True), ("my_rotary_thing", 3),
])
@pytest.mark.parametrize("model_type", [None, "llama", "some_new_model"])
def test_unknown_rope_field_refused_by_name(field, value, model_type):
    cfg = {**SMALL, field: value}
    if model_type:
        cfg["model_type"] = model_type
    with pytest.raises(ValueError, match=rf"{field}={value!r} is not read".replace("[", r"\[")):
        rope_kwargs_from_hf_config(cfg)


@pytest.mark.parametrize("key,value", [("llama_4_scaling_beta", 0.1), ("short_mscale", 1.2), ("alpha", 2.0)])
def test_unknown_rope_parameters_key_refused(key, value):
    cfg = {**SMALL, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, key: value}}
    with pytest.raises(ValueError, match=rf"rope_parameters\['{key}'\]={value!r} is a field no rule of rotary has"):
        rope_kwargs_from_hf_config(cfg)


def test_unverified_model_type_is_refused_unless_allowed():
    """A model type no test checks (V-JEPA 2's three-axis grid was read as
    1-D rotate_half): refused by name; allow_unverified=True reads it as
    rotate_half over the leading span, as a dict without model_type is."""
    cfg = {**SMALL, "model_type": "some_new_model", "rope_theta": 5e5}
    with pytest.raises(ValueError, match=r"model_type 'some_new_model' is not verified: .* pass allow_unverified=True"):
        rope_kwargs_from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"model_type 'some_new_model' is not verified"):
        rotary.RotaryEmbedding.from_hf_config(cfg)
    kw = rope_kwargs_from_hf_config(cfg, allow_unverified=True)
    assert (kw["dim"], kw["interleaved"], kw["theta"]) == (16, False, 5e5) and "rotary_offset" not in kw
    assert rotary.RotaryEmbedding.from_hf_config(cfg, allow_unverified=True).dim == 16
    cfg.pop("model_type")
    assert rope_kwargs_from_hf_config(cfg) == kw


@pytest.mark.parametrize("model_type,match", [
    ("vjepa2", r"'vjepa2' is not supported: 3-D RoPE over a video's frame, row and column"),
    ("clvp_decoder", r"'clvp_decoder' is not supported: the model transformers builds from it has no rotary"),
])
def test_sub_models_read_as_llama_before_are_refused(model_type, match):
    cfg = transformers.AutoConfig.for_model(model_type)
    for allow in (False, True):
        with pytest.raises(ValueError, match=match):
            rotary.RotaryEmbedding.from_hf_config(cfg, allow_unverified=allow)


def test_each_type_verified_outside_the_sweep_names_a_test_that_exists():
    # hf_families.VERIFIED_BY_TESTS lets a type through only for a test that checks it.
    for model_type, test in VERIFIED_BY_TESTS.items():
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), (model_type, test)
        assert model_type not in FAMILIES


@pytest.mark.parametrize("cls,kw,match", [
    ("RoFormerConfig", SMALL, r"'roformer' is not supported: a staticmethod of its attention rotates with an "
                              r"nn.Embedding sinusoidal table"),
])
def test_refused_families(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        rope_kwargs_from_hf_config(make_config(cls, **kw))


def test_yarn_fields_rotary_cannot_represent_are_refused():
    # proportional RoPE (Gemma 4) is a rule now (test_scaling_hf_parity.py checks it against transformers).
    kwargs = rope_kwargs_from_hf_config({**SMALL, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}})
    assert kwargs["scaling"]["rope_type"] == "proportional"
    # mscale / mscale_all_dim / attention_factor are represented: the folded factor matches transformers'.
    case = next(c for c in CASES if c[0] == "deepseek_v3-yarn-mscale")
    cfg, rope, *_ = hf_and_ours(case)
    hf_rope = modeling("deepseek_v3").DeepseekV3RotaryEmbedding(cfg)
    assert rope.attention_scaling == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert rope.attention_scaling != 1.0


def test_the_dict_form_reads_like_the_config_object():
    """config.json (to_json_string) names some fields as the config class's
    attribute_map does (JetMoe's kv_channels for head_dim, Zamba2's
    attention_head_dim); every family's default config reads the same from
    it as from the object, or is refused the same way."""
    import json

    from rotary_testing.hf_sweep import swept_families
    from rotary_testing.hf_tiny import _config_of

    def read(config, layer_type=None):
        try:
            return rope_kwargs_from_hf_config(config, layer_type=layer_type)
        except ValueError as e:
            return f"refused: {e}"

    checked = []
    for model_type in swept_families():
        try:
            config = _config_of(model_type)
        except Exception:  # noqa: BLE001 - transformers cannot build it here
            continue
        text = getattr(config, "text_config", None) or config
        for form in (config, text) if text is not config else (config,):
            as_json = json.loads(form.to_json_string())
            for layer_type in rotary.hf.layer_types_of(form) or [None]:  # one module per layer type
                got, want = read(as_json, layer_type), read(form, layer_type)
                assert got == want, (model_type, layer_type, got, want)
            checked.append(model_type)
    assert {"jetmoe", "zamba2", "llama", "gptj"} <= set(checked), sorted(checked)


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_a_dict_top_level_partial_reaches_the_proportional_rule(form):
    """transformers' config class moves a top-level partial_rotary_factor into
    the rule, and proportional turns only that share of the pairs."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rule = {"rope_type": "proportional", "factor": 2.0}
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 256,
         "partial_rotary_factor": 0.25}
    d.update({"rope_theta": 10000.0, "rope_scaling": rule} if form == "rope_scaling"
             else {"rope_parameters": dict(rule, rope_theta=10000.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(dict(d)))
    ours = rotary.RotaryEmbedding.from_hf_config(d)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq.double(), rtol=1e-6, atol=0)
    assert int((ours.inv_freq != 0).sum()) == 4


@pytest.mark.parametrize("model_type", ["gpt_neox", "gpt_neox_japanese"])
@pytest.mark.parametrize("name,value", [("rope_theta", 1e6), ("partial_rotary_factor", 0.5)])
def test_neox_dicts_refuse_the_generic_names_their_class_ignores(model_type, name, value):
    d = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 64,
         name: value}
    with pytest.raises(ValueError, match=rf"{name}={value!r}: transformers' {model_type} config ignores it at the "
                                         r"top level \(it reads rotary_emb_base and rotary_pct"):
        rotary.RotaryEmbedding.from_hf_config(d)
    neox = {"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"}[name]
    assert rotary.RotaryEmbedding.from_hf_config({**{k: v for k, v in d.items() if k != name}, neox: value})
