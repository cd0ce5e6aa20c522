"""Frequency (scaling) rules: rotary.rope_frequencies / rope_freqs(scaling=...),
RotaryEmbedding(scaling=...), RotaryEmbedding.from_hf_config, and parity with
Hugging Face transformers' own rotary embedding.

Three layers of checks:
1. inv_freq and attention scaling of every rule against an independent
   float64 re-derivation of the published formulas, written below in plain
   Python math (no torch, no code shared with the package), to 1e-12 relative.
2. Table entries against attention_scaling * exp(i * pos * inv_freq) (float64
   reference) within 1e-7 per component, at sampled positions including the last.
3. transformers itself: tiny configs built in code (nothing downloaded), its
   rotary embedding + apply_rotary_pos_emb on random q, k and position_ids,
   against RotaryEmbedding.from_hf_config(config)(q, k, position_ids=...).
   transformers computes angles in fp32, so the fp32 tolerance grows with the
   largest position (see _fp32_tol); bf16 is compared at a bf16 tolerance.
"""

import copy
import io
import math
import pickle
import random

import pytest
import torch
from torch import nn

import rotary
from rotary_testing.scaling_reference import ref_frequencies

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, LlamaConfig  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


def _random_cases(seed, n_per_rule=5):
    """(id, d, theta, rule dict, seq_len) with random parameters, fixed seed."""
    rng = random.Random(seed)
    cases = []
    for kind in ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "proportional"):
        for i in range(n_per_rule):
            d = rng.choice([4, 8, 16, 32, 64, 96, 128, 256])
            theta = rng.choice([10000.0, 500000.0, 1e6, rng.uniform(100.0, 2e6)])
            p = {"rope_type": kind}
            seq_len = 0
            if kind in ("linear", "ntk", "dynamic", "yarn", "llama3"):
                p["factor"] = rng.choice([2.0, 4.0, 8.0, 32.0, rng.uniform(1.0, 40.0)])
            if kind == "dynamic":
                p["max_position_embeddings"] = rng.choice([64, 2048, 4096])
                seq_len = rng.choice([0, p["max_position_embeddings"] // 2, 3 * p["max_position_embeddings"]])
            if kind in ("yarn", "llama3", "longrope"):
                p["original_max_position_embeddings"] = rng.choice([256, 2048, 4096, 8192])
            if kind == "yarn":
                variant = i % 5
                if variant == 1:
                    p["beta_fast"], p["beta_slow"] = rng.uniform(8, 64), rng.uniform(0.5, 4)
                elif variant == 2:
                    p["mscale"], p["mscale_all_dim"] = rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5)
                elif variant == 3:
                    p["attention_factor"] = rng.uniform(0.8, 1.5)
                    p["truncate"] = False
                elif variant == 4:  # factor derived from the context lengths
                    del p["factor"]
                    p["max_position_embeddings"] = 4 * p["original_max_position_embeddings"]
            if kind == "llama3":
                p["low_freq_factor"] = rng.choice([1.0, 0.5, 2.0])
                p["high_freq_factor"] = p["low_freq_factor"] * rng.choice([2.0, 4.0, 8.0])
            if kind == "longrope":
                p["short_factor"] = [rng.uniform(0.9, 1.5) for _ in range(d // 2)]
                p["long_factor"] = [rng.uniform(1.0, 40.0) for _ in range(d // 2)]
                orig = p["original_max_position_embeddings"]
                seq_len = rng.choice([0, orig, orig + 1, 4 * orig])
                if i % 3 == 0:
                    p["factor"] = rng.uniform(1.0, 16.0)
                elif i % 3 == 1:
                    p["max_position_embeddings"] = 16 * orig
                else:
                    p["attention_factor"] = rng.uniform(1.0, 1.3)
            if kind == "proportional":
                p["partial_rotary_factor"] = rng.choice([0.25, 0.5, 1.0, rng.uniform(0.05, 1.0)])
                if i % 2:
                    p["factor"] = rng.uniform(1.0, 8.0)
            cases.append(pytest.param(d, theta, p, seq_len, id=f"{kind}-{i}-d{d}"))
    return cases


CASES = _random_cases(seed=20240611)


@pytest.mark.parametrize("d,theta,p,seq_len", CASES)
def test_inv_freq_matches_formula(d, theta, p, seq_len):
    inv, att = rotary.inv_frequencies(d, theta, p, seq_len)
    ref_inv, ref_att = ref_frequencies(d, theta, p, seq_len)
    assert inv.dtype == torch.float64 and inv.shape == (d // 2,)
    ref = torch.tensor(ref_inv, dtype=torch.float64)
    assert torch.allclose(inv, ref, rtol=1e-12, atol=0.0), (inv - ref).abs().div(ref).max()
    assert att == pytest.approx(ref_att, rel=1e-12, abs=0.0)


def test_default_rule_is_plain_rope():
    a = rotary.freqs_table(64, 300, 5000.0)
    for scaling in ({"rope_type": "default"}, {"type": "default"}, {}):
        assert torch.equal(rotary.freqs_table(64, 300, 5000.0, scaling), a)
    # linear with factor 1 and ntk with factor 1 change nothing either
    assert torch.equal(rotary.freqs_table(64, 300, 5000.0, {"rope_type": "linear", "factor": 1.0}), a)
    assert torch.allclose(
        torch.view_as_real(rotary.freqs_table(64, 300, 5000.0, {"rope_type": "ntk", "factor": 1.0})),
        torch.view_as_real(a), rtol=0, atol=1e-7)


@pytest.mark.parametrize("d,theta,p,seq_len", CASES[::3])
def test_table_entries(d, theta, p, seq_len):
    rows = 65536 if d <= 16 else 4096
    table = rotary.freqs_table(d, rows, theta, p, seq_len)
    assert table.dtype == torch.complex64 and table.shape == (rows, d // 2)
    ref_inv, att = ref_frequencies(d, theta, p, seq_len)
    rng = random.Random(d * 7 + rows)
    positions = sorted({0, 1, rows - 1, *(rng.randrange(rows) for _ in range(40))})
    worst = 0.0
    for pos in positions:
        for j, w in enumerate(ref_inv):
            angle = pos * w
            got = complex(table[pos, j])
            worst = max(worst, abs(got.real - att * math.cos(angle)), abs(got.imag - att * math.sin(angle)))
    assert worst <= 1e-7, worst


@pytest.mark.parametrize("d,theta,p,seq_len", CASES[1::4])
def test_modules_register_the_rule(d, theta, p, seq_len):
    """Both modules hold the rule's table and inv_freq under the same names
    (at construction: seq_len 0, the frequencies a model starts with)."""
    rows = 64
    py = rotary.RotaryEmbedding(d, rows, theta, False, scaling=p)
    cpp = rotary.CppRotaryEmbedding(d, rows, theta, False, scaling=p)
    scaling0 = dict(p)
    inv0, att0 = rotary.inv_frequencies(d, theta, scaling0, 0)
    for m in (py, cpp):
        assert [n for n, _ in m.named_buffers()] == ["freqs", "inv_freq"]
        assert list(m.state_dict()) == ["freqs", "inv_freq"]
        assert m.freqs.dtype == torch.complex64 and m.freqs.shape == (rows, d // 2)
        assert m.inv_freq.dtype == torch.float64 and torch.equal(m.inv_freq, inv0)
        assert m.attention_scaling == att0
        assert torch.equal(m.freqs, rotary.freqs_table(d, rows, theta, scaling0))
    assert torch.equal(py.freqs, cpp.freqs)


# ---------------------------------------------------------------------------
# Hugging Face transformers parity
# ---------------------------------------------------------------------------
def _llama(rope_parameters, max_pos=128, **kw):
    return LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        intermediate_size=128, vocab_size=32, max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters), **kw)


def _qk(batch, seq, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, seq, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, 2, seq, head_dim, generator=g).to(dtype)
    return q, k


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


def _op_supports_partial_rotary():
    try:
        rotary.apply_rope(torch.zeros(1, 1, 2, 16), rotary.freqs_table(8, 4))
        return True
    except (ValueError, RuntimeError):
        return False


@pytest.mark.filterwarnings("ignore")
@pytest.mark.xfail(
    not _op_supports_partial_rotary(), strict=False,
    reason="the op does not yet accept freqs narrower than head_dim (partial rotary is being added to the kernels)")
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


# ---------------------------------------------------------------------------
# Host-driven rules in the modules
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_dynamic_state_machine(kind):
    p = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 32}
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(8, 48, 10000.0, True, scaling=p)

    def expect(seq_len, rows):
        inv, _ = rotary.inv_frequencies(8, 10000.0, p, seq_len)
        assert torch.equal(m.inv_freq, inv), (seq_len, m.inv_freq, inv)
        assert m.freqs.shape == (rows, 4)
        assert torch.equal(m.freqs, rotary.freqs_table(8, rows, 10000.0, p, seq_len))

    x = torch.randn(1, 1, 4, 8)
    expect(0, 48)
    m(x, start_pos=20)          # reach 24 <= 32: unchanged
    expect(0, 48)
    m(x, start_pos=36)          # reach 40 > 32: grows (row 0 alone, the rest on the fly)
    expect(40, 1)
    m(x, start_pos=60)          # reach 64: grows
    expect(64, 1)
    y = m(x, start_pos=40)      # reach 44 (between 32 and 64): kept
    expect(64, 1)
    ref = rotary.apply_rope(x, rotary.freqs_table(8, 64, 10000.0, p, 64), 40, True)
    assert torch.equal(y, ref)  # the on-the-fly path gives the table's bits
    m(x, start_pos=32)          # reach 36: still kept (not under 32)
    expect(64, 1)
    m(x, start_pos=10)          # reach 14 < 32: back to the original
    expect(0, 48)
    # position ids count as well: the largest id decides
    m(x, position_ids=torch.tensor([[0, 1, 2, 99]]))
    expect(100, 1)


@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_longrope_switches(kind):
    p = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 5.0, 7.0, 9.0],
         "original_max_position_embeddings": 16, "factor": 4.0}
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(8, 64, 10000.0, False, scaling=p)
    short, att = rotary.inv_frequencies(8, 10000.0, p, 0)
    long, att_long = rotary.inv_frequencies(8, 10000.0, p, 17)
    assert att == att_long == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(16)))
    x = torch.randn(2, 2, 4, 8)
    for start, want in [(0, short), (12, short), (13, long), (40, long), (11, short)]:
        m(x, start_pos=start)
        assert torch.equal(m.inv_freq, want), start
        assert torch.equal(m.freqs, rotary.freqs_table(8, 64, 10000.0, p, 17 if want is long else 0))
    # offsets [batch] count: start_pos + offset + seq
    m(x, offsets=torch.tensor([0, 13]))
    assert torch.equal(m.inv_freq, long)


def test_static_rules_never_rebuild():
    m = rotary.RotaryEmbedding(8, 32, scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 8})
    freqs = m.freqs
    m(torch.randn(1, 1, 32, 8))
    assert m.freqs is freqs


