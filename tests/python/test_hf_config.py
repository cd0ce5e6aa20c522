"""from_hf_config against transformers' own rotary code, one family at a time
(rotary.hf_families.FAMILIES). How single config fields are read, and its
refusals, are in test_hf_config_fields.py; this file keeps CASES and the
helpers that file and test_hf_layers / test_hf_mla / test_hf_deepseek_v4 import.

For each family: a tiny config from transformers' config class, random q / k
(fp32, never zeros) at random positions, transformers' rotary embedding +
its apply function (or the family's equivalent) against
RotaryEmbedding.from_hf_config(config). Tolerance 3e-5: transformers forms
angles in fp32 (error ~6e-8 * position rad; positions < 64 here), ours in
float64; test_tolerance_is_meaningful checks a wrong pairing or span misses
by far more.
"""

import importlib
import warnings

import pytest
import torch

import rotary
from rotary import hf_families
from rotary.hf import rope_kwargs_from_hf_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore")
ATOL = 3e-5
B, S, H, KV, MAX_POS = 2, 7, 4, 2, 128
SMALL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=H,
             num_key_value_heads=KV, vocab_size=32, max_position_embeddings=MAX_POS)
MLA = dict(SMALL, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=8,
           n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed):
    return torch.randn(shape, generator=gen(seed)) + 0.1  # never zeros


def make_config(cls_name, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls_name)(**kw)


def modeling(model_type):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


# ---------------------------------------------------------------- HF adapters
# Each returns transformers' rotated (q, k), BHSD, for [B, S] (or [3, B, S]) positions.
def hf_std(mt, rotary_cls):
    def run(cfg, q, k, pos):
        m = modeling(mt)
        cos, sin = getattr(m, rotary_cls)(config=cfg)(q, pos)
        return m.apply_rotary_pos_emb(q, k, cos, sin)
    return run


def hf_split(mt, rotary_cls):
    def run(cfg, q, k, pos):  # partial rotary split in the attention (Phi, StableLM, Persimmon)
        m = modeling(mt)
        cos, sin = getattr(m, rotary_cls)(config=cfg)(q, pos)
        r = cos.shape[-1]
        q_rot, k_rot = m.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
        return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)
    return run


def hf_gptj(mt, rotary_cls):
    def run(cfg, q, k, pos):  # GPT-J rotates BSHD, the first rotary_dim dims
        m, r = modeling(mt), cfg.rotary_dim
        sin, cos = getattr(m, rotary_cls)(cfg)(q, pos)
        out = []
        for x in (q, k):
            x = x.transpose(1, 2)
            rot = m.apply_rotary_pos_emb(x[..., :r], sin, cos)
            out.append(torch.cat([rot, x[..., r:]], dim=-1).transpose(1, 2))
        return tuple(out)
    return run


def hf_deepseek_v2(cfg, q, k, pos):
    m, nope = modeling("deepseek_v2"), cfg.qk_nope_head_dim
    freqs_cis = m.DeepseekV2RotaryEmbedding(cfg)(q, pos)
    q_pe, k_pe = m.apply_rotary_emb(q[..., nope:], k[..., nope:], freqs_cis)
    return torch.cat([q[..., :nope], q_pe], -1), torch.cat([k[..., :nope], k_pe], -1)


def hf_mla(mt, rotary_cls):
    def run(cfg, q, k, pos):  # the attention's split / apply / cat, as in DeepseekV3Attention
        m, nope = modeling(mt), cfg.qk_nope_head_dim
        cos, sin = getattr(m, rotary_cls)(cfg)(q, pos)
        apply = m.apply_rotary_pos_emb_interleave if getattr(cfg, "rope_interleave", False) else m.apply_rotary_pos_emb
        q_pe, k_pe = apply(q[..., nope:], k[..., nope:], cos, sin)
        return torch.cat([q[..., :nope], q_pe], -1), torch.cat([k[..., :nope], k_pe], -1)
    return run


def deinterleave(x, offset):
    """DeepSeek-V3's interleave output layout: each rotated span as evens, then odds."""
    span = x[..., offset:]
    return torch.cat([x[..., :offset], span[..., 0::2], span[..., 1::2]], dim=-1)


