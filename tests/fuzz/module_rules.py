"""The oracle of the module fuzz cases (module_cases.py and the option,
config and KV-cache module cases, and regressions.py): valid and garbage
frequency rules, and a small model of the documented host-driven rules
(docs/api.md "Frequency rules", docs/scaling.md) that says which frequencies
each call must use; the frequencies themselves come from
``rotary.rope_frequencies`` (a pure function, checked against an independent
derivation in test_scaling.py), the rotation from the float64 reference.
Also what a refusal must not say, and the module state a refused call must
leave unchanged. Split from module_cases.py."""

from __future__ import annotations

import math

import numpy as np
import torch

import rotary
from rotary_testing.reference import exact_angle, rotate_pairs_nd

from .common import Finding, bits

CTOR_ERRORS = (ValueError, TypeError)
FRONTS = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}


# --------------------------------------------------------------- the rules
def valid_scaling(rng, dim, max_seq_len):
    rule = rng.choice(["default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", None])
    if rule in ("ntk", "dynamic") and dim <= 2:  # their base exponent d / (d - 2) needs d > 2
        rule = "linear"
    if rule is None:
        return None
    s = {"rope_type": rule}
    if rule in ("linear", "ntk"):
        s["factor"] = rng.choice([0.5, 2.0, 4.0, 8.0])
    elif rule == "dynamic":
        s["factor"] = rng.choice([2.0, 4.0])
        if rng.random() < 0.5:
            s["max_position_embeddings"] = rng.choice([4, 8, max_seq_len])
    elif rule == "yarn":
        s.update(factor=rng.choice([2.0, 4.0]), original_max_position_embeddings=rng.choice([4, 8, 16]))
        if rng.random() < 0.3:
            s.update(mscale=1.0, mscale_all_dim=rng.choice([0.0, 1.0]))
    elif rule == "llama3":
        s.update(factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0, high_freq_factor=4.0)
    elif rule == "longrope":
        s.update(
            short_factor=[round(rng.uniform(1.0, 2.0), 3) for _ in range(dim // 2)],
            long_factor=[round(rng.uniform(1.0, 8.0), 3) for _ in range(dim // 2)],
            original_max_position_embeddings=rng.choice([4, 8]),
            factor=rng.choice([2.0, 4.0]),
        )
    return s


def garbage_scaling(rng, dim):
    """(scaling dict, why it must be refused)."""
    return rng.choice([
        ({"rope_type": "linear", "factor": 1e-320}, "linear factor 1e-320 (NaN rows)"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor NaN"),
        ({"rope_type": "linear", "factor": float("inf")}, "factor inf"),
        ({"rope_type": "linear", "factor": -2.0}, "factor < 0"),
        ({"rope_type": "dynamic", "factor": 2.0**62}, "dynamic factor 2^62 (inf inv_freq)"),
        ({"rope_type": "default", "factor": -1.0}, "a field default ignores"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": float("nan")}, "a field linear ignores"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1e308,
          "mscale_all_dim": 1e-308}, "yarn attention_scaling inf"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": -100.0,
          "mscale_all_dim": 1.0}, "yarn attention_scaling negative"),
        ({"rope_type": "yarn", "factor": 4.0}, "yarn without original_max_position_embeddings"),
        ({"rope_type": "linear", "fator": 2.0}, "unknown key"),
        ({"rope_type": "ntk-by-parts"}, "unknown rope_type"),
        ({"rope_type": "longrope", "short_factor": [1.0] * (dim // 2 + 1), "long_factor": [1.0] * (dim // 2),
          "original_max_position_embeddings": 8}, "short_factor length"),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0}, "orig 0"),
    ])


class RuleModel:
    """Which (inv_freq, attention_scaling) a call reaching ``reach`` uses."""

    def __init__(self, dim, theta, scaling, max_seq_len):
        self.dim, self.theta, self.max_seq_len = dim, theta, max_seq_len
        self.scaling = dict(scaling) if scaling else None
        self.rule = self.scaling["rope_type"] if self.scaling else "default"
        if self.rule == "dynamic":
            self.scaling.setdefault("max_position_embeddings", max_seq_len)
        self.dyn, self.long = 0, False

    def seq_len(self):
        if self.rule == "dynamic":
            return self.dyn
        if self.rule == "longrope":
            return self.scaling["original_max_position_embeddings"] + 1 if self.long else 0
        return 0

    def reach(self, reach):
        if self.rule == "dynamic":
            original = self.scaling["max_position_embeddings"]
            cached = self.dyn if self.dyn > 0 else original
            if reach > cached:
                self.dyn = reach
            elif reach < original and cached > original:
                self.dyn = 0
        elif self.rule == "longrope":
            self.long = reach > self.scaling["original_max_position_embeddings"]

    def frequencies(self):
        inv, scale = rotary.rope_frequencies(self.dim, self.theta, self.scaling, self.seq_len())
        return inv.numpy(), float(scale)


LEAKS = ("incompatible function arguments", "Expected a value of type")


def check_message(what, e):
    """A refusal must speak of the caller's arguments, not of internals."""
    text = str(e)
    for leak in LEAKS:
        if leak in text:
            raise Finding(f"{what}: refusal message exposes internals: {text.splitlines()[0][:160]}")


def judge_options_refusal(what, e, bad, name):
    """A constructor's refusal: of bad options only (`bad` says why they
    are), naming `name` when given, in the caller's words."""
    check_message(what, e)
    first = str(e).splitlines()[0][:160]
    if not bad:
        raise Finding(f"{what}: refused valid options: {type(e).__name__}: {first}") from None
    if name and name not in str(e):
        raise Finding(f"{what}: refusal does not name {name}: {first}") from None


def state_of(m):
    s = {"freqs": bits(m.freqs), "inv_freq": bits(m.inv_freq), "attention_scaling": m.attention_scaling,
         "scaling": repr(m.scaling)}
    for k, v in vars(m).items():
        if isinstance(v, (bool, int, float, str)) and not k.startswith("__"):
            s["attr:" + k] = v
    return s


def same_state(m, saved):
    now = state_of(m)
    if now.keys() != saved.keys():
        return False
    for k, v in saved.items():
        w = now[k]
        if isinstance(v, torch.Tensor):
            if not (w.shape == v.shape and torch.equal(w, v)):
                return False
        elif v != w and not (isinstance(v, float) and math.isnan(v) and math.isnan(w)):
            return False
    return True


def module_reference(x, rows, inv, scale, interleaved, dim, angle_dtype):
    X = x.detach().to(torch.float64).numpy()
    if angle_dtype == "float32":
        angle = (rows.astype(np.float32)[:, None, :, None] * inv.astype(np.float32)[None, None, None, :]).astype(np.float64)
    else:
        angle = exact_angle(rows, inv)[:, None]
    out = X.copy()
    out[..., :dim] = scale * rotate_pairs_nd(X[..., :dim], angle, interleaved)
    return torch.from_numpy(out)