# ---------------------------------------------------------------------------
# Module plumbing: casts, state_dict, copies, position_ids, compile
# ---------------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("kind", ["py", "cpp"])
@pytest.mark.parametrize("cast", ["half", "bf16", "double", "nested_half", "nested_bf16"])
def test_casts_leave_both_buffers(kind, cast):
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(16, 32, 10000.0, False, scaling=YARN)
    before = (m.freqs.clone(), m.inv_freq.clone())
    parent = nn.Sequential(nn.Linear(4, 4), m)
    if cast == "half":
        m.half()
    elif cast == "bf16":
        m.to(torch.bfloat16)
    elif cast == "double":
        m.double()
    elif cast == "nested_half":
        parent.half()
        assert parent[0].weight.dtype == torch.float16
    else:
        parent.to(torch.bfloat16)
        assert parent[0].weight.dtype == torch.bfloat16
    assert m.freqs.dtype == torch.complex64 and torch.equal(m.freqs, before[0])
    assert m.inv_freq.dtype == torch.float64 and torch.equal(m.inv_freq, before[1])


@pytest.mark.parametrize("src,dst", [("py", "cpp"), ("cpp", "py"), ("py", "py"), ("cpp", "cpp")])
def test_state_dict_moves_both_buffers(src, dst, tmp_path):
    make = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}
    a = make[src](16, 32, 777.0, False, scaling=YARN)
    path = tmp_path / "rope.pt"
    torch.save(a.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    assert list(sd) == ["freqs", "inv_freq"]
    # Tables saved with other options are refused, never silently installed.
    with pytest.raises(RuntimeError, match=r"saved tables do not match this module"):
        make[dst](16, 32, 10000.0, False).load_state_dict(sd)
    b = make[dst](16, 32, 777.0, False, scaling=YARN)
    with torch.no_grad():  # loading must restore both buffers
        b.freqs.zero_()
        b.inv_freq.mul_(2.0)
    result = b.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(b.freqs, a.freqs) and torch.equal(b.inv_freq, a.inv_freq)
    assert b.inv_freq.dtype == torch.float64
    q, k = _qk(1, 5, 16, torch.float32, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a(q, k, start_pos=3), b(q, k, start_pos=3)))


