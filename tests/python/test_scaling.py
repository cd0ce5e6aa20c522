"""Frequency (scaling) rules: rotary.rope_frequencies / rope_freqs(scaling=...)
and the tables RotaryEmbedding(scaling=...) registers.

Two layers of checks (the third, parity with Hugging Face transformers, is in
test_scaling_hf_parity.py; the modules' host-driven rules and plumbing in
test_scaling_modules.py; refusals in test_scaling_errors.py):
1. inv_freq and attention scaling of every rule against an independent
   float64 re-derivation of the published formulas, written below in plain
   Python math (no torch, no code shared with the package), to 1e-12 relative.
2. Table entries against attention_scaling * exp(i * pos * inv_freq) (float64
   reference) within 1e-7 per component, at sampled positions including the last.
"""

import math
import random

import pytest
import torch

import rotary
from rotary_testing.scaling_reference import ref_frequencies


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