# ------------------------------------------------------------------- families
# (id, model_type, config class, kwargs, adapter, head dim of q / k, 3-D positions)
CASES = [
    ("llama", "llama", "LlamaConfig", SMALL, hf_std("llama", "LlamaRotaryEmbedding"), 16, False),
    ("llama-yarn", "llama", "LlamaConfig", dict(SMALL, rope_parameters=YARN),
     hf_std("llama", "LlamaRotaryEmbedding"), 16, False),
    ("mistral", "mistral", "MistralConfig", SMALL, hf_std("mistral", "MistralRotaryEmbedding"), 16, False),
    ("mixtral", "mixtral", "MixtralConfig", dict(SMALL, num_local_experts=2),
     hf_std("mixtral", "MixtralRotaryEmbedding"), 16, False),
    ("qwen2", "qwen2", "Qwen2Config", SMALL, hf_std("qwen2", "Qwen2RotaryEmbedding"), 16, False),
    ("qwen3", "qwen3", "Qwen3Config", dict(SMALL, head_dim=16), hf_std("qwen3", "Qwen3RotaryEmbedding"), 16, False),
    ("qwen3_moe", "qwen3_moe", "Qwen3MoeConfig", dict(SMALL, head_dim=16, num_experts=2),
     hf_std("qwen3_moe", "Qwen3MoeRotaryEmbedding"), 16, False),
    ("phi3-partial", "phi3", "Phi3Config",
     dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     hf_std("phi3", "Phi3RotaryEmbedding"), 16, False),
    ("gpt_neox-partial", "gpt_neox", "GPTNeoXConfig",
     dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     hf_std("gpt_neox", "GPTNeoXRotaryEmbedding"), 16, False),
    ("gpt_neox_japanese-partial", "gpt_neox_japanese", "GPTNeoXJapaneseConfig", dict(SMALL, rotary_pct=0.5),
     hf_split("gpt_neox_japanese", "GPTNeoXJapaneseRotaryEmbedding"), 16, False),
    ("phi4_multimodal-partial", "phi4_multimodal", "Phi4MultimodalConfig",
     dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}),
     hf_std("phi4_multimodal", "Phi4MultimodalRotaryEmbedding"), 16, False),
    ("phi-partial", "phi", "PhiConfig", SMALL, hf_split("phi", "PhiRotaryEmbedding"), 16, False),
    ("stablelm-partial", "stablelm", "StableLmConfig", SMALL, hf_split("stablelm", "StableLmRotaryEmbedding"), 16, False),
    ("persimmon-partial", "persimmon", "PersimmonConfig", SMALL,
     hf_split("persimmon", "PersimmonRotaryEmbedding"), 16, False),
    ("gemma", "gemma", "GemmaConfig", dict(SMALL, head_dim=16), hf_std("gemma", "GemmaRotaryEmbedding"), 16, False),
    ("olmo", "olmo", "OlmoConfig", SMALL, hf_std("olmo", "OlmoRotaryEmbedding"), 16, False),
    ("olmo2", "olmo2", "Olmo2Config", SMALL, hf_std("olmo2", "Olmo2RotaryEmbedding"), 16, False),
    ("granite", "granite", "GraniteConfig", SMALL, hf_std("granite", "GraniteRotaryEmbedding"), 16, False),
    ("starcoder2", "starcoder2", "Starcoder2Config", SMALL,
     hf_std("starcoder2", "Starcoder2RotaryEmbedding"), 16, False),
    ("glm4_moe-partial", "glm4_moe", "Glm4MoeConfig", dict(SMALL, head_dim=16, n_routed_experts=2),
     hf_std("glm4_moe", "Glm4MoeRotaryEmbedding"), 16, False),
    ("qwen2_vl", "qwen2_vl_text", "Qwen2VLTextConfig",
     dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
     hf_std("qwen2_vl", "Qwen2VLRotaryEmbedding"), 16, True),
    ("qwen2_5_vl", "qwen2_5_vl_text", "Qwen2_5_VLTextConfig",
     dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
     hf_std("qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding"), 16, True),
    ("qwen3_vl", "qwen3_vl_text", "Qwen3VLTextConfig",
     dict(SMALL, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}),
     hf_std("qwen3_vl", "Qwen3VLTextRotaryEmbedding"), 16, True),
    ("ministral3", "ministral3", "Ministral3Config",
     dict(SMALL, head_dim=16, rope_parameters=dict(YARN, llama_4_scaling_beta=0.1)),
     hf_std("ministral3", "Ministral3RotaryEmbedding"), 16, False),
    ("qwen3_5_text", "qwen3_5_text", "Qwen3_5TextConfig", dict(SMALL, head_dim=256),
     hf_std("qwen3_5", "Qwen3_5TextRotaryEmbedding"), 256, True),
    ("qwen3_5_moe_text", "qwen3_5_moe_text", "Qwen3_5MoeTextConfig", dict(SMALL, head_dim=256, num_experts=2),
     hf_std("qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding"), 256, True),
    # interleaved pairs
    ("gptj", "gptj", "GPTJConfig", dict(n_embd=64, n_head=H, n_layer=1, vocab_size=32, n_positions=MAX_POS,
                                         rotary_dim=8), hf_gptj("gptj", "GPTJRotaryEmbedding"), 16, False),
    ("codegen", "codegen", "CodeGenConfig", dict(n_embd=64, n_head=H, n_layer=1, vocab_size=32, n_positions=MAX_POS,
                                                  rotary_dim=8), hf_gptj("codegen", "CodeGenRotaryEmbedding"), 16, False),
    ("cohere", "cohere", "CohereConfig", SMALL, hf_std("cohere", "CohereRotaryEmbedding"), 16, False),
    ("glm-partial", "glm", "GlmConfig", dict(SMALL, head_dim=16), hf_std("glm", "GlmRotaryEmbedding"), 16, False),
    ("glm4-partial", "glm4", "Glm4Config", dict(SMALL, head_dim=16), hf_std("glm4", "Glm4RotaryEmbedding"), 16, False),
    ("helium", "helium", "HeliumConfig", dict(SMALL, head_dim=16), hf_std("helium", "HeliumRotaryEmbedding"), 16, False),
    ("ernie4_5", "ernie4_5", "Ernie4_5Config", dict(SMALL, head_dim=16),
     hf_std("ernie4_5", "Ernie4_5RotaryEmbedding"), 16, False),
    ("ernie4_5_moe", "ernie4_5_moe", "Ernie4_5_MoeConfig", dict(SMALL, head_dim=16, moe_num_experts=2),
     hf_std("ernie4_5_moe", "Ernie4_5_MoeRotaryEmbedding"), 16, False),
    # MLA [nope | rope] heads
    ("deepseek_v2", "deepseek_v2", "DeepseekV2Config", MLA, hf_deepseek_v2, 20, False),
    ("deepseek_v3", "deepseek_v3", "DeepseekV3Config", MLA, hf_mla("deepseek_v3", "DeepseekV3RotaryEmbedding"),
     20, False),
    ("deepseek_v3-half", "deepseek_v3", "DeepseekV3Config", dict(MLA, rope_interleave=False),
     hf_mla("deepseek_v3", "DeepseekV3RotaryEmbedding"), 20, False),
    ("deepseek_v3-yarn-mscale", "deepseek_v3", "DeepseekV3Config",
     dict(MLA, rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=1.0)),
     hf_mla("deepseek_v3", "DeepseekV3RotaryEmbedding"), 20, False),
    ("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteConfig", MLA,
     hf_mla("glm4_moe_lite", "Glm4MoeLiteRotaryEmbedding"), 20, False),
    ("axk1", "axk1", "AXK1Config", dict(MLA, q_lora_rank=16), hf_mla("axk1", "AXK1RotaryEmbedding"), 20, False),
    ("youtu", "youtu", "YoutuConfig", MLA, hf_mla("youtu", "YoutuRotaryEmbedding"), 20, False),
    ("minicpm3", "minicpm3", "MiniCPM3Config", MLA, hf_mla("minicpm3", "MiniCPM3RotaryEmbedding"), 20, False),
    ("hy_v4", "hy_v4", "HYV4Config", dict(MLA, q_lora_rank=16), hf_mla("hy_v4", "HYV4RotaryEmbedding"), 20, False),
    # Head width and sizes under the config class's own names (its attribute_map): kv_channels = 24, not
    # hidden_size / heads = 16; DBRX's d_model / n_heads / max_seq_len.
    ("jetmoe", "jetmoe", "JetMoeConfig", dict(SMALL, kv_channels=24, num_local_experts=2),
     hf_std("jetmoe", "JetMoeRotaryEmbedding"), 24, False),
    ("dbrx", "dbrx", "DbrxConfig", dict(d_model=64, n_heads=H, n_layers=1, vocab_size=32, max_seq_len=MAX_POS,
                                        attn_config={"kv_n_heads": KV}, ffn_config={"moe_num_experts": 2}),
     hf_std("dbrx", "DbrxRotaryEmbedding"), 16, False),
]
IDS = [c[0] for c in CASES]


