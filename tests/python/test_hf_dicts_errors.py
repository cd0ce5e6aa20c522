"""Refusals by name where a config field, a rule name or a table size would
otherwise fail as a bare Python / pybind / allocator error, or read as
something transformers never builds."""

import fractions

import pytest

import rotary
from rotary import hf
from rotary.hf import rope_kwargs_from_hf_config
from test_hf_trials import config, modeling

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

LLAMA = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4}


# ------------------------------------------------------------- rule names
def test_rule_names_are_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    assert hf._HF_RULES == {"default"} | set(ROPE_INIT_FUNCTIONS)


def test_rotarys_own_ntk_rule_is_refused_in_a_transformers_config():
    """transformers has no "ntk" rule: the model the config describes cannot be built."""
    params = {"rope_type": "ntk", "factor": 4.0, "rope_theta": 1e4}
    cfg = config("LlamaConfig", **dict(LLAMA, num_hidden_layers=1, intermediate_size=64, vocab_size=32),
                 rope_parameters=params)
    with pytest.raises(KeyError, match="ntk"):
        modeling("llama").LlamaRotaryEmbedding(cfg)
    for form in (cfg, dict(LLAMA, rope_scaling=params)):
        with pytest.raises(ValueError, match=r"unknown rope_type 'ntk': transformers has no such rule \(its rules: "
                                             r"default, dynamic, .*RotaryEmbedding\(scaling=...\)"):
            rotary.RotaryEmbedding.from_hf_config(form)


# ------------------------------------------------------------- field types
def test_a_field_given_under_both_of_its_names_is_refused_when_they_differ():
    """bailing_hybrid's class reads model_max_length for
    max_position_embeddings (its attribute_map): a dict giving both, as a
    saved config.json with an added max_position_embeddings, is refused
    rather than read with the one transformers ignores; equal, it loads."""
    cls = transformers.CONFIG_MAPPING["bailing_hybrid"]
    d = {**cls().to_dict(), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"from_hf_config: max_position_embeddings=64 and model_max_length=262144 "
                                         r"differ: transformers' bailing_hybrid config reads model_max_length for "
                                         r"max_position_embeddings"):
        rope_kwargs_from_hf_config({**d, "model_max_length": 262144, "max_position_embeddings": 64})
    same = {**d, "model_max_length": 4096, "max_position_embeddings": 4096}
    assert rope_kwargs_from_hf_config(same) == rope_kwargs_from_hf_config(cls.from_dict(dict(same)))


@pytest.mark.parametrize("field,value", [
    ("head_dim", "64"), ("head_dim", True), ("head_dim", 64.0), ("hidden_size", "256"),
    ("num_attention_heads", "4"), ("hidden_size", 256.0),
])
def test_a_non_int_size_field_is_refused_by_name(field, value):
    d = dict(LLAMA, **{field: value})
    with pytest.raises(ValueError, match=rf"from_hf_config: llama needs {field}, an int >= 0, got {value!r}"):
        rope_kwargs_from_hf_config(d)


# ------------------------------------------------------------- table builders
@pytest.mark.parametrize("call,match", [
    (lambda: rotary.inv_frequencies(8, 10000.0, None, 2**64), r"inv_frequencies: seq_len must fit in int64"),
    (lambda: rotary.inv_frequencies(2**64), r"inv_frequencies: dim must fit in int64"),
    (lambda: rotary.freqs_table(8, 2**64), r"freqs_table: max_seq_len must fit in int64, got 18446744073709551616"),
    (lambda: rotary.freqs_table(8, 10, 10**400), r"freqs_table: theta must be finite, got an int of 1329 bits, "
                                                 r"past a float's range"),
    (lambda: rotary.inv_frequencies(8, 10**5000), r"inv_frequencies: theta must be finite, got an int of 16610 bits"),
    (lambda: rotary.inv_frequencies(8, fractions.Fraction(10**401, 7)), r"inv_frequencies: theta must be finite, got "
                                                                        r"a Fraction past a float's range"),
    (lambda: rotary.RotaryEmbedding(8, 16, scaling={"rope_type": "linear", "factor": 10**400}),
     r"rope scaling: 'factor' must be finite, got an int of 1329 bits, past a float's range"),
    (lambda: rotary.freqs_table(2, 2**61), r"freqs_table: a table of max_seq_len=2305843009213693952 rows x dim // 2 "
                                           r"= 1 pairs needs more than 2\^64 bytes \(complex64\), more than this machine's memory"),
    (lambda: rotary.freqs_table(2**20, 2**40), r"freqs_table: a table of max_seq_len=1099511627776 rows x dim // 2 "
                                               r"= 524288 pairs needs 4611686018427387904 bytes"),
    (lambda: rotary.RotaryEmbedding(64, 10, theta=10**400),
     r"RotaryEmbedding: theta must be finite, got an int of 1329 bits, past a float's range"),
    (lambda: rotary.CppRotaryEmbedding(64, 10, axes_dim=[32, 32], axes_theta=[1e4, 10**400]),
     r"RotaryEmbedding: axes_theta\[1\] must be finite, got an int of 1329 bits"),
    (lambda: rotary.RotaryEmbedding.from_hf_config(dict(LLAMA, rope_theta=10**400)),
     r"from_hf_config: rope_theta must be finite, got an int of 1329 bits, past a float's range"),
    (lambda: rotary.RotaryEmbedding.from_hf_config(dict(LLAMA, rope_theta=-(10**400))),
     r"from_hf_config: rope_theta must be finite, got an int of 1329 bits"),
    (lambda: rotary.RotaryEmbedding.from_hf_config(dict(LLAMA, rope_theta=-2)),
     r"from_hf_config: rope_theta must be a finite number > 0, got -2"),
    (lambda: rotary.RotaryEmbedding(64, 2**40), r"freqs_table: a table of max_seq_len=1099511627776 rows"),
    (lambda: rotary.CppRotaryEmbedding(64, 2**40), r"freqs_table: a table of max_seq_len=1099511627776 rows"),
    (lambda: rotary.RotaryEmbedding.from_hf_config(LLAMA, max_seq_len=2**40),
     r"RotaryEmbedding\(dim=64, .*\): freqs_table: a table of max_seq_len=1099511627776 rows x dim // 2 = 32 pairs "
     r"needs 281474976710656 bytes"),
])
def test_table_arguments_out_of_range_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_tables_in_range_still_build():
    assert rotary.freqs_table(128, 1 << 14).shape == (1 << 14, 64)
    assert rotary.RotaryEmbedding.from_hf_config(dict(LLAMA, max_position_embeddings=1 << 14)).max_seq_len == 1 << 14
