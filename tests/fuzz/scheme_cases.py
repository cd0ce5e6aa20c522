"""Fuzz cases for the older schemes: sinusoidal_table, alibi_slopes and
alibi_bias on valid and garbage arguments, each result against its seed
formula in float64. Split from module_cases.py."""

from __future__ import annotations

import random

import numpy as np
import torch

import rotary

from .common import Finding, set_kind
from .module_rules import CTOR_ERRORS


# -------------------------------------------------------------------- schemes
def run_scheme(seed):
    rng = random.Random(seed)
    set_kind("scheme")
    which = rng.choice(["sinusoidal_table", "alibi_slopes", "alibi_bias"])
    garbage = None
    if which == "sinusoidal_table":
        n, d, base = rng.randrange(1, 12), rng.choice([2, 4, 8, 16]), rng.choice([10000.0, 100.0, 2.0])
        if rng.random() < 0.4:
            bad = rng.choice([("n", -1), ("d", -2), ("base", 5e-324), ("base", 0.0), ("base", -5.0),
                              ("base", float("nan"))])
            garbage = f"{bad[0]}={bad[1]}"
            n, d, base = {"n": (bad[1], d, base), "d": (n, bad[1], base), "base": (n, d, bad[1])}[bad[0]]
            if base == 5e-324 and n > 0 and d > 0:
                # The rule is "finite or refused": a tiny base is refused only where
                # pos / base^(2i/d) overflows (large d); small d gives a finite table.
                with np.errstate(over="ignore"):
                    top = (n - 1) / np.float64(base) ** (np.arange(0, d, 2) / d)
                garbage = garbage if not np.isfinite(top).all() else None
        args = (n, d, base)
    elif which == "alibi_slopes":
        n = rng.randrange(1, 40)
        if rng.random() < 0.3:
            n, garbage = rng.choice([-1, -3]), "n_heads < 0"
        args = (n,)
    else:
        n, seq, causal = rng.randrange(1, 6), rng.randrange(0, 7), rng.random() < 0.5
        if rng.random() < 0.4:
            bad = rng.choice([("causal", None), ("causal", "yes"), ("n", -1), ("seq", -1)])
            garbage = f"{bad[0]}={bad[1]!r}"
            if bad[0] == "causal":
                causal = bad[1]
            elif bad[0] == "n":
                n = bad[1]
            else:
                seq = bad[1]
        args = (n, seq, causal)
    fn = getattr(rotary, which)
    try:
        out = fn(*args)
    except CTOR_ERRORS as e:
        if garbage:
            return "scheme", f"refused: {type(e).__name__}"
        raise Finding(f"{which}{args}: refused valid arguments: {str(e).splitlines()[0][:160]}") from None
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{which}{args}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if garbage:
        raise Finding(f"{which}{args}: accepted garbage ({garbage})")
    o = out.double()
    if which == "sinusoidal_table":
        n, d, base = args
        pos = np.arange(n, dtype=np.float64)[:, None]
        ang = pos / np.power(base, 2 * np.arange(d // 2) / d)[None, :]
        ref = np.empty((n, d))
        ref[:, 0::2], ref[:, 1::2] = np.sin(ang), np.cos(ang)
    elif which == "alibi_slopes":
        ref = np.array([2.0 ** (-8 * (h + 1) / args[0]) for h in range(args[0])])
    else:
        n, seq, causal = args
        slopes = np.array([2.0 ** (-8 * (h + 1) / n) for h in range(n)])
        i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
        ref = -slopes[:, None, None] * np.abs(i - j)[None]
        if causal:
            ref = np.where((j > i)[None], -np.inf, ref)
    ref = torch.from_numpy(np.asarray(ref, dtype=np.float64))
    if o.shape != ref.shape or not torch.allclose(o, ref, rtol=1e-6, atol=1e-6, equal_nan=False):
        if not (o.shape == ref.shape and torch.equal(torch.isinf(o), torch.isinf(ref))
                and torch.allclose(o[~torch.isinf(ref)], ref[~torch.isinf(ref)], rtol=1e-6, atol=1e-6)):
            raise Finding(f"{which}{args}: differs from the seed formula")
    return "scheme", "accepted"
