"""Fuzz cases for the N-D module options: rotary_offset / mrope_section /
mrope_interleaved / axes_dim / axes_theta / axes_shared_spectrum / pair_axes, valid and
invalid combinations, both front ends. Accepted: each call against the
float64 reference of its N-D (or 1-D) position ids, the module state
unchanged; refused: a message that names the option. Split from
module_cases.py (the oracle: module_rules.py)."""

from __future__ import annotations

import copy
import random

import numpy as np
import torch

from rotary_testing.reference import exact_angle

from .common import Finding, check_close, set_kind
from .module_rules import CTOR_ERRORS, FRONTS, judge_options_refusal, same_state, state_of


# ------------------------------------------------------ N-D module options
def _split(rng, total, n, step=1):
    """n positive parts (multiples of step) summing to total."""
    units = total // step
    cuts = sorted(rng.sample(range(1, units), n - 1)) if n > 1 else []
    bounds = [0] + cuts + [units]
    return [(bounds[i + 1] - bounds[i]) * step for i in range(n)]


def _mrope_axes(sections, pairs, interleaved):
    n = len(sections)
    if interleaved:
        return [(j % n) if (j % n > 0 and j < n * sections[j % n]) else 0 for j in range(pairs)]
    return [a for a, s in enumerate(sections) for _ in range(s)]


