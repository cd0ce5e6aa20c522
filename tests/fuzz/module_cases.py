"""Fuzz cases for the modules (both front ends, every frequency rule, the
host-driven ones included), from_hf_config, load_state_dict, the older
schemes and concurrent calls.

Module oracle: a small model of the documented host-driven rules (docs/api.md
"Frequency rules", docs/scaling.md) says which frequencies each call must use; the
frequencies themselves come from ``rotary.rope_frequencies`` (a pure
function, checked against an independent derivation in test_scaling.py),
the rotation from the float64 reference."""

from __future__ import annotations

import copy
import math
import random
import threading

import numpy as np
import torch

import rotary
from rotary_testing.reference import exact_angle, rotate_pairs_nd
from rotary_testing.rope_testing import from_bhsd, to_bhsd

from .common import DOCUMENTED, FLOATS, Finding, Refused, bits, check_close, expect_refusal, same_bits, set_kind

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


# -------------------------------------------------------------- from_hf_config
def run_hf(seed):
    rng = random.Random(seed)
    set_kind("hf_config")
    heads = rng.choice([1, 2, 4])
    head_dim = rng.choice([4, 8, 16])
    cfg = {"hidden_size": heads * head_dim, "num_attention_heads": heads,
           "max_position_embeddings": rng.choice([8, 16, 64]), "rope_theta": rng.choice([10000.0, 1e6])}
    if rng.random() < 0.3:
        cfg["head_dim"] = head_dim
    if rng.random() < 0.3:
        cfg["partial_rotary_factor"] = rng.choice([0.5, 1.0])
    rule = valid_scaling(rng, int(head_dim * cfg.get("partial_rotary_factor", 1.0)), cfg["max_position_embeddings"])
    if rule and rule["rope_type"] != "default":
        cfg[rng.choice(["rope_scaling", "rope_parameters"])] = rule
    garbage = None
    if rng.random() < 0.5:
        key, value, garbage = rng.choice([
            ("rope_theta", 0, "rope_theta 0"), ("rope_theta", -1.0, "rope_theta < 0"),
            ("rope_theta", float("nan"), "rope_theta NaN"), ("rope_theta", "big", "rope_theta a string"),
            ("partial_rotary_factor", 0.0, "partial_rotary_factor 0"),
            ("partial_rotary_factor", 2.0, "partial_rotary_factor 2 (wider than the head)"),
            ("partial_rotary_factor", 1e308, "partial_rotary_factor 1e308"),
            ("partial_rotary_factor", -0.5, "partial_rotary_factor < 0"),
            ("max_position_embeddings", 0, "max_position_embeddings 0"),
            ("max_position_embeddings", -8, "max_position_embeddings < 0"),
            ("head_dim", 7, "odd head_dim"), ("num_attention_heads", 0, "no heads and no head_dim"),
            ("rope_scaling", "yes", "rope_scaling a string"),
            ("rope_scaling", {"rope_type": "linear", "factor": float("nan")}, "factor NaN"),
        ])
        cfg[key] = value
        if key == "num_attention_heads":
            cfg.pop("head_dim", None)
    front = rng.choice(["py", "cpp"])
    try:
        if front == "py":
            m = rotary.RotaryEmbedding.from_hf_config(cfg)
        else:
            m = rotary.CppRotaryEmbedding(**rotary.rope_kwargs_from_hf_config(cfg))
    except CTOR_ERRORS as e:
        if garbage:
            return "hf_config", f"refused: {type(e).__name__}"
        raise Finding(f"from_hf_config({cfg}): refused a valid config with {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}") from None
    except Exception as e:  # noqa: BLE001
        raise Finding(f"from_hf_config({cfg}): undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if garbage:
        raise Finding(f"from_hf_config: accepted garbage ({garbage}): {cfg}")
    want = int(cfg.get("head_dim", head_dim) * cfg.get("partial_rotary_factor", 1.0))
    if m.dim != want or m.freqs.shape[0] != cfg["max_position_embeddings"] or m.interleaved:
        raise Finding(f"from_hf_config({cfg}): dim {m.dim} (want {want}), rows {m.freqs.shape[0]}")
    if not bool(torch.isfinite(torch.view_as_real(m.freqs)).all()):
        raise Finding(f"from_hf_config({cfg}): non-finite table")
    return "hf_config", "accepted"


# ------------------------------------------------------------ load_state_dict
def run_state(seed):
    rng = random.Random(seed)
    set_kind("load_state_dict")
    opts = dict(dim=rng.choice([4, 8]), max_seq_len=rng.choice([8, 16]), theta=10000.0, interleaved=True,
                scaling=rng.choice([None, {"rope_type": "linear", "factor": 2.0}]), angle_dtype="float64")
    dst_front, src_front = rng.choice(list(FRONTS)), rng.choice(list(FRONTS))
    def make(front, o):
        return FRONTS[front](**copy.deepcopy(o))

    m = make(dst_front, opts)
    other = dict(opts)
    change = rng.choice([None, None, "theta", "max_seq_len", "angle_dtype", "scaling", "garbage"])
    if change == "theta":
        other["theta"] = 500.0
    elif change == "max_seq_len":
        other["max_seq_len"] = opts["max_seq_len"] * 2
    elif change == "angle_dtype":
        other["angle_dtype"] = "float32"
        opts_swap = rng.random() < 0.5  # either direction must fail
        if opts_swap:
            m = make(dst_front, other)
            other = dict(opts)
    elif change == "scaling":
        other["scaling"] = {"rope_type": "linear", "factor": 3.0}
    state = dict(make(src_front, other).state_dict())
    what = f"{dst_front} <- {src_front} ({change})"
    if change == "garbage":
        key = rng.choice(["freqs", "inv_freq"])
        g = rng.choice(["nan", "dtype", "shape", "meta", "missing", "extra", "not_tensor"])
        what += f" {g} {key}"
        if g == "nan":
            state[key] = state[key].clone()
            state[key].view(-1)[0] = float("nan")
        elif g == "dtype":
            state[key] = state[key].real.float() if state[key].is_complex() else state[key].float()
        elif g == "shape":
            state[key] = state[key][:-1].clone()
        elif g == "meta":
            state[key] = state[key].to("meta")
        elif g == "missing":
            del state[key]
        elif g == "extra":
            state["bogus"] = torch.zeros(1)
        else:
            state[key] = [1.0, 2.0]
    saved = state_of(m)
    must_fail = change is not None
    allowed = (RuntimeError, ValueError, TypeError)
    try:
        m.load_state_dict(state)
    except NotImplementedError as e:  # a RuntimeError subclass, but not the documented refusal
        raise Finding(f"load_state_dict {what}: undocumented NotImplementedError: {str(e).splitlines()[0][:160]}") from None
    except allowed as e:
        check_message(f"load_state_dict {what}", e)
        if not must_fail:
            raise Finding(f"load_state_dict {what}: refused a matching state: {str(e).splitlines()[0][:160]}") from None
        if not same_state(m, saved):
            raise Finding(f"load_state_dict {what}: refused, but the module changed") from None
        return "load_state_dict", f"refused: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"load_state_dict {what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if must_fail:
        raise Finding(f"load_state_dict {what}: accepted")
    if not same_state(m, saved):
        raise Finding(f"load_state_dict {what}: a matching state changed the tables")
    return "load_state_dict", "accepted"


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
    axes_theta / axes_shared_spectrum, valid and invalid combinations."""
    from .arg_cases import reference

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    front = rng.choice(list(FRONTS))
    kind = set_kind("module:options")
    dim, theta, rows = rng.choice([8, 12, 16]), rng.choice([10000.0, 500.0]), rng.choice([8, 16, 32])
    interleaved, pairs = rng.random() < 0.5, dim // 2
    rule = rng.choice(["mrope", "mrope", "axial", "axial", "offset"])
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
                        "shared_unequal", "offset_neg", "offset_bool"])
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
        elif m == "offset_neg":
            opts["rotary_offset"], bad, name = -2, "rotary_offset < 0", "rotary_offset"
        elif m == "offset_bool":
            opts["rotary_offset"], bad, name = True, "rotary_offset=True", "rotary_offset"
    what = f"{front} RotaryEmbedding({dim}, {rows}, {theta}, {interleaved}, **{opts})"
    try:
        m = FRONTS[front](dim, rows, theta, interleaved, **copy.deepcopy(opts))
    except CTOR_ERRORS as e:
        check_message(what, e)
        if not bad:
            raise Finding(f"{what}: refused valid options: {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        if name and name not in str(e):
            raise Finding(f"{what}: refusal does not name {name}: {str(e).splitlines()[0][:160]}") from None
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