def test_python_module_copies_and_repr():
    m = rotary.RotaryEmbedding(16, 32, scaling={"type": "linear", "factor": 2})
    assert m.scaling == {"rope_type": "linear", "factor": 2.0}
    assert "scaling={'rope_type': 'linear', 'factor': 2.0}" in repr(m)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.scaling == m.scaling and torch.equal(c.freqs, m.freqs) and torch.equal(c.inv_freq, m.inv_freq)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert torch.equal(again.inv_freq, m.inv_freq)
    assert rotary.RotaryEmbedding(16).scaling is None


@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_position_ids(kind):
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(16, 64, 10000.0, False, scaling=YARN)
    q, k = _qk(2, 6, 16, torch.float32, seed=4)
    pid = torch.tensor([[5, 9, 3, 0, 60, 63], [1, 2, 3, 4, 5, 6]])
    qo, ko = m(q, k, position_ids=pid)
    qr, kr = rotary.apply_rope_qk(q, k, m.freqs, 0, False, position_ids=pid)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    with pytest.warns(DeprecationWarning, match="positions= is deprecated"):
        assert torch.equal(m(q, position_ids=pid), m(q, positions=pid))
    with pytest.raises(ValueError, match="pass offsets= or position_ids= alone|pass offsets or position_ids alone"):
        m(q, k, positions=pid, position_ids=pid)


