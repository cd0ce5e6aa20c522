"""Fuzz cases for modules built from elsewhere: from_hf_config (and
rope_kwargs_from_hf_config for the C++ front end) on valid and garbage
configs, and load_state_dict between both front ends, matching or not (a
refusal leaves the module unchanged). Split from module_cases.py (the
oracle: module_rules.py)."""

from __future__ import annotations

import copy
import random

import torch

import rotary

from .common import Finding, set_kind
from .module_rules import CTOR_ERRORS, FRONTS, check_message, same_state, state_of, valid_scaling


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
    # ntk is rotary's own rule: transformers has none, so a config naming it is refused.
    garbage = "rope_type ntk (not a transformers rule)" if rule and rule["rope_type"] == "ntk" else None
    if garbage is None and rng.random() < 0.5:
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
