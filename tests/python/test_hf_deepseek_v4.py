"""DeepSeek-V4 against transformers' own rotary code: (2j, 2j+1) pairs over the
trailing span of each head (the attention's head_dim heads and the indexer's
index_head_dim ones), tables keyed by rope type ("main" for sliding-window
layers, "compress" for the compressed ones and their compressors), and the
attention output turned back with (cos, -sin): the inverse rotation, which a
patched model gets from negating the handle. The same inputs and tolerance as
test_hf_config.py; the sweep checks the whole model (hf_sweep)."""

import pytest
import torch

import rotary
from rotary.hf import layer_types_of, rope_kwargs_from_hf_config
from rotary.integrations._rope_state import _RopeState
from rotary.integrations.transformers import RotaryPositions
from test_hf_config import ATOL, SMALL, gen, make_config, modeling, randn

pytestmark = pytest.mark.filterwarnings("ignore")
B, S, H = 2, 7, 3
V4 = dict(SMALL, head_dim=32, qk_rope_head_dim=8, index_head_dim=16, q_lora_rank=16, o_lora_rank=8, o_groups=2,
          n_routed_experts=2, num_experts_per_tok=1)
# V4's shipped compress rule: yarn, attention_factor 1.0 (set by its config class).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {"deepseek_v4"}


def config(rule):
    return make_config("DeepseekV4Config", **V4, **({"rope_parameters": dict(rule)} if rule else {}))


def theirs(cfg, x, pos, layer_type, inverse):
    m = modeling("deepseek_v4")
    cos, sin = m.DeepseekV4RotaryEmbedding(cfg)(x, pos, layer_type=layer_type)
    return m.apply_rotary_pos_emb(x, cos, -sin if inverse else sin)


@pytest.mark.parametrize("rule", [None, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("layer_type", ["main", "compress"])
@pytest.mark.parametrize("width", [32, 16], ids=["attention", "indexer"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_matches_transformers(rule, layer_type, width, inverse):
    cfg = config(rule)
    assert layer_types_of(cfg) == ["compress", "main"]
    rope = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type=layer_type)
    assert (rope.dim, rope.rotary_offset, rope.interleaved) == (8, 24, True)
    x = randn((B, H, S, width), seed=width + inverse)
    pos = torch.randint(0, 60, (B, S), generator=gen(3))
    want = theirs(cfg, x, pos, layer_type, inverse)
    got = rotary.apply_rope(x, rope.freqs, 0, True, position_ids=pos, inverse=inverse,
                            rotary_offset=width - rope.dim)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if width == cfg.head_dim and not inverse:  # the module, at its own offset
        torch.testing.assert_close(rope(x, position_ids=pos), want, atol=ATOL, rtol=0)
    assert rope_kwargs_from_hf_config(cfg.to_dict(), layer_type=layer_type) == \
        rope_kwargs_from_hf_config(cfg, layer_type=layer_type)


def test_tolerance_is_meaningful():
    """The leading span, or rotate_half pairs, miss transformers by far more than ATOL."""
    cfg = config(None)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type="main")
    x = randn((B, H, S, 32), seed=5)
    pos = torch.randint(0, 60, (B, S), generator=gen(6))
    want = theirs(cfg, x, pos, "main", False)
    for offset, interleaved in ((0, True), (24, False)):
        got = rotary.apply_rope(x, rope.freqs, 0, interleaved, position_ids=pos, rotary_offset=offset)
        assert (got - want).abs().max().item() > 100 * ATOL


def test_config_without_rope_type_keys_is_refused():
    """Its config class builds the "main" and "compress" rules from top-level
    fields; a dict whose rope_parameters is flat is not read as one rule."""
    flat = {**config(None).to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"deepseek_v4's config class builds rope_parameters keyed by 'compress', "
                                         r"'main' from its top-level fields \(rope_theta, compress_rope_theta, "
                                         r"qk_rope_head_dim\); got rope_parameters \{'rope_type': 'default'"):
        rope_kwargs_from_hf_config(flat)
    with pytest.raises(ValueError, match=r"rope_parameters is nested by layer type \(main, compress\); pass "
                                         r"layer_type="):
        rope_kwargs_from_hf_config(config(None))


def test_handle_negation_is_the_inverse_rotation():
    """(h, -h) rotates back exactly what (h, h) rotated; any other pair raises."""
    rope = rotary.RotaryEmbedding.from_hf_config(config(None), layer_type="main")
    state = _RopeState(rope, trailing=True)
    pos = torch.randint(0, 60, (B, S), generator=gen(7))
    h = RotaryPositions(pos, state)
    x = randn((B, H, S, 32), seed=8)
    y = h.apply_one(x, 1, sin=h)
    torch.testing.assert_close(y, rope(x, position_ids=pos), atol=0, rtol=0)
    torch.testing.assert_close(h.apply_one(y, 1, sin=-h), x, atol=1e-6, rtol=0)
    assert x.shape[-1] == 32 and torch.equal(h.apply_one(x, 1, sin=-(-h)), y)
    other = RotaryPositions(pos.clone(), state)
    for cos, sin in ((-h, h), (-h, -h), (h, other), (h, torch.ones(1))):
        with pytest.raises(TypeError, match=r"takes the \(cos, sin\) pair of one patched rotary embedding call, "
                                            r"or \(cos, -sin\) for the inverse rotation"):
            cos.apply_one(x, 1, sin=sin)
    with pytest.raises(ValueError, match=r"turns the last 8 dims of each head, got a tensor of shape \(2, 3, 7, 6\)"):
        h.apply_one(x[..., :6], 1, sin=h)


@pytest.mark.parametrize("rule", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["default", "dynamic"])
def test_patch_builds_each_table_once(rule):
    """Every compressor and indexer owns a rotary_emb (over 60 in the 1M-position
    model): equal tables are built once and shared, except a host-driven
    rule's, which follows its own embedding's calls."""
    from rotary_testing.hf_tiny import tiny_model

    from rotary.integrations.transformers import rotary_patched

    model = tiny_model("deepseek_v4", "DeepseekV4ForCausalLM", dict(rope_parameters=rule) if rule else None)
    with rotary_patched(model):
        patched = model._rotary_integration_state.rotary
        states = {t: {id(s[t]) for _, _, s in patched} for t in ("main", "compress")}
    assert len(patched) == 4  # the model's, two compressors', the indexer's
    assert len(states["main"]) == 1
    assert len(states["compress"]) == (4 if rule else 1)
