"""Frequency (scaling) rules refused: ValueError naming the field, from
rope_freqs, both modules and from_hf_config; every table a constructor builds
is finite; fields of other rules refused.
Split from test_scaling.py (the rules against the published formulas)."""

import copy
import math

import pytest
import torch

import rotary


# ---------------------------------------------------------------------------
# Errors: ValueError naming the field
# ---------------------------------------------------------------------------
BAD = [
    ({"rope_type": "ntk-by-parts"}, r"unknown rope_type 'ntk-by-parts'"),
    ({"type": "yarn", "rope_type": "linear", "factor": 2.0}, r"'type'.*'rope_type'|'rope_type'.*'type'"),
    ({"rope_type": "linear"}, r"factor is required"),
    ({"rope_type": "linear", "factor": 0.0}, r"factor must be finite and > 0, got 0"),
    ({"rope_type": "linear", "factor": -2.0}, r"factor must be finite and > 0"),
    ({"rope_type": "linear", "factor": "2"}, r"'factor' must be a number"),
    ({"rope_type": "linear", "factr": 2.0}, r"unknown key 'factr'"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}, r"'rope_theta' describes the model"),
    ({"rope_type": "ntk"}, r"factor is required"),
    ({"rope_type": "yarn", "factor": 4.0}, r"original_max_position_embeddings is required"),
    ({"rope_type": "llama3", "factor": 8.0}, r"original_max_position_embeddings is required"),
    ({"rope_type": "llama3", "original_max_position_embeddings": 64}, r"factor is required"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
      "low_freq_factor": 4.0, "high_freq_factor": 2.0}, r"high_freq_factor must be"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_slow": -1},
     r"beta_slow must be finite and > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5},
     r"'original_max_position_embeddings' must be an integer of magnitude below 9e15, got 64.5"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.0},
     r"attention_factor must be finite and > 0"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4, "factor": 2.0},
     r"original_max_position_embeddings is required"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 64, "factor": 2.0}, r"short_factor must have rotary_dim / 2 = 4 entries"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 5,
      "original_max_position_embeddings": 64, "factor": 2.0}, r"long_factor must have rotary_dim / 2 = 4 entries"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 0.0, 1.0],
      "original_max_position_embeddings": 64, "factor": 2.0}, r"long_factor\[2\] must be finite and > 0"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 4, "original_max_position_embeddings": 64,
      "factor": 2.0}, r"short_factor must have"),
    ({"rope_type": "longrope", "short_factor": 1.0, "long_factor": [1.0] * 4,
      "original_max_position_embeddings": 64}, r"'short_factor' must be a list"),
]


@pytest.mark.parametrize("p,match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
@pytest.mark.parametrize("entry", ["rope_freqs", "py", "cpp"])
def test_bad_scaling(p, match, entry):
    build = {
        "rope_freqs": lambda: rotary.freqs_table(8, 16, 10000.0, p),
        "py": lambda: rotary.RotaryEmbedding(8, 16, scaling=p),
        "cpp": lambda: rotary.CppRotaryEmbedding(8, 16, scaling=p),
    }[entry]
    with pytest.raises(ValueError, match=match):
        build()


def test_rule_specific_dim_checks():
    with pytest.raises(ValueError, match=r"rotary_dim must be > 2, got 2"):
        rotary.RotaryEmbedding(2, 16, scaling={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match=r"dim must be even and > 0, got 7"):
        rotary.RotaryEmbedding(7, 16, scaling={"rope_type": "linear", "factor": 2.0})
    for who, call in (("RotaryEmbedding", lambda: rotary.RotaryEmbedding(8, 16, scaling="yarn")),
                      ("freqs_table", lambda: rotary.freqs_table(8, 16, scaling="yarn")),
                      ("inv_frequencies", lambda: rotary.inv_frequencies(8, scaling="yarn"))):
        with pytest.raises(TypeError, match=rf"^{who}: scaling must be None, a dict .* got 'yarn'"):
            call()


@pytest.mark.parametrize(
    "config,match",
    [
        ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, r"unknown rope_type 'su'"),
        ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "linear"}}, r"the linear rule lacks factor: transformers. config validation requires it"),
        ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}},
         r"long_factor must have rotary_dim / 2 = 8 entries"),
        ({"num_attention_heads": 4, "max_position_embeddings": 64}, r"head_dim"),
        ({"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0.1875,
          "rope_parameters": {"rope_type": "default"}}, r"partial_rotary_factor 0.1875 gives rotary dim 3"),
        ({"hidden_size": 64, "num_attention_heads": 4, "partial_rotary_factor": 0.1}, r"rotary dim 1; it must be even"),
        ({"hidden_size": 64, "num_attention_heads": 4, "layer_types": ["full_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "default"}}}, r"nested by layer type"),
        ({"hidden_size": 64, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 2]}},
         r"mrope_section \[2, 3, 2\] must sum to rotary_dim / 2 = 8 \(one entry per frequency pair\), got 7"),
    ],
)
def test_from_hf_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        rotary.RotaryEmbedding.from_hf_config(config)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rule,key", [("llama3", "low_freq_factor"), ("llama3", "high_freq_factor"),
                                      ("llama3", "original_max_position_embeddings"),
                                      ("yarn", "original_max_position_embeddings"),
                                      ("longrope", "original_max_position_embeddings"), ("proportional", "factor"),
                                      ("yarn", "top-level original_max_position_embeddings")])
