"""The defect classes an earlier 18,000-case fuzz found, as explicit cases:
wrong results (conjugate table with inv_freq, q/k overlapping each other,
a tensor overlapping itself), module state changed by a refused call,
garbage accepted, and messages that expose internals. Each returns
"accepted" / "refused: ..." or raises Finding."""

from __future__ import annotations

import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq
from rotary_testing.reference import rope_reference

from .common import DOCUMENTED, Finding, Refused, bits, check_close, expect_refusal, same_bits, set_kind
from .module_rules import LEAKS, RuleModel, module_reference, same_state, state_of


def _x(*shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _refused_untouched(what, call, *buffers, allowed=DOCUMENTED, must_mention=None):
    saved = [bits(b) for b in buffers]
    try:
        expect_refusal(call, allowed, what)
    except Refused as r:
        if any(not same_bits(b, s) for b, s in zip(buffers, saved)):
            raise Finding(f"{what}: refused but changed its inputs") from None
        if must_mention and must_mention not in str(r):
            raise Finding(f"{what}: the message does not mention {must_mention}: {r}") from None
        if any(leak in str(r) for leak in LEAKS):
            raise Finding(f"{what}: the message exposes internals: {r}") from None
        return f"refused: {r}"
    raise Finding(f"{what}: accepted")


# ---- 1. conjugated table with inv_freq: rows past the table, and gradients
def conj_table_with_inv_freq():
    f = rotary.rope_freqs(8, 4)
    inv, _ = rotary.rope_frequencies(8)
    x = _x(1, 1, 6, 8, seed=1)
    check_close(rotary.apply_rope(x, f.conj(), 0, True, inv_freq=inv), rope_reference(x, 0, inverse=True),
                torch.float64, "apply_rope(x, freqs.conj(), inv_freq=...)")
    leaf, g = x.clone().requires_grad_(), _x(1, 1, 6, 8, seed=2)
    rotary.apply_rope(leaf, f.conj(), 2, True, inv_freq=inv).backward(g)
    check_close(leaf.grad, rope_reference(g, 2), torch.float64, "gradient through freqs.conj() past the table")
    q, k = x.clone(), _x(1, 2, 6, 8, seed=3)
    eq, ek = rope_reference(q, 1, inverse=False), rope_reference(k, 1, inverse=False)
    rotary.apply_rope_qk_(q, k, f.conj(), 1, inverse=True, inv_freq=inv)
    check_close(q, eq, torch.float64, "apply_rope_qk_(freqs.conj(), inverse=True)")
    check_close(k, ek, torch.float64, "apply_rope_qk_(freqs.conj(), inverse=True)")
    return "accepted"


# ---- 2. q and k overlapping each other in place
def qk_partial_overlap():
    buf = _x(1, 2, 4, 12, dtype=torch.float32)
    f = rotary.rope_freqs(8, 16)
    return _refused_untouched("apply_rope_qk_(buf[..., 0:8], buf[..., 4:12])",
                              lambda: rotary.apply_rope_qk_(buf[..., 0:8], buf[..., 4:12], f), buf)


def packed_qkv_still_accepted():
    qkv = _x(2, 5, 3 * 3, 8, dtype=torch.float32)
    q, k = qkv[:, :, :3].transpose(1, 2), qkv[:, :, 3:6].transpose(1, 2)
    eq, ek = rope_reference(q, 2), rope_reference(k, 2)
    v = qkv[:, :, 6:].clone()
    rotary.apply_rope_qk_(q, k, rotary.rope_freqs(8, 16), 2)
    check_close(q, eq, torch.float32, "packed qkv q")
    check_close(k, ek, torch.float32, "packed qkv k")
    if not torch.equal(qkv[:, :, 6:], v):
        raise Finding("packed qkv: v was written")
    return "accepted"


# ---- 3. a tensor overlapping itself in place (as_strided, expanded)
def self_overlap_as_strided():
    base = _x(64, dtype=torch.float32)
    f = rotary.rope_freqs(8, 16)
    return _refused_untouched("apply_rope_(as_strided overlapping)",
                              lambda: rotary.apply_rope_(base.as_strided((1, 1, 4, 8), (32, 32, 4, 1)), f), base)


def self_overlap_expanded():
    base = _x(1, 1, 3, 8, dtype=torch.float32)
    f = rotary.rope_freqs(8, 16)
    return _refused_untouched("apply_rope_(expanded)", lambda: rotary.apply_rope_(base.expand(2, 2, 3, 8), f), base)


# ---- 4. the dynamic rule: a refused call leaves the module as it was
_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def _dynamic_module(front, angle_dtype="float64"):
    """A dynamic module (max_position_embeddings 16) and its rule's model."""
    cls = rotary.RotaryEmbedding if front == "py" else rotary.CppRotaryEmbedding
    return cls(8, 16, scaling=_DYNAMIC, angle_dtype=angle_dtype), RuleModel(8, 10000.0, _DYNAMIC, 16)


def _check_dynamic_call(front, m, model, start, angle_dtype, what):
    """m on 3 tokens at start_pos `start` against the rule's float64 reference at that reach."""
    from rotary_testing.reference import positions_grid
    x = _x(1, 2, 3, 8, seed=5, dtype=torch.float32)
    got = m(x, start)
    model.reach(start + 3)
    inv, scale = model.frequencies()
    ref = module_reference(x, positions_grid(1, 3, start), inv, scale, True, 8, angle_dtype)
    check_close(got, ref, torch.float32, f"{front} dynamic: {what}")


def _dynamic_refusal(front, bad_call, angle_dtype="float64"):
    m, model = _dynamic_module(front, angle_dtype)
    saved = state_of(m)
    try:
        bad_call(m)
    except Exception as e:  # noqa: BLE001 - the type is checked by the module fuzz
        if any(leak in str(e) for leak in LEAKS):
            raise Finding(f"{front} dynamic: message exposes internals: {e}") from None
    else:
        raise Finding(f"{front} dynamic: the bad call was accepted")
    if not same_state(m, saved):
        raise Finding(f"{front} dynamic: a refused call changed the module state")
    for start in (17, 0):  # past max_position_embeddings (the table must grow), then back
        _check_dynamic_call(front, m, model, start, angle_dtype, f"a call (start_pos {start}) after a refused one")
    return "refused: state kept"


def dynamic_refused_odd_head_py():
    return _dynamic_refusal("py", lambda m: m(_x(1, 2, 3, 7, dtype=torch.float32), 997))


def dynamic_refused_odd_head_cpp():
    return _dynamic_refusal("cpp", lambda m: m(_x(1, 2, 3, 7, dtype=torch.float32), 997))


def dynamic_fp32_angles_past_grown_rows_py():
    return _dynamic_refusal("py", lambda m: m(_x(1, 1, 1, 8, dtype=torch.float32), 2**20), "float32")


def dynamic_fp32_angles_past_grown_rows_cpp():
    return _dynamic_refusal("cpp", lambda m: m(_x(1, 1, 1, 8, dtype=torch.float32), 2**20), "float32")


def _dynamic_far(front):
    """A reach of 2^40 is served from row 0 alone (one row per position
    would not fit in memory): the rest on the fly, from the grown base."""
    m, model = _dynamic_module(front)
    _check_dynamic_call(front, m, model, 2**40, "float64", "a call at start_pos 2^40")
    if m.freqs.shape[0] != 1:
        raise Finding(f"{front} dynamic: a reach of 2^40 left a table of {m.freqs.shape[0]} rows, not row 0 alone")
    return "served: the table stays bounded"


def dynamic_far_reach_py():
    return _dynamic_far("py")


def dynamic_far_reach_cpp():
    return _dynamic_far("cpp")


# ---- 5. garbage accepted (each must raise ValueError / TypeError)
GARBAGE = {
    "yarn-mscale-inf": lambda: rotary.RotaryEmbedding(8, 16, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1e308,
        "mscale_all_dim": 1e-308}),
    "yarn-mscale-negative": lambda: rotary.RotaryEmbedding(8, 16, scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": -100.0,
        "mscale_all_dim": 1.0}),
    "linear-factor-1e-320": lambda: rotary.RotaryEmbedding(8, 16, scaling={"rope_type": "linear", "factor": 1e-320}),
    "dynamic-factor-2^62": lambda: rotary.CppRotaryEmbedding(8, 16, scaling={"rope_type": "dynamic", "factor": 2.0**62}),
    "theta-1e-300-float32": lambda: rotary.RotaryEmbedding(8, 16, theta=1e-300, angle_dtype="float32"),
    "sinusoidal-base-5e-324": lambda: rotary.sinusoidal_table(64, 64, 5e-324),
    "default-with-factor": lambda: rotary.RotaryEmbedding(8, 16, scaling={"rope_type": "default", "factor": -1.0}),
    "linear-with-beta-fast": lambda: rotary.RotaryEmbedding(8, 16, scaling={
        "rope_type": "linear", "factor": 2.0, "beta_fast": float("nan")}),
    "interleaved-yes": lambda: rotary.RotaryEmbedding(8, 16, interleaved="yes"),
    "interleaved-none": lambda: rotary.CppRotaryEmbedding(8, 16, interleaved=None),
    "alibi-causal-none": lambda: rotary.alibi_bias(2, 3, None),
    "hf-rope-theta-0": lambda: rotary.RotaryEmbedding.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 16, "rope_theta": 0}),
    "hf-partial-0": lambda: rotary.RotaryEmbedding.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 1, "max_position_embeddings": 16, "partial_rotary_factor": 0.0}),
    "hf-partial-2": lambda: rotary.RotaryEmbedding.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 16, "partial_rotary_factor": 2.0}),
    "hf-partial-1e308": lambda: rotary.RotaryEmbedding.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 16, "partial_rotary_factor": 1e308}),
    "hf-max-positions-0": lambda: rotary.RotaryEmbedding.from_hf_config(
        {"hidden_size": 64, "num_attention_heads": 8, "max_position_embeddings": 0}),
    "load-float64-into-float32": lambda: rotary.RotaryEmbedding(8, 16, angle_dtype="float32").load_state_dict(
        rotary.RotaryEmbedding(8, 16).state_dict()),
    "load-meta-tensor": lambda: rotary.RotaryEmbedding(8, 16).load_state_dict(
        {"freqs": rotary.rope_freqs(8, 16).to("meta"), "inv_freq": rotary.rope_frequencies(8)[0]}),
}


