"""from_hf_config against transformers' own rotary code for families whose
layers differ: RoPE on some layers only (Cohere 2's sliding-window layers,
no_rope_layers, Zamba2's use_mem_rope), per-layer bases (GraniteSWA's layer_rope_theta), per-layer-type
rules (MiMo-V2-Flash, Cohere Compass's M-RoPE), NanoChat's negative angle, a documented field the code never reads (MiniMax-M3's
rotary_dim) and Llama 4's complex freqs_cis. The same inputs and tolerance as
test_hf_config.py; the sweep checks the whole models."""

import pytest
import torch

import rotary
from rotary.hf import layer_thetas_of, layer_types_of, rope_kwargs_from_hf_config
from test_hf_config import ATOL, SMALL, hf_and_ours, hf_std, inputs, make_config, modeling

pytestmark = pytest.mark.filterwarnings("ignore")
PARTIAL = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


def hf_llama4(cfg, q, k, pos):  # complex pairs of q / k in BSHD, as Llama4TextAttention rotates them
    m = modeling("llama4")
    freqs_cis = m.Llama4TextRotaryEmbedding(cfg)(q, pos)
    xq, xk = m.apply_rotary_emb(q.transpose(1, 2), k.transpose(1, 2), freqs_cis)
    return xq.transpose(1, 2), xk.transpose(1, 2)


# (id, model_type, config class, kwargs, adapter, head dim of q / k, 3-D positions), as in test_hf_config
CASES = [
    ("cohere2", "cohere2", "Cohere2Config", dict(SMALL, head_dim=16), hf_std("cohere2", "Cohere2RotaryEmbedding"),
     16, False),
    ("cohere2_moe", "cohere2_moe", "Cohere2MoeConfig", dict(SMALL, head_dim=16, num_local_experts=2),
     hf_std("cohere2_moe", "Cohere2MoeRotaryEmbedding"), 16, False),
    ("smollm3", "smollm3", "SmolLM3Config", SMALL, hf_std("smollm3", "SmolLM3RotaryEmbedding"), 16, False),
    ("granite_swa", "granite_swa", "GraniteSWAConfig", SMALL, hf_std("granite_swa", "GraniteSWARotaryEmbedding"),
     16, False),
    ("granitemoe_swa", "granitemoe_swa", "GraniteMoeSWAConfig", dict(SMALL, num_local_experts=2),
     hf_std("granitemoe_swa", "GraniteMoeSWARotaryEmbedding"), 16, False),
    ("minimax_m3_vl_text-partial", "minimax_m3_vl_text", "MiniMaxM3VLTextConfig",
     dict(SMALL, head_dim=16, rotary_dim=4, rope_parameters=PARTIAL),
     hf_std("minimax_m3_vl", "MiniMaxM3VLRotaryEmbedding"), 16, False),
    ("llama4_text", "llama4_text", "Llama4TextConfig", dict(SMALL, head_dim=16), hf_llama4, 16, False),
    # Zamba2's shared attention rotates only with use_mem_rope.
    ("zamba2", "zamba2", "Zamba2Config", dict(SMALL, head_dim=16, use_mem_rope=True, layers_block_type=["hybrid"]),
     hf_std("zamba2", "Zamba2RotaryEmbedding"), 16, False),
]
# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {c[1] for c in CASES} | {"granite_swa", "granitemoe_swa", "mimo_v2_flash", "llama4", "cohere_compass_text",
                                  "nanochat"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(case):
    cfg, _, _, want, got = hf_and_ours(case, seed=len(case[0]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)


@pytest.mark.parametrize("cls,mt", [("GraniteSWAConfig", "granite_swa"), ("GraniteMoeSWAConfig", "granitemoe_swa")])
def test_granite_swa_one_table_per_base(cls, mt):
    cfg = make_config(cls, **dict(SMALL, num_hidden_layers=3, num_local_experts=2),
                      layer_rope_theta=[1e4, 0, 5e5])
    assert layer_thetas_of(cfg) == [1e4, 5e5]
    with pytest.raises(ValueError, match=r"2 bases .*pass layer_theta="):
        rope_kwargs_from_hf_config(cfg)
    with pytest.raises(ValueError, match="is not a base of layer_rope_theta"):
        rope_kwargs_from_hf_config(cfg, layer_theta=1e5)
    m = modeling(mt)
    model = getattr(m, [n for n in dir(m) if n.endswith("SWAModel")][0])(cfg)
    q, k, pos = inputs(16, False, 5)
    for emb in model.rotary_embs:  # one per base, as the model builds them
        base = emb.config.rope_parameters["rope_theta"]
        want = m.apply_rotary_pos_emb(q, k, *emb(q, pos))
        got = rotary.RotaryEmbedding.from_hf_config(cfg, layer_theta=base)(q, k, position_ids=pos)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("given", [False, True], ids=["default", "no-partial"])
def test_mimo_v2_flash_per_layer_type(given):
    # Without partial_rotary_factor, its rotary code rotates 0.334 of the head.
    params = {t: {"rope_type": "default", "rope_theta": b} for t, b in (("full_attention", 5e6),
                                                                       ("sliding_attention", 1e4))}
    cfg = make_config("MiMoV2FlashConfig", **dict(SMALL, head_dim=32, num_hidden_layers=2),
                      **({"rope_parameters": params} if given else {}))
    m = modeling("mimo_v2_flash")
    emb = m.MiMoV2FlashRotaryEmbedding(cfg)
    q, k, pos = inputs(32, False, 7)
    assert layer_types_of(cfg) == ["full_attention", "sliding_attention"]
    for layer_type in layer_types_of(cfg):
        want = m.apply_rotary_pos_emb(q, k, *emb(q, pos, layer_type))
        rope = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type=layer_type)
        assert rope.dim == 10  # int(32 * 0.334)
        for g, w in zip(rope(q, k, position_ids=pos), want):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_llama4_dict_form_reads_as_its_text_config():
    cfg = make_config("Llama4TextConfig", **dict(SMALL, head_dim=16))
    nested = {"model_type": "llama4", "text_config": cfg.to_dict()}
    assert rope_kwargs_from_hf_config(nested) == rope_kwargs_from_hf_config(cfg)
    # Llama4Config builds its text_config from its own defaults, not from top-level fields.
    with pytest.raises(ValueError, match=r"the llama4 dict has no text_config"):
        rope_kwargs_from_hf_config({**cfg.to_dict(), "model_type": "llama4"})