def run_module_options(seed):
    """rotary_offset / mrope_section / mrope_interleaved / axes_dim /
    axes_theta / axes_shared_spectrum / pair_axes, valid and invalid combinations."""
    from .arg_draw import reference

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    front = rng.choice(list(FRONTS))
    kind = set_kind("module:options")
    dim, theta, rows = rng.choice([8, 12, 16]), rng.choice([10000.0, 500.0]), rng.choice([8, 16, 32])
    interleaved, pairs = rng.random() < 0.5, dim // 2
    rule = rng.choice(["mrope", "mrope", "axial", "axial", "explicit", "offset"])
    n = rng.randrange(1, 4)
    opts, bad, name = {}, None, None
    axes, inv = None, None
    if rule == "mrope":
        sections = _split(rng, pairs, n)
        opts["mrope_section"] = sections
        if rng.random() < 0.4:
            opts["mrope_interleaved"] = True
        axes = _mrope_axes(sections, pairs, opts.get("mrope_interleaved", False))
        inv = np.power(theta, -2.0 * np.arange(pairs) / dim)
    elif rule == "explicit":  # any map, an axis per pair
        axes = [rng.randrange(n) for _ in range(pairs)]
        opts["pair_axes"] = axes
        inv = np.power(theta, -2.0 * np.arange(pairs) / dim)
    elif rule == "axial":
        adim = _split(rng, dim, min(n, pairs), 2)
        n = len(adim)
        opts["axes_dim"] = adim
        thetas = [theta]
        r = rng.random()
        if r < 0.3:
            thetas = [rng.choice([10000.0, 500.0, 100.0]) for _ in adim]
            opts["axes_theta"] = thetas
        elif r < 0.5:
            opts["axes_theta"] = thetas
        shared = len(set(adim)) == 1 and len(thetas) == 1 and rng.random() < 0.5
        if shared:
            opts["axes_shared_spectrum"] = True
        axes = [a for a, d_ in enumerate(adim) for _ in range(d_ // 2)]
        if shared:
            inv = np.array([thetas[0] ** (-2.0 * (a + n * i) / dim) for a, d_ in enumerate(adim) for i in range(d_ // 2)])
        else:
            inv = np.array([thetas[a if len(thetas) > 1 else 0] ** (-2.0 * i / d_) for a, d_ in enumerate(adim)
                            for i in range(d_ // 2)])
    else:
        inv = np.power(theta, -2.0 * np.arange(pairs) / dim)
    offset = rng.choice([0, 0, 1, 2, 4]) if rng.random() < 0.5 or rule == "offset" else 0
    if offset:
        opts["rotary_offset"] = offset
    if rng.random() < 0.45:
        m = rng.choice(["both", "interleaved_alone", "theta_alone", "shared_alone", "zero_section", "section_sum",
                        "section_neg", "section_many", "axes_odd", "axes_sum", "axes_theta_bad", "axes_theta_count",
                        "shared_unequal", "offset_neg", "offset_bool", "map_length", "map_axis", "map_and_sections"])
        if m == "both":
            opts["mrope_section"], opts["axes_dim"] = [pairs], [dim]
            bad = "axes_dim with mrope_section"
        elif m == "interleaved_alone" and rule != "mrope":
            opts.pop("axes_dim", None), opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
            opts["mrope_interleaved"], bad, name = True, "mrope_interleaved without mrope_section", "mrope_interleaved"
        elif m == "theta_alone" and rule != "axial":
            opts["axes_theta"], bad, name = [theta], "axes_theta without axes_dim", "axes_theta"
        elif m == "shared_alone" and rule != "axial":
            opts["axes_shared_spectrum"], bad, name = True, "axes_shared_spectrum without axes_dim", "axes_shared_spectrum"
        elif m == "zero_section" and pairs >= 2:
            opts.pop("axes_dim", None), opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
            opts["mrope_section"] = [pairs // 2, pairs - pairs // 2, 0]
            bad, name = "a zero mrope_section entry", "mrope_section"
        elif m == "section_sum":
            opts.pop("axes_dim", None), opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
            opts["mrope_section"], bad, name = [pairs, 1], "mrope_section sum", "mrope_section"
        elif m == "section_neg":
            opts.pop("axes_dim", None), opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
            opts["mrope_section"], bad, name = [pairs + 1, -1], "negative mrope_section", "mrope_section"
        elif m == "section_many":
            opts.pop("axes_dim", None), opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
            opts["mrope_section"], bad, name = [1] * 17, "17 sections", "mrope_section"
        elif m == "axes_odd" and rule == "axial":
            opts["axes_dim"], bad, name = [dim - 3, 3], "odd axes_dim", "axes_dim"
            opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
        elif m == "axes_sum" and rule == "axial":
            opts["axes_dim"], bad, name = opts["axes_dim"] + [2], "axes_dim sum", "axes_dim"
            opts.pop("axes_theta", None), opts.pop("axes_shared_spectrum", None)
        elif m == "axes_theta_bad" and rule == "axial":
            opts["axes_theta"] = [rng.choice([0.0, -1.0, float("nan"), float("inf")])] * len(opts["axes_dim"])
            opts.pop("axes_shared_spectrum", None)
            bad, name = "bad axes_theta", "axes_theta"
        elif m == "axes_theta_count" and rule == "axial":
            opts["axes_theta"] = [theta] * (len(opts["axes_dim"]) + 1)
            opts.pop("axes_shared_spectrum", None)
            bad, name = "axes_theta count", "axes_theta"
        elif m == "shared_unequal" and rule == "axial" and dim >= 6:
            opts["axes_dim"], opts["axes_shared_spectrum"] = [2, dim - 2], True
            opts.pop("axes_theta", None)
            bad = "a shared spectrum over unequal axes"
        elif m == "map_length" and rule == "explicit":
            opts["pair_axes"] = axes + [0] if rng.random() < 0.5 else axes[:-1]
            bad, name = "a pair_axes of another length than dim / 2", "pair_axes"
        elif m == "map_axis" and rule == "explicit":
            opts["pair_axes"] = axes[:-1] + [rng.choice([-1, 16, 2**40])]
            bad, name = "a pair_axes entry outside [0, 16)", "pair_axes"
        elif m == "map_and_sections" and rule == "explicit":
            opts["mrope_section"], bad = [pairs], "pair_axes with mrope_section"
        elif m == "offset_neg":
            opts["rotary_offset"], bad, name = -2, "rotary_offset < 0", "rotary_offset"
        elif m == "offset_bool":
            opts["rotary_offset"], bad, name = True, "rotary_offset=True", "rotary_offset"
    what = f"{front} RotaryEmbedding({dim}, {rows}, {theta}, {interleaved}, **{opts})"
    try:
        m = FRONTS[front](dim, rows, theta, interleaved, **copy.deepcopy(opts))
    except CTOR_ERRORS as e:
        judge_options_refusal(what, e, bad, name)
        return kind, f"refused: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if bad:
        raise Finding(f"{what}: accepted ({bad})")
    # calls: N-D ids where the module has axes, else (and also) 1-D ids
    B, S, H = rng.randrange(1, 3), rng.randrange(1, 5), rng.randrange(1, 3)
    D = offset + dim + rng.choice([0, 2])
    D += D % 2  # heads are even
    dtype = rng.choice([torch.float32, torch.float64])
    x = torch.randn(B, H, S, D, generator=gen).to(dtype)
    k = torch.randn(B, 1, S, D, generator=gen).to(dtype) if rng.random() < 0.4 else None
    nd = axes is not None and rule != "offset" and rng.random() < 0.75
    if nd:
        ids = torch.randint(0, rows, (max(axes) + 1, B, S), generator=gen)
        ang = np.stack([exact_angle(ids[a].numpy(), inv[j : j + 1])[..., 0] for j, a in enumerate(axes)], axis=-1)
    else:
        ids = torch.randint(0, rows, (B, S), generator=gen)
        ang = exact_angle(ids.numpy(), inv)
    saved = state_of(m)
    if getattr(m, "axes_dim", None) and not nd:  # axial RoPE has no 1-D meaning: refused by name
        try:
            m(x, k, position_ids=ids) if k is not None else m(x, position_ids=ids)
        except ValueError as e:
            if "an axial module turns pair j by its axis' row of position_ids" not in str(e):
                raise Finding(f"{what}: 1-D ids refused in other words: {str(e).splitlines()[0][:160]}") from None
            if not same_state(m, saved):
                raise Finding(f"{what}: a refused call changed the module state")
            return kind, "refused: 1-D ids on an axial module"
        raise Finding(f"{what}: accepted 1-D position_ids {tuple(ids.shape)} on an axial module")
    try:
        out = m(x, k, position_ids=ids) if k is not None else m(x, position_ids=ids)
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{what}: refused a valid call (position_ids {tuple(ids.shape)}, head {D}): "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    outs = out if k is not None else (out,)
    for nm, src, o in zip(("q", "k"), (x, k), outs):
        check_close(o, reference(src.double(), ang, offset, dim, m.interleaved), dtype,
                    f"{what} {nm} (position_ids {tuple(ids.shape)})")
    if not same_state(m, saved):
        raise Finding(f"{what}: a call changed the module state")
    return kind, "accepted"