def inputs(head_dim, nd, seed):
    q, k = randn((B, H, S, head_dim), seed), randn((B, KV, S, head_dim), seed + 1)
    pos = torch.randint(0, 60, (B, S), generator=gen(seed + 2))
    if nd:  # an image-grid-like [3, B, S]: t, h, w differ
        pos = torch.stack([pos, pos + torch.randint(0, 3, (B, S), generator=gen(seed + 3)),
                           pos + torch.randint(0, 3, (B, S), generator=gen(seed + 4))])
    return q, k, pos


def hf_and_ours(case, seed=0):
    _, mt, cls, kw, adapter, head_dim, nd = case
    cfg = make_config(cls, **kw)
    assert cfg.model_type == mt
    q, k, pos = inputs(head_dim, nd, seed)
    want = adapter(cfg, q, k, pos)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    got = rope(q, k, position_ids=pos)
    return cfg, rope, (q, k, pos), want, got


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_transformers(case):
    cfg, rope, (q, k, pos), want, got = hf_and_ours(case, seed=len(case[0]))
    if getattr(cfg, "rope_interleave", False):
        # Same pairs; transformers writes them de-interleaved. Same scores.
        got_perm = [deinterleave(t, rope.rotary_offset) for t in got]
        for g, w in zip(got_perm, want):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        scores = lambda a, b: a @ b.repeat_interleave(H // KV, 1).transpose(-1, -2)  # noqa: E731
        torch.testing.assert_close(scores(*got), scores(*want), atol=ATOL * 20, rtol=0)
    else:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    # The plain-dict form gives the same module.
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)