def _garbage(name):
    def case():
        if name.startswith("load-"):  # load_state_dict reports its errors as RuntimeError
            try:
                GARBAGE[name]()
            except NotImplementedError as e:
                raise Finding(f"{name}: undocumented NotImplementedError: {e}") from None
            except (ValueError, TypeError, RuntimeError) as e:
                return f"refused: {type(e).__name__}"
            raise Finding(f"{name}: accepted")
        return _refused_untouched(name, GARBAGE[name], allowed=(ValueError, TypeError))
    case.__name__ = "garbage_" + name
    return case


# ---- 7. messages: an out-of-range or tensor start_pos names start_pos
def start_pos_2_64():
    x, f = _x(1, 1, 2, 8, dtype=torch.float32), rotary.rope_freqs(8, 16)
    return _refused_untouched("apply_rope(start_pos=2**64)", lambda: rotary.apply_rope(x, f, 2**64), x,
                              must_mention="start_pos")


def module_start_pos_tensor():
    x = _x(1, 1, 2, 8, dtype=torch.float32)
    return _refused_untouched("RotaryEmbedding(x, torch.tensor(3))", lambda: rotary.RotaryEmbedding(8, 16)(x, torch.tensor(3)),
                              x, must_mention="start_pos")


# ---- 8. the defect classes of the fuzz over the later arguments
def rotary_offset_near_int64_max():
    """rotary_offset + rotary_dim overflowed int64 and passed the span check."""
    q, k = _x(1, 2, 5, 16, seed=7, dtype=torch.float32), _x(1, 2, 5, 16, seed=8, dtype=torch.float32)
    f = rotary.freqs_table(8, 16)
    return _refused_untouched("apply_rope_qk_(rotary_offset=2**63-8)",
                              lambda: rotary.apply_rope_qk_(q, k, f, 5, rotary_offset=2**63 - 8), q, k,
                              must_mention="rotary_offset")


