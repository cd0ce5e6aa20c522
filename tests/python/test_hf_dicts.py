"""from_hf_config on config dicts (config.json) that transformers' config
class reads otherwise than their fields say: each is read as transformers'
rotary class reads the config it builds from the same dict (inv_freq and
attention scaling against that class's), or refused by name. The tables
these refusals rest on (hf_families.CLASS_*) are derived from transformers."""

import copy
import warnings

import pytest
import torch

import rotary
from rotary import hf_families
from rotary.hf import layer_types_of, rope_kwargs_from_hf_config
from test_hf_trials import assert_same_rule, modeling

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


def from_dict(model_type, d):
    """transformers' config object from the dict, as from_pretrained reads a config.json."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(d))


def reached(ours, theirs, reach, head_dim):
    """Both modules after a call whose largest position is reach - 1 (dynamic / longrope update there)."""
    pos = torch.arange(reach - 4, reach)[None]
    theirs(torch.zeros(1, 4, head_dim), pos)
    ours(torch.zeros(1, 1, 4, head_dim, dtype=torch.float64), position_ids=pos)
    assert_same_rule(ours, theirs)


# ------------------------------------------------------ the tables, against transformers
def _text_classes():
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cls in transformers.CONFIG_MAPPING.values():
            try:
                text = type(cls().get_text_config())
            except Exception:  # no default instance, or several text configs
                continue
            if text not in seen:
                seen.add(text)
                yield text


def test_class_layer_types_is_transformers_own():
    """The text config classes whose own defaults key rope_parameters by layer type."""
    keyed = set()
    for text in _text_classes():
        params = getattr(text(), "rope_parameters", None)
        if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
            keyed.add(text.model_type)
    assert keyed == set(hf_families.CLASS_LAYER_TYPES)


def test_class_plain_rope_scaling_is_transformers_own():
    """The config classes that never move a dict's rope_scaling into
    rope_parameters (though they read a rope_parameters with the same rule)."""
    def linear(params):
        if not isinstance(params, dict):
            return False
        return params.get("rope_type") == "linear" or any(linear(v) for v in params.values())

    plain = set()
    rule = {"rope_type": "linear", "factor": 4.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for text in _text_classes():
            try:
                legacy = text.from_dict({"rope_theta": 2e4, "rope_scaling": dict(rule)}).rope_parameters
                standard = text.from_dict({"rope_parameters": dict(rule, rope_theta=2e4)}).rope_parameters
            except Exception:  # a class that needs other fields, or takes neither
                continue
            if linear(standard) and not linear(legacy):
                plain.add(text.model_type)
    assert plain == set(hf_families.CLASS_PLAIN_ROPE_SCALING)


# ------------------------------------------------------ F1: Phi-3's original_max_position_embeddings
PHI3 = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 16384, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16,
                         "original_max_position_embeddings": 8192}}


def test_phi3_dict_with_only_the_rules_original_max_position_embeddings_is_refused():
    """Phi3Config writes its own (class default 4096) over the rule's 8192."""
    assert from_dict("phi3", PHI3).rope_parameters["original_max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match=r"the phi3 dict has no original_max_position_embeddings; its config "
                                         r"class fills in its own, not .* the one in rope_scaling"):
        rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(PHI3))


@pytest.mark.parametrize("top", [4096, 8192])
def test_phi3_dict_with_a_top_level_original_max_position_embeddings(top):
    d = dict(PHI3, original_max_position_embeddings=top)
    cfg = from_dict("phi3", d)
    theirs = modeling("phi3").Phi3RotaryEmbedding(cfg)
    ours = rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(d))
    assert_same_rule(ours, theirs)
    reached(ours, theirs, 6000, 32)  # between 4096 and 8192: long factors for one, short for the other


# ------------------------------------------------------ F2: classes keyed by layer type
OLMO3 = {"model_type": "olmo3", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 4, "max_position_embeddings": 65536, "rope_theta": 500000.0,
         "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
         "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                          "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1}}
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 64, "num_hidden_layers": 6, "max_position_embeddings": 32768, "rope_theta": 1e6,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


@pytest.mark.parametrize("d", [OLMO3, GEMMA3, {k: v for k, v in OLMO3.items() if k != "rope_scaling"}],
                         ids=["olmo3", "gemma3_text", "olmo3-theta-only"])
def test_a_flat_dict_of_a_class_keyed_by_layer_type_is_refused(d):
    """transformers gives the flat rule to full_attention only (Gemma 3's
    sliding layers: base 10000); one module for every layer would be wrong."""
    model_type = d["model_type"]
    keyed = from_dict(model_type, d).rope_parameters
    assert keyed["sliding_attention"]["rope_type"] == "default"
    match = rf"the {model_type} dict has no rope_parameters keyed by layer type"
    with pytest.raises(ValueError, match=match):
        rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(d))
    with pytest.raises(ValueError, match=match):
        layer_types_of(copy.deepcopy(d))
    for fn in (layer_types_of, rotary.hf.layer_thetas_of):  # each names itself, not from_hf_config
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: config must be a transformers config"):
            fn(None)
    with pytest.raises(ValueError, match=match):
        rope_kwargs_from_hf_config(copy.deepcopy(d), layer_type="sliding_attention")