def test_table_keys_are_transformers_model_types():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert not [k for k, f in hf_families.FAMILIES.items() if f.refuse is None and k not in CONFIG_MAPPING_NAMES]


def test_every_family_is_tested():
    from test_hf_layers import TESTED  # families whose layers differ, tested there
    from test_hf_mla import TESTED as MLA_TESTED  # MLA families beyond these CASES
    from test_hf_deepseek_v4 import TESTED as V4_TESTED
    from test_hf_qwen4_exp import TESTED as QWEN4_TESTED
    from test_hf_review_fixes import TESTED as REVIEW_TESTED
    from test_hf_verified_families import TESTED as VERIFIED
    from test_hf_ernie_vl import TESTED as ERNIE_VL
    from test_hf_vision_axial import TESTED as TOWERS

    tested = {c[1] for c in CASES} | TESTED | MLA_TESTED | V4_TESTED | QWEN4_TESTED | REVIEW_TESTED | VERIFIED | ERNIE_VL | TOWERS
    for name, fam in hf_families.FAMILIES.items():
        if fam.refuse is None:
            assert name in tested or name in {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}, name


MEANINGFUL = ("gptj", "cohere", "deepseek_v3", "phi3-partial")


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in MEANINGFUL], ids=lambda c: c[0])
def test_tolerance_is_meaningful(case):
    """Flipping the pairing, or rotating another span, misses transformers by far more than ATOL."""
    cfg, rope, (q, k, pos), want, _ = hf_and_ours(case, seed=3)
    kw = rope_kwargs_from_hf_config(cfg)
    span = dict(kw, rotary_offset=0) if kw.get("rotary_offset") else (
        dict(kw, rotary_offset=2) if kw["dim"] + 2 <= q.shape[-1] else dict(kw, dim=kw["dim"] - 2))
    for bad in (dict(kw, interleaved=not kw["interleaved"]), span):
        out = rotary.RotaryEmbedding(**bad)(q, k, position_ids=pos)
        if case[1] == "deepseek_v3":
            out = [deinterleave(t, kw.get("rotary_offset", 0)) for t in out]
        assert max((o - w).abs().max().item() for o, w in zip(out, want)) > 100 * ATOL, bad
