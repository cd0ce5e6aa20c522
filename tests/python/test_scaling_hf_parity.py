"""Frequency (scaling) rules against Hugging Face transformers' own rotary
embedding: RotaryEmbedding.from_hf_config and rope_kwargs_from_hf_config.
Split from test_scaling.py (the rules against the published formulas).

Tiny configs built in code (nothing downloaded), transformers' rotary
embedding + apply_rotary_pos_emb on random q, k and position_ids, against
RotaryEmbedding.from_hf_config(config)(q, k, position_ids=...).
transformers computes angles in fp32, so the fp32 tolerance grows with the
largest position (see _fp32_tol); bf16 is compared at a bf16 tolerance.
"""

import copy

import pytest
import torch

import rotary
from test_scaling_modules import _qk

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, LlamaConfig  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


# ---------------------------------------------------------------------------
# Hugging Face transformers parity
# ---------------------------------------------------------------------------
def _llama(rope_parameters, max_pos=128, **kw):
    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        intermediate_size=128, vocab_size=32, max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters), **kw)


def _position_ids(batch, seq, top, seed):
    """[batch, seq] int64 ids: one row ends at `top`, the other is shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.arange(top - seq + 1, top + 1)]
    for _ in range(batch - 1):
        rows.append(torch.randperm(top + 1, generator=g)[:seq].sort().values)
    return torch.stack(rows).long()


def _hf_apply(hf_rope, apply_fn, q, k, position_ids):
    cos, sin = hf_rope(q, position_ids)
    return apply_fn(q, k, cos, sin)


def _fp32_tol(max_pos, att=1.0):
    # transformers forms the angle pos * inv_freq in fp32: off by up to about
    # 2 roundings of pos * 2^-24 rad (inv_freq <= 1); ours is float64. Measured
    # |ours - transformers| is ~3.5e-8 * max_pos (e.g. 2.6e-5 at 1000); the
    # bound below, 2e-6 + 2.4e-7 * max_pos, leaves 5-10x headroom.
    return 2e-6 + 2.0 * 2.0**-23 * (max_pos + 1) * att


def _exact(x, position_ids, inv_freq, att):
    """float64 rotate_half RoPE of x with the given frequencies and scaling."""
    angle = position_ids[:, None, :, None].double() * inv_freq.double().cpu()
    c, s = angle.cos() * att, angle.sin() * att
    rot = 2 * inv_freq.numel()
    x = x.double()
    x1, x2, rest = x[..., : rot // 2], x[..., rot // 2 : rot], x[..., rot:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)


def _assert_parity(ours_mod, hf_rope, apply_fn, cfg_head_dim, calls, seed, dtype=torch.float32):
    """Calls both modules with the same q, k, position_ids, in order (so the
    host-driven rules go through the same states), and checks
    - ours against transformers: fp32 at _fp32_tol; bf16 at atol 4e-2,
      rtol 2e-2 (transformers rounds cos/sin to bf16 and every product, up to
      2 bf16 ulps here; we round once);
    - ours against the exact float64 rotation by our own frequencies: 1e-6
      (fp32) or 1 bf16 ulp (bf16);
    - our float64 inv_freq against transformers' fp32 one (rtol 2e-6) and the
      attention scaling (rel 1e-6)."""
    for i, top in enumerate(calls):
        q, k = _qk(2, 24, cfg_head_dim, dtype, seed + i)
        pid = _position_ids(2, 24, top, seed + 100 + i)
        qh, kh = _hf_apply(hf_rope, apply_fn, q, k, pid)
        qo, ko = ours_mod(q, k, position_ids=pid)
        assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
        if dtype == torch.float32:
            tol, rtol = _fp32_tol(top, hf_rope.attention_scaling), 0.0
        else:
            tol, rtol = 4e-2, 2e-2
        torch.testing.assert_close(qo, qh, atol=tol, rtol=rtol, msg=lambda m: f"q, call {i} (top {top}): {m}")
        torch.testing.assert_close(ko, kh, atol=tol, rtol=rtol, msg=lambda m: f"k, call {i} (top {top}): {m}")
        for x, out in ((q, qo), (k, ko)):
            exact = _exact(x, pid, ours_mod.inv_freq, ours_mod.attention_scaling)
            if dtype == torch.float32:
                torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=0.0)
            else:
                torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=2.0**-7)
        # The rule itself: our float64 frequencies against transformers' fp32 ones.
        torch.testing.assert_close(
            hf_rope.inv_freq.double(), ours_mod.inv_freq.double(), rtol=2e-6, atol=0.0)
        assert ours_mod.attention_scaling == pytest.approx(hf_rope.attention_scaling, rel=1e-6)


LONG_SHORT = [1.0 + 0.05 * j for j in range(8)]
LONG_LONG = [1.0 + 1.7 * j for j in range(8)]

HF_CASES = [
    # id, rope_parameters, max_position_embeddings, calls (largest position id of each call)
    ("default", {"rope_type": "default", "rope_theta": 10000.0}, 128, [23, 127]),
    ("default-theta5e5", {"rope_type": "default", "rope_theta": 500000.0}, 512, [300]),
    ("linear", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 512, [100, 511]),
    # dynamic: below max_position_embeddings, then growth twice, a call in
    # between (keeps the grown base), then back under (resets)
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 64, [40, 150, 400, 200, 30]),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
              "rope_theta": 10000.0}, 1024, [100, 1000]),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                     "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2,
                     "rope_theta": 10000.0}, 1024, [700]),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "attention_factor": 1.25, "truncate": False, "rope_theta": 50000.0}, 256, [255]),
    ("llama3", {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}, 2048, [90, 900]),
    # longrope: short factors under original_max_position_embeddings, long above, then back
    ("longrope", {"rope_type": "longrope", "short_factor": LONG_SHORT, "long_factor": LONG_LONG,
                  "original_max_position_embeddings": 64, "rope_theta": 10000.0}, 256, [50, 200, 63, 64]),
    ("longrope-factor", {"rope_type": "longrope", "short_factor": LONG_SHORT, "long_factor": LONG_LONG,
                         "original_max_position_embeddings": 64, "factor": 3.0, "rope_theta": 10000.0},
     256, [100]),
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["py", "cpp"])
@pytest.mark.parametrize("case_id,params,max_pos,calls", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_transformers_parity_fp32(case_id, params, max_pos, calls, kind):
    cfg = _llama(params, max_pos)
    hf_rope = modeling_llama.LlamaRotaryEmbedding(cfg)
    if kind == "py":
        ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    else:
        ours = rotary.CppRotaryEmbedding(**rotary.rope_kwargs_from_hf_config(cfg))
    assert ours.interleaved is False and ours.dim == 16
    _assert_parity(ours, hf_rope, modeling_llama.apply_rotary_pos_emb, 16, calls, seed=len(case_id))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "case_id,params,max_pos,calls", [HF_CASES[i] for i in (0, 3, 4, 7, 8)], ids=[HF_CASES[i][0] for i in (0, 3, 4, 7, 8)])
def test_transformers_parity_bf16(case_id, params, max_pos, calls):
    cfg = _llama(params, max_pos)
    hf_rope = modeling_llama.LlamaRotaryEmbedding(cfg)
    ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    _assert_parity(ours, hf_rope, modeling_llama.apply_rotary_pos_emb, 16, calls, seed=7,
                   dtype=torch.bfloat16)


@pytest.mark.filterwarnings("ignore")
def test_transformers_parity_head_dim_128_llama3():
    """A Llama-3.1-shaped head (head_dim 128, theta 500000) at a few thousand positions."""
    params = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=32, max_position_embeddings=16384,
                      rope_parameters=params)
    hf_rope = modeling_llama.LlamaRotaryEmbedding(cfg)
    ours = rotary.RotaryEmbedding.from_hf_config(cfg, max_seq_len=4096)
    assert ours.dim == 128 and ours.max_seq_len == 4096
    _assert_parity(ours, hf_rope, modeling_llama.apply_rotary_pos_emb, 128, [4000], seed=3)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_transformers_parity_partial_rotary(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if rope_type == "yarn":
        params.update(factor=4.0, original_max_position_embeddings=64)
    cfg = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                        vocab_size=32, max_position_embeddings=256, rope_parameters=params)
    hf_rope = modeling_gpt_neox.GPTNeoXRotaryEmbedding(cfg)
    ours = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert ours.dim == 8 and ours.freqs.shape == (256, 4)
    _assert_parity(ours, hf_rope, modeling_gpt_neox.apply_rotary_pos_emb, 16, [200], seed=11)


@pytest.mark.filterwarnings("ignore")
def test_plain_dict_config_legacy_and_v5():
    """config.json forms: legacy rope_scaling + rope_theta, and rope_parameters."""
    legacy = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512, "rope_theta": 20000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = LlamaConfig(**copy.deepcopy(legacy))
    assert cfg.rope_parameters["rope_type"] == "linear"
    ours = rotary.RotaryEmbedding.from_hf_config(legacy)
    assert (ours.dim, ours.theta, ours.max_seq_len) == (16, 20000.0, 512)
    assert ours.scaling["rope_type"] == "linear" and ours.scaling["factor"] == 2.0
    _assert_parity(ours, modeling_llama.LlamaRotaryEmbedding(cfg), modeling_llama.apply_rotary_pos_emb,
                   16, [300], seed=5)

    v5 = _llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                 "rope_theta": 10000.0}, 256).to_dict()
    assert "rope_parameters" in v5
    from_dict = rotary.RotaryEmbedding.from_hf_config(v5)
    from_obj = rotary.RotaryEmbedding.from_hf_config(LlamaConfig(**v5))
    assert from_dict.scaling == from_obj.scaling
    assert torch.equal(from_dict.freqs, from_obj.freqs) and torch.equal(from_dict.inv_freq, from_obj.inv_freq)


@pytest.mark.filterwarnings("ignore")
def test_hf_config_fills_original_max_position_embeddings_like_transformers():
    # missing in the dict: transformers (and we) use max_position_embeddings
    cfg = _llama({"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}, 128)
    assert cfg.rope_parameters["original_max_position_embeddings"] == 128
    kw = rotary.rope_kwargs_from_hf_config(cfg)
    assert kw["scaling"]["original_max_position_embeddings"] == 128
    as_dict = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128,
               "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    assert rotary.rope_kwargs_from_hf_config(as_dict)["scaling"]["original_max_position_embeddings"] == 128
    # a top-level original_max_position_embeddings (Phi-3 style) wins
    as_dict["original_max_position_embeddings"] = 32
    as_dict["rope_parameters"]["original_max_position_embeddings"] = 64
    assert rotary.rope_kwargs_from_hf_config(as_dict)["scaling"]["original_max_position_embeddings"] == 32
    # head_dim given explicitly wins over hidden_size // num_attention_heads
    assert rotary.rope_kwargs_from_hf_config({**as_dict, "head_dim": 32})["dim"] == 32


@pytest.mark.parametrize("partial,factor", [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0), (0.3, 4.0)])
def test_proportional_matches_transformers(partial, factor):
    """Gemma 4's rule, against transformers' own _compute_proportional_rope_parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": partial, "factor": factor}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params)
    hf_inv, hf_att = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu")
    ours, att = rotary.inv_frequencies(64, 10000.0, {k: v for k, v in params.items() if k != "rope_theta"})
    assert att == hf_att == 1.0
    torch.testing.assert_close(ours.float(), hf_inv.float(), rtol=1e-6, atol=0)
    kwargs = rotary.rope_kwargs_from_hf_config(cfg)
    assert kwargs["dim"] == 64 and kwargs["scaling"].get("partial_rotary_factor", 1.0) == partial  # whole head


@pytest.mark.parametrize("fast,slow", [(0, 0), (0.0, 2.0), (16, 0)])
def test_yarn_zero_betas_are_the_defaults_as_in_transformers(fast, slow):
    """transformers reads beta_fast / beta_slow as `.get(key) or default`: a 0
    in a config is 32 / 1 there, so from_hf_config reads it so (the rule's
    own constructor still refuses 0: it is not a boundary)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
              "beta_fast": fast, "beta_slow": slow}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=256, rope_parameters=params)
    hf_inv, hf_att = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    m = rotary.RotaryEmbedding.from_hf_config(cfg)
    torch.testing.assert_close(m.inv_freq.float(), hf_inv.float(), rtol=1e-6, atol=0)
    assert m.attention_scaling == pytest.approx(hf_att, rel=1e-12)
    with pytest.raises(ValueError, match="beta_fast must be finite and > 0, got 0"):
        rotary.RotaryEmbedding(64, 256, scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 0})
