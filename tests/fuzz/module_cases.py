"""Fuzz cases for the modules (both front ends, every frequency rule, the
host-driven ones included): a random module and random calls of it,
concurrent calls, and bool / float where the module takes ints.

Module oracle (module_rules.py): a small model of the documented host-driven
rules says which frequencies each call must use, the rotation comes from the
float64 reference. The other module families live beside it: options
(module_option_cases.py), from_hf_config and load_state_dict
(module_config_cases.py), the older schemes (scheme_cases.py); run.py finds
them all here."""

from __future__ import annotations

import copy
import math
import random
import threading

import torch

from rotary_testing.rope_testing import from_bhsd, to_bhsd

from .common import DOCUMENTED, FLOATS, Finding, Refused, check_close, set_kind
from .module_config_cases import run_hf, run_state  # noqa: F401 - families of run.py
from .module_option_cases import run_module_options  # noqa: F401 - a family of run.py
from .module_rules import (CTOR_ERRORS, FRONTS, RuleModel, check_message, garbage_scaling, module_reference,
                           same_state, state_of, valid_scaling)
from .scheme_cases import run_scheme  # noqa: F401 - a family of run.py


# ------------------------------------------------------------------ modules
def build_module(rng, front):
    """(module or None, model or None, outcome str). Raises Finding."""
    dim = rng.choice([2, 4, 8, 16])
    max_seq_len = rng.choice([1, 4, 8, 16, 32])
    theta = rng.choice([10000.0, 500.0, 1e6])
    interleaved = rng.random() < 0.5
    angle = rng.choice(["float64", "float64", "float32"])
    scaling = valid_scaling(rng, dim, max_seq_len)
    garbage, either = None, False
    if rng.random() < 0.35:
        field = rng.choice(["scaling", "scaling", "dim", "max_seq_len", "theta", "interleaved", "angle", "theta_f32"])
        if field == "scaling":
            scaling, garbage = garbage_scaling(rng, dim)
        elif field == "dim":
            dim, garbage = rng.choice([(7, "odd dim"), (0, "dim 0"), (-4, "dim < 0")])
        elif field == "max_seq_len":
            max_seq_len, garbage = rng.choice([(0, "max_seq_len 0"), (-3, "max_seq_len < 0")])
        elif field == "theta":
            theta, garbage = rng.choice([(0.0, "theta 0"), (-10.0, "theta < 0"), (float("nan"), "theta NaN"),
                                         (float("inf"), "theta inf")])
        elif field == "theta_f32":
            # Non-finite float32 frequencies, except at dim 2 (its one pair turns at theta^0 = 1).
            theta, angle = 1e-300, "float32"
            garbage = "theta 1e-300 with float32 angles" if dim > 2 else None
        elif field == "interleaved":
            interleaved, garbage = rng.choice([("yes", "interleaved='yes'"), (None, "interleaved=None")])
        else:
            angle, garbage = rng.choice([("float16", "angle_dtype float16"), ("int", "angle_dtype int")])
    kwargs = dict(dim=dim, max_seq_len=max_seq_len, theta=theta, interleaved=interleaved,
                  scaling=copy.deepcopy(scaling), angle_dtype=angle)
    what = f"{front} RotaryEmbedding({kwargs})"
    try:
        m = FRONTS[front](**kwargs)
    except CTOR_ERRORS as e:
        if garbage or either:
            return None, None, f"refused: {type(e).__name__}"
        raise Finding(f"{what}: refused valid options with {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    for name in ("freqs", "inv_freq"):
        t = getattr(m, name)
        if not bool(torch.isfinite(torch.view_as_real(t) if t.is_complex() else t).all()):
            raise Finding(f"{what}: built a non-finite {name}")
    if not math.isfinite(m.attention_scaling) or m.attention_scaling <= 0:
        raise Finding(f"{what}: attention_scaling {m.attention_scaling}")
    if garbage:
        raise Finding(f"{what}: accepted garbage ({garbage})")
    return m, RuleModel(dim, theta, scaling, max_seq_len), "accepted"


def one_call(rng, gen, m, model, front):
    """A random forward call; returns 'accepted' or 'refused: ...'; raises Finding."""
    dim, rows_now = m.dim, m.freqs.shape[0]
    extra = rng.choice([0, 0, 2])
    B, H, S = rng.randrange(1, 3), rng.randrange(1, 3), rng.randrange(1, 6)
    D = dim + extra
    dtype = rng.choice(FLOATS)
    qk = rng.random() < 0.4
    start = rng.choice([0, 1, max(0, rows_now - S), rows_now + 3, 1000, rng.randrange(0, 64)])
    positions = None
    bad, allowed = None, DOCUMENTED
    r = rng.random()
    if r < 0.07:
        D, bad = D + 1, "odd head_dim"
    elif r < 0.12:
        start, bad = -rng.randrange(1, 5), "negative start_pos"
    elif r < 0.15:
        start, bad = 2**64, "start_pos outside int64"
    elif r < 0.18:
        start, bad, qk = torch.tensor(3), "a tensor as start_pos", False
    elif r < 0.21:
        start, bad, allowed = 2**40, "start_pos 2^40", DOCUMENTED + (RuntimeError, MemoryError)
    elif r < 0.35:
        positions = torch.randint(0, rows_now + 6, (B, S), generator=gen)
        start = 0  # position_ids are absolute: start_pos must be 0 with them
    x = torch.randn(B, H, S, D, generator=gen).to(dtype)
    k = torch.randn(B, 1, S, D, generator=gen).to(dtype) if qk else None
    layout = rng.choice(["BHSD", "BHSD", "BSHD", "SBHD"])  # passed as views of x and k in that layout
    angle = m.angle_dtype
    start_int = int(start)
    reach = (start_int + S) if positions is None else (start_int + int(positions.max()) + 1)
    if bad is None or (bad == "start_pos 2^40" and model.rule != "dynamic"):
        rows_then = rows_now
        if model.rule == "dynamic":  # the table grows with the reach
            then = copy.deepcopy(model)
            then.reach(reach)
            rows_then = max(m.max_seq_len, then.dyn)
        if angle == "float32" and reach > rows_then:
            bad, allowed = "float32 angles past the table", (IndexError,)
        elif bad == "start_pos 2^40":
            bad = None  # computed on the fly from inv_freq, exactly

    def call():
        kw = {} if positions is None else {"position_ids": positions}
        if layout != "BHSD":
            kw["layout"] = layout
        xl = from_bhsd(x, layout)
        if qk:
            return tuple(to_bhsd(o, layout) for o in m(xl, from_bhsd(k, layout), start, **kw))
        return to_bhsd(m(xl, start, **kw), layout)

    saved = state_of(m)
    if bad is not None:
        # a 0-dim tensor may be taken as the int it holds, or refused naming start_pos
        either = bad in ("start_pos 2^40", "a tensor as start_pos")
        try:
            out = None
            try:
                out = call()
            except allowed as e:
                check_message(f"{front} module call ({bad})", e)
                raise Refused(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from None
            except Exception as e:  # noqa: BLE001
                raise Finding(f"{front} module call ({bad}): undocumented {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]}") from None
        except Refused as e:
            if bad == "a tensor as start_pos" and "start_pos" not in str(e):
                raise Finding(f"{front} module: a tensor as start_pos gets a message not about start_pos: {e}") from None
            if not same_state(m, saved):
                raise Finding(f"{front} module: a refused call ({bad}) changed the module state") from None
            return f"refused: {e}"
        if not either:
            raise Finding(f"{front} module: accepted bad call ({bad})")
    else:
        try:
            out = call()
        except Exception as e:  # noqa: BLE001
            raise Finding(f"{front} module: refused valid call (start_pos {start}, S {S}, D {D}, {dtype}) with "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    model.reach(reach)
    inv, scale = model.frequencies()
    from rotary_testing.reference import positions_grid
    rows = positions_grid(B, S, int(start), positions)
    outs = out if qk else (out,)
    for name, src, o in zip(("q", "k"), (x, k), outs):
        ref = module_reference(src, rows, inv, scale, m.interleaved, dim, angle)
        check_close(o, ref, dtype, f"{front} module {name} (rule {model.rule}, reach {reach}, angle {angle}, "
                    f"layout {layout})", scale)
    return "accepted"


def run_module(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    front = rng.choice(list(FRONTS))
    kind = set_kind(f"module:{front}")
    m, model, outcome = build_module(rng, front)
    if m is None:
        return kind, outcome
    calls = [one_call(rng, gen, m, model, front) for _ in range(rng.randrange(2, 6))]
    refused = sum(c.startswith("refused") for c in calls)
    return kind, f"accepted ({len(calls) - refused} calls accepted, {refused} refused as documented)"


# ---------------------------------------------------------------- concurrency
def run_concurrent(seed):
    rng = random.Random(seed)
    front = rng.choice(list(FRONTS))
    set_kind(f"concurrent:{front}")
    dim, rows = rng.choice([4, 8]), 16
    rule = rng.choice([None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                       {"rope_type": "longrope", "short_factor": [1.5] * (dim // 2), "long_factor": [3.0] * (dim // 2),
                        "original_max_position_embeddings": 64, "factor": 2.0}])
    m = FRONTS[front](dim, rows, scaling=copy.deepcopy(rule))
    model = RuleModel(dim, 10000.0, rule, rows)
    inv, scale = model.frequencies()  # every reach below stays under the thresholds: no rebuild
    errors = []

    def worker(i):
        g = torch.Generator().manual_seed(seed * 31 + i)
        r = random.Random(seed * 17 + i)
        for _ in range(5):
            S, start = r.randrange(1, 5), r.randrange(0, 12)
            x = torch.randn(2, 2, S, dim, generator=g)
            try:
                y = m(x, start)
                from rotary_testing.reference import positions_grid
                ref = module_reference(x, positions_grid(2, S, start), inv, scale, m.interleaved, dim, "float64")
                check_close(y, ref, torch.float32, f"{front} module from 4 threads (rule {model.rule})", scale)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise Finding(errors[0][:300])
    return f"concurrent:{front}", "accepted"


def run_module_scalars(seed):
    """bool / float where the module takes ints: refused naming the argument,
    the module unchanged."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    front = rng.choice(list(FRONTS))
    kind = set_kind("scalars")
    value = rng.choice([True, False, 2.0, 1.5, float("nan")])
    where = rng.choice(["call", "call_kw", "call_qk", "rotary_offset", "dim", "max_seq_len", "mrope_section"])
    what = f"{front} module {where}={value!r}"
    x = torch.randn(1, 2, 3, 8, generator=gen)
    if where in ("rotary_offset", "dim", "max_seq_len", "mrope_section"):
        a = dict(dim=8, max_seq_len=16)
        kw = {}
        if where in a:
            a[where] = value
        elif where == "mrope_section":
            kw["mrope_section"] = [value, 4 - int(bool(value))] if not isinstance(value, float) or value == value else [value]
        else:
            kw[where] = value
        if where == "dim" and value is True:
            name = None  # dim 1 is odd: any refusal does
        else:
            name = where
        try:
            FRONTS[front](a["dim"], a["max_seq_len"], **kw)
        except CTOR_ERRORS as e:
            check_message(what, e)
            if name and name not in str(e):
                raise Finding(f"{what}: refusal does not name {name}: {str(e).splitlines()[0][:160]}") from None
            return kind, f"refused: {type(e).__name__}"
        except Exception as e:  # noqa: BLE001
            raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        raise Finding(f"{what}: accepted")
    m = FRONTS[front](8, 16)
    saved = state_of(m)
    try:
        if where == "call":
            m(x, value)
        elif where == "call_kw":
            m(x, start_pos=value)
        else:
            m(x, torch.randn(1, 1, 3, 8, generator=gen), value)
    except CTOR_ERRORS as e:
        check_message(what, e)
        if "start_pos" not in str(e):
            raise Finding(f"{what}: refusal does not name start_pos: {str(e).splitlines()[0][:160]}") from None
        if not same_state(m, saved):
            raise Finding(f"{what}: a refused call changed the module state") from None
        return kind, f"refused: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    raise Finding(f"{what}: accepted")