def test_a_dict_with_both_rope_scaling_and_rope_parameters_reads_as_transformers():
    """transformers' config class takes the legacy rope_scaling over
    rope_parameters when a dict has both: so does the dict's reading."""
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512,
         "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obj = transformers.LlamaConfig.from_dict(copy.deepcopy(d))
    assert obj.rope_parameters["rope_type"] == "linear"
    assert rope_kwargs_from_hf_config(d)["scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert rope_kwargs_from_hf_config(d) == rope_kwargs_from_hf_config(obj)


def test_qwen3_5_reads_its_rotary_classs_default_sections():
    """A Qwen3.5 dict without mrope_section: its rotary class turns pairs by
    [11, 11, 10] (t, h, w), interleaved."""
    d = {"model_type": "qwen3_5_text", "hidden_size": 256, "num_attention_heads": 4, "head_dim": 256,
         "max_position_embeddings": 512,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    kw = rope_kwargs_from_hf_config(d)
    assert kw["dim"] == 64 and kw["mrope_section"] == [11, 11, 10] and kw["mrope_interleaved"] is True
    import inspect
    from transformers.models.qwen3_5 import modeling_qwen3_5
    assert '"mrope_section", [11, 11, 10]' in inspect.getsource(modeling_qwen3_5.Qwen3_5TextRotaryEmbedding.__init__)


@pytest.mark.parametrize("model_type", ["beam", "dory", "laguna", "mellum", "mimo_v2_flash", "zaya"])
def test_a_dict_without_rope_parameters_of_a_class_with_per_type_defaults_is_refused(model_type):
    """Their classes fill in a rule per layer type, each with its own base."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = transformers.CONFIG_MAPPING[model_type]().to_dict()
    d = {k: v for k, v in full.items() if k not in ("rope_parameters", "rope_scaling")}
    d["rope_theta"] = 10000.0
    assert layer_types_of(full) is not None and from_dict(model_type, d).rope_parameters != {}
    with pytest.raises(ValueError, match=rf"the {model_type} dict has no rope_parameters keyed by layer type"):
        rope_kwargs_from_hf_config(d)


def test_the_keyed_dict_is_read_per_layer_type():
    """The dict transformers writes (keyed) reads as its rotary class, each type alike."""
    cfg = from_dict("olmo3", OLMO3)
    theirs = modeling("olmo3").Olmo3RotaryEmbedding(cfg)
    d = cfg.to_dict()
    assert layer_types_of(d) == ["full_attention", "sliding_attention"]
    for layer_type in ("sliding_attention", "full_attention"):
        ours = rotary.RotaryEmbedding.from_hf_config(d, layer_type=layer_type)
        torch.testing.assert_close(ours.inv_freq, getattr(theirs, f"{layer_type}_inv_freq").double(),
                                   rtol=1e-6, atol=0)
        assert ours.attention_scaling == pytest.approx(getattr(theirs, f"{layer_type}_attention_scaling"))


def test_layer_type_on_a_flat_config_is_refused():
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"layer_type='full_attention', but rope_parameters is not keyed by layer "
                                         r"type"):
        rotary.RotaryEmbedding.from_hf_config(d, layer_type="full_attention")


# ------------------------------------------------------ F3: max_position_embeddings inside the rule
@pytest.mark.parametrize("rule", [
    {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024, "max_position_embeddings": 8192},
], ids=["dynamic", "yarn-no-factor"])
def test_max_position_embeddings_in_the_rule_is_not_read(rule):
    """transformers reads only the top-level one (its class default 2048 where
    the dict has none): refused without one, ignored beside one."""
    d = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e4,
         "rope_scaling": rule}
    assert from_dict("llama", d).max_position_embeddings == 2048
    with pytest.raises(ValueError, match=r"rope_parameters\['max_position_embeddings'\]=8192 is not read by "
                                         r"transformers .* set it at the top level"):
        rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(d))
    d["max_position_embeddings"] = 2048
    cfg = from_dict("llama", d)
    theirs = modeling("llama").LlamaRotaryEmbedding(cfg)
    ours = rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(d))
    assert_same_rule(ours, theirs)
    reached(ours, theirs, 3000, 64)


# ------------------------------------------------------ F4 / F5: class defaults a dict lacks or holds
def test_bailing_hybrid_dict_without_rope_theta_is_refused():
    """Its class fills in rope_theta 6e6 (a plain dataclass default)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = transformers.CONFIG_MAPPING["bailing_hybrid"]().to_dict()
    d = {k: v for k, v in full.items() if k not in ("rope_parameters", "rope_theta", "rope_scaling")}
    assert from_dict("bailing_hybrid", d).rope_parameters["rope_theta"] == 6e6
    with pytest.raises(ValueError, match=r"the bailing_hybrid dict has no rope_theta; its config class fills in a "
                                         r"base other than 10000"):
        rope_kwargs_from_hf_config(d)
    assert rope_kwargs_from_hf_config(dict(d, rope_theta=6e6))["theta"] == 6e6


def cohere2_moe(d):
    cfg = from_dict("cohere2_moe", d)
    return cfg, modeling("cohere2_moe").Cohere2MoeRotaryEmbedding(cfg)


@pytest.mark.parametrize("params", [None, {"rope_type": "default", "rope_theta": 5e4}])
def test_cohere2_moe_dict_rope_scaling_is_not_read(params):
    """Cohere2MoeConfig keeps rope_scaling as a plain field: its model runs
    rope_parameters' rule (plain RoPE here), and so does ours, from the
    hand-written dict and from the dict transformers writes."""
    d = {"model_type": "cohere2_moe", "hidden_size": 512, "num_attention_heads": 4, "head_dim": 128,
         "max_position_embeddings": 8192, "rope_theta": 5e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    if params is not None:
        d["rope_parameters"] = params
    cfg, theirs = cohere2_moe(d)
    for form in (d, cfg.to_dict()):
        assert rope_kwargs_from_hf_config(copy.deepcopy(form))["scaling"] == {"rope_type": "default"}
        assert_same_rule(rotary.RotaryEmbedding.from_hf_config(copy.deepcopy(form)), theirs)