@pytest.mark.parametrize("sections", [None, [4, 2, 2]], ids=["default", "given"])
def test_cohere_compass_mrope_per_layer_type(sections):
    # Its rotary class defaults mrope_section to (24, 20, 20) (a 128-wide head), laid out as Qwen3-VL's.
    head = 128 if sections is None else 16
    params = {"full_attention": {"rope_type": "default", "rope_theta": 1e4, **({"mrope_section": sections}
                                                                               if sections else {})},
              "sliding_attention": None}  # no RoPE on these layers
    cfg = make_config("CohereCompassTextConfig", **dict(SMALL, hidden_size=4 * head, num_hidden_layers=2),
                      layer_types=["sliding_attention", "full_attention"], rope_parameters=params)
    m = modeling("cohere_compass")
    q, k, pos = inputs(head, True, 8)
    assert layer_types_of(cfg) == ["full_attention"]
    want = m.apply_rotary_pos_emb(q, k, *m.CohereCompassRotaryEmbedding(cfg)(q, pos, "full_attention"))
    rope = rotary.RotaryEmbedding.from_hf_config(cfg, layer_type="full_attention")
    assert rope.mrope_section == (sections or [24, 20, 20]) and rope.mrope_interleaved
    for g, w in zip(rope(q, k, position_ids=pos), want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_nanochat_rotates_by_the_negative_angle():
    cfg = make_config("NanoChatConfig", **SMALL)
    with pytest.raises(ValueError, match="'nanochat' rotates by the negative angle"):
        rope_kwargs_from_hf_config(cfg)
    m = modeling("nanochat")
    q, k, pos = inputs(16, False, 9)
    want = m.apply_rotary_pos_emb(q, k, *m.NanoChatRotaryEmbedding(cfg)(q, pos))
    rope = rotary.RotaryEmbedding(**rope_kwargs_from_hf_config(cfg, allow_inverse=True))
    got = rotary.apply_rope_qk(q, k, rope.freqs, 0, rope.interleaved, position_ids=pos, inverse=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    plain = rope(q, k, position_ids=pos)  # without inverse: far off
    assert (plain[0] - want[0]).abs().max() > 100 * ATOL


def test_refusals():
    with pytest.raises(ValueError, match="has no per-layer bases"):
        rope_kwargs_from_hf_config(make_config("LlamaConfig", **SMALL), layer_theta=1e4)


def test_a_layer_types_refusal_names_the_layer_type():
    d = {"model_type": "gemma3_text", "head_dim": 8, "hidden_size": 32, "num_attention_heads": 4,
         "max_position_embeddings": 64, "layer_types": ["sliding_attention", "full_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": None},
                             "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6,
                                                "original_max_position_embeddings": None}}}
    with pytest.raises(ValueError, match=r"^from_hf_config \(layer_type='sliding_attention'\): "
                                         r"rope_parameters\['rope_theta'\] is None"):
        rope_kwargs_from_hf_config(d, layer_type="sliding_attention")
    with pytest.raises(ValueError, match=r"^from_hf_config \(layer_type='full_attention'\): the yarn rule's "
                                         "original_max_position_embeddings is None"):
        rope_kwargs_from_hf_config(d, layer_type="full_attention")
    with pytest.raises(ValueError, match=r"^from_hf_config: layer_type='x' is not a layer type"):
        rope_kwargs_from_hf_config(d, layer_type="x")
    # A rule's own words (the C++ RopeScaling check) are prefixed the same way.
    d["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": -1.0, "rope_theta": 1e6}
    with pytest.raises(ValueError, match=r"^from_hf_config \(layer_type='full_attention'\): RopeScaling\(type='linear'\): "
                                         "factor must be finite and > 0, got -1"):
        rope_kwargs_from_hf_config(d, layer_type="full_attention")