def test_compile_static_rule():
    m = rotary.RotaryEmbedding(16, 64, scaling=YARN)
    q, k = _qk(1, 8, 16, torch.float32, seed=9)
    pid = torch.arange(8).add(20).unsqueeze(0)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    for a, b in zip(compiled(q, k, position_ids=pid), m(q, k, position_ids=pid)):
        assert torch.equal(a, b)


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
    with pytest.raises(TypeError, match="scaling must be None, a dict"):
        rotary.RotaryEmbedding(8, 16, scaling="yarn")


@pytest.mark.parametrize(
    "config,match",
    [
        ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, r"unknown rope_type 'su'"),
        ({"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "linear"}}, r"factor is required"),
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
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0**62}), r"factor = 4.61169e\+18 give inv_freq\[1\] = inf"),
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


def test_host_driven_is_public():
    for cls in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        assert cls(8, 64, scaling={"rope_type": "dynamic", "factor": 2.0}).host_driven
        assert not cls(8, 64, scaling=YARN64).host_driven
        assert not cls(8, 64).host_driven
    assert rotary._C.RopeTables(8, 64, scaling={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                "long_factor": [2.0] * 4, "original_max_position_embeddings": 8,
                                                "factor": 2.0}).host_driven


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


def test_yarn_truncate_none_does_not_truncate():
    """transformers reads .get("truncate", True): an explicit None is falsy,
    so it does not truncate; every entry point reads it so."""
    base = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    inv = {t: rotary.inv_frequencies(64, 10000.0, {**base, "truncate": t})[0] for t in (None, False, True)}
    assert torch.equal(inv[None], inv[False]) and not torch.equal(inv[None], inv[True])
    want = ref_frequencies(64, 10000.0, {**base, "truncate": None})[0]
    assert torch.allclose(inv[None], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    for cls in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        assert torch.equal(cls(64, 8, scaling={**base, "truncate": None}).inv_freq, inv[False])


@pytest.mark.parametrize("factor", [1e-39, 1e-300, 3.5e38])
def test_attention_scaling_outside_normal_float32_is_refused(factor):
    """An entry of 1e-300 rounds to 0 in complex64 (and 1e-42 to a subnormal
    with a 5e-4 relative error): refused like the overflow side."""
    with pytest.raises(ValueError, match=r"does not fit a complex64 entry \(a normal float32"):
        rotary.RotaryEmbedding(8, 16, scaling={**YARN64, "attention_factor": factor})