def _neg_view(t):
    base = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)
    base[..., 1] = -t
    return torch.view_as_complex(base).conj().imag, base


def _right_or_refused(what, call, bases, check):
    """A negative view: the right result for its logical values, or a
    documented refusal that leaves every byte as it was."""
    saved = [bits(b) for b in bases]
    try:
        expect_refusal(call, DOCUMENTED, what)
    except Refused as r:
        if any(not same_bits(b, s) for b, s in zip(bases, saved)):
            raise Finding(f"{what}: refused ({r}) but changed its inputs") from None
        return f"refused: {r}"
    check()
    return "accepted"


def neg_view_as_k_in_place():
    q = _x(1, 2, 4, 8, seed=9, dtype=torch.float32)
    k, kbase = _neg_view(_x(1, 1, 4, 8, seed=10, dtype=torch.float32))
    eq, ek = rope_reference(q, 1), rope_reference(k.resolve_neg(), 1)
    f = rotary.freqs_table(8, 16)

    def check():
        check_close(q, eq, torch.float32, "apply_rope_qk_ q (k a negative view)")
        check_close(k, ek, torch.float32, "apply_rope_qk_ k (a negative view)")

    return _right_or_refused("apply_rope_qk_(q, negative-bit k)", lambda: rotary.apply_rope_qk_(q, k, f, 1), [q, kbase],
                             check)