def test_a_rule_key_given_as_none_that_transformers_fails_on(rule, key):
    """A None is read as given by transformers (it fails on it), where rotary
    took it as absent and filled in its own value (low_freq_factor 1, the
    factor 1, original_max_position_embeddings = max_position_embeddings)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    params = {"llama3": LLAMA3, "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
              "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                           "original_max_position_embeddings": 16},
              "proportional": {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5}}[rule]
    config = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64, "rope_theta": 1e4,
              "rope_scaling": dict(params, **{key: None})}
    if key.startswith("top-level"):  # transformers writes the top-level one over the rule's
        config = dict(config, rope_scaling=params, original_max_position_embeddings=None)
    with pytest.raises(Exception):  # transformers' own class fails on the same config
        embed = LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(config)))  # it writes into the dicts
        embed(torch.randn(1, 2, 16), torch.arange(2)[None])
    with pytest.raises(ValueError, match=rf"the {rule} rule's {key} is None: transformers reads it as given and "
                                         r"fails on None \(TypeError\); give its value"):
        rotary.RotaryEmbedding.from_hf_config(dict(config, model_type="llama"))
    served = {n: v for n, v in config.items() if n != "original_max_position_embeddings"}
    rotary.RotaryEmbedding.from_hf_config(dict(served, model_type="llama", rope_scaling=params))  # as given: served


# ---------------------------------------------------------------------------
# Every table a constructor builds is finite; fields of other rules refused
# ---------------------------------------------------------------------------
YARN64 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
NON_FINITE = [
    (dict(scaling={**YARN64, "mscale": -20.0, "mscale_all_dim": 1.0}),
     r"mscale = -20 and mscale_all_dim = 1 give the attention scaling"),
    (dict(scaling={**YARN64, "mscale": 1e308, "mscale_all_dim": 1.0}), r"attention scaling"),
    (dict(scaling={"rope_type": "yarn", "factor": math.e, "original_max_position_embeddings": 64,
                   "mscale": 1.0, "mscale_all_dim": -10.0}), r"attention scaling"),
    (dict(scaling={"rope_type": "linear", "factor": 1e-320}), r"factor = .* give inv_freq\[0\] = inf"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0**62}), r"factor = 4.61169e\+18 grow the base to theta \* 0\^\(d \/ \(d - 2\)\) = 0"),
    (dict(theta=1e-300, angle_dtype="float32"), r"theta=1e-300.*for float32 angles"),
    # finite, but past 2^62 rad no float64 angle keeps its phase
    (dict(theta=1e-300), r"theta=1e-300.*inv_freq\[1\] = 1e\+75 gives the angle .* keep their phase below 2\^62 rad"),
    (dict(scaling={"rope_type": "default", "factor": -1}), r"factor is not a field of this rule"),
    (dict(scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": float("nan")}),
     r"'linear'\): beta_fast is not a field of this rule \(it would be ignored\); its fields: factor"),
]


@pytest.mark.parametrize("kwargs,match", NON_FINITE, ids=[f"case{i}" for i in range(len(NON_FINITE))])
@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_constructor_refuses_non_finite_tables(kind, kwargs, match):
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    kwargs = dict(kwargs)
    theta = kwargs.pop("theta", 10000.0)
    with pytest.raises(ValueError, match=match):
        cls(8, 4096, theta, True, **kwargs)


def test_accepted_extremes_build_finite_tables():
    for m in (rotary.RotaryEmbedding(8, 64, 1e-10), rotary.RotaryEmbedding(8, 64, 1e300, angle_dtype="float32")):
        assert torch.isfinite(torch.view_as_real(m.freqs)).all() and torch.isfinite(m.inv_freq).all()


HF = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64}


@pytest.mark.parametrize(
    "config,match",
    [
        ({**HF, "rope_theta": 0}, r"rope_theta must be a finite number > 0, got 0"),
        ({**HF, "rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, r"rope_theta .* got 0.0"),
        ({**HF, "partial_rotary_factor": 0.0}, r"partial_rotary_factor must be a number in \(0, 1\].*got 0.0"),
        ({**HF, "partial_rotary_factor": 2.0}, r"partial_rotary_factor .* got 2.0"),
        ({**HF, "partial_rotary_factor": 1e308}, r"partial_rotary_factor .* got 1e\+308"),
        ({**HF, "max_position_embeddings": 0}, r"max_position_embeddings must be an int > 0, got 0"),
    ],
)
def test_from_hf_config_refuses_zero_and_out_of_range(config, match):
    with pytest.raises(ValueError, match=match):
        rotary.RotaryEmbedding.from_hf_config(config)


def test_from_hf_config_drops_fields_other_rules_use():
    # transformers ignores them; the strict dict form refuses them.
    cfg = {**HF, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32, "low_freq_factor": 1}}
    assert rotary.RotaryEmbedding.from_hf_config(cfg).scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="low_freq_factor is not a field of this rule"):
        rotary.RotaryEmbedding(16, 64, scaling={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 2})


@pytest.mark.parametrize("factor", [1e-39, 1e-300, 3.5e38])
def test_attention_scaling_outside_normal_float32_is_refused(factor):
    """An entry of 1e-300 rounds to 0 in complex64 (and 1e-42 to a subnormal
    with a 5e-4 relative error): refused like the overflow side."""
    with pytest.raises(ValueError, match=r"does not fit a complex64 entry \(a normal float32"):
        rotary.RotaryEmbedding(8, 16, scaling={**YARN64, "attention_factor": factor})