def _kv_inputs(fp8=False):
    q = _x(1, 2, 3, 8, seed=11, dtype=torch.float32)
    k, v = _x(1, 1, 3, 8, seed=12, dtype=torch.float32), _x(1, 1, 3, 8, seed=13, dtype=torch.float32)
    kc, vc = _x(1, 1, 8, 8, seed=14, dtype=torch.float32), _x(1, 1, 8, 8, seed=15, dtype=torch.float32)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    return q, k, v, kc, vc, rotary.freqs_table(8, 16)


def _neg_view_kv(which):
    def case():
        q, k, v, kc, vc, f = _kv_inputs()
        args = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc)
        view, base = _neg_view(args[which])
        eq, ek = rope_reference(q, 2), rope_reference(k, 2)
        kc0, vc0 = kc.clone(), vc.clone()
        args[which] = view
        bases = [q, k, v, kc, vc, base]

        def check():
            check_close(args["q"], eq, torch.float32, f"kv op q ({which} a negative view)")
            check_close(args["k"], ek, torch.float32, f"kv op k ({which} a negative view)")
            want_k, want_v = kc0.clone(), vc0.clone()
            want_k[:, :, 2:5], want_v[:, :, 2:5] = args["k"].resolve_neg(), v
            for name, want in (("k_cache", want_k), ("v_cache", want_v)):
                if not torch.equal(args[name].resolve_neg(), want):
                    raise Finding(f"kv op ({which} a negative view): {name} holds the wrong rows")

        return _right_or_refused(f"apply_rope_with_kv_cache_(negative-bit {which})",
                                 lambda: rotary.apply_rope_with_kv_cache_(args["q"], args["k"], args["v"], args["k_cache"],
                                                                          args["v_cache"], f, 2), bases, check)
    case.__name__ = f"neg_view_kv_{which}"
    return case


def uint8_positions_do_not_wrap():
    """Deprecated positions= ids were added to start_pos in their own dtype:
    uint8 250 + 10 rotated at 4, not 260."""
    import warnings

    x = _x(1, 1, 1, 8, seed=16)
    f = rotary.freqs_table(8, 300)
    for pos in (torch.tensor([[250]], dtype=torch.uint8), torch.tensor(250, dtype=torch.uint8)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                out = rotary.apply_rope(x, f, 10, positions=pos)
            except Exception as e:  # noqa: BLE001
                raise Finding(f"apply_rope(start_pos=10, positions=uint8 {list(pos.shape)} 250): "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        check_close(out, rope_reference(x, 260), torch.float64,
                    f"apply_rope(start_pos=10, positions=uint8 {list(pos.shape)} 250) (row 260)")
    return "accepted"


def _fp8_bad_scale(name, value):
    def case():
        q, k, v, kc, vc, f = _kv_inputs(fp8=True)
        kw = {name: torch.tensor(value)}
        return _refused_untouched(f"apply_rope_with_kv_cache_({name}={value})",
                                  lambda: rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 0, **kw),
                                  q, k, v, kc, vc, must_mention=name)
    case.__name__ = f"fp8_{name}_{str(value).replace('-', 'minus_').replace('.', '_')}"
    return case


def _scalar_start_pos(value):
    def case():
        x, f = _x(1, 1, 2, 8, dtype=torch.float32), rotary.freqs_table(8, 16)
        out = [_refused_untouched(f"{op}(start_pos={value!r})", lambda: getattr(rotary, op)(x, f, value), x,
                                  allowed=(TypeError, ValueError), must_mention="start_pos")
               for op in ("apply_rope", "apply_rope_")]
        return out[-1]
    case.__name__ = f"start_pos_{type(value).__name__}"
    return case


CASES = [conj_table_with_inv_freq, qk_partial_overlap, packed_qkv_still_accepted, self_overlap_as_strided,
         self_overlap_expanded, dynamic_refused_odd_head_py, dynamic_refused_odd_head_cpp,
         dynamic_fp32_angles_past_grown_rows_py, dynamic_fp32_angles_past_grown_rows_cpp, dynamic_far_reach_py,
         dynamic_far_reach_cpp, start_pos_2_64, module_start_pos_tensor] + [_garbage(n) for n in GARBAGE] + [
         rotary_offset_near_int64_max, neg_view_as_k_in_place, uint8_positions_do_not_wrap,
         _scalar_start_pos(True), _scalar_start_pos(2.0)] + [_neg_view_kv(w) for w in ("k", "k_cache", "v_cache")] + [
         _fp8_bad_scale("k_scale", v) for v in (0.0, float("nan"), float("inf"), -1.0)] + [
         _fp8_bad_scale("v_scale", float("nan"))]


def run(index: int):
    case = CASES[index]
    kind = set_kind(f"regression:{case.__name__}")
    return kind, case()
