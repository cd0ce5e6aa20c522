"""Fuzz cases for rotary.KVCache + CppRotaryEmbedding.forward_with_cache:
valid and bad cache options, appends up to and past the capacity (accepted:
q and k against the float64 reference, the appended rows bitwise equal to
the rotated k / v, fp8 quantized as torch does; refused: the cache, its
length and q / k unchanged), and bool / float where they take ints. Split
from kv_cases.py (the fused op's cases)."""

from __future__ import annotations

import random

import numpy as np
import torch

import rotary
from rotary_testing.reference import exact_angle

from .arg_draw import reference
from .common import DOCUMENTED, Finding, bits, check_close, same_bits, set_kind
from .kv_oracle import BAD_SCALES, FP8
from .module_rules import LEAKS, judge_options_refusal


# ------------------------------------------------------ KVCache + module
def run_kv_module(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kind = set_kind("module:kv_cache")
    dim = rng.choice([4, 8, 16])
    D = dim + rng.choice([0, 0, 2])
    dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16, FP8])
    layout = rng.choice(["BHSD", "BSHD"])
    H, cap, batch = rng.randrange(1, 3), rng.randrange(2, 12), rng.randrange(1, 3)
    kw = dict(layout=layout, dtype=dtype)
    if dtype == FP8 and rng.random() < 0.7:
        kw["k_scale"], kw["v_scale"] = rng.choice([0.5, 0.25, 1.0, rng.uniform(0.1, 2)]), rng.choice([0.5, 2.0, 1.0])
        for sname in ("k_scale", "v_scale"):  # or one per kv head
            if rng.random() < 0.4:
                kw[sname] = [rng.choice([0.5, 0.25, 2.0, rng.uniform(0.1, 2)]) for _ in range(H)]
    bad, name = None, None
    if rng.random() < 0.4:
        m = rng.choice(["odd_head", "scale_nonfp8", "scale_value", "layout", "dtype", "batch", "capacity", "heads",
                        "head_scales"])
        if m == "odd_head":
            D, bad, name = rng.choice([7, 3, 1]), "odd head_dim", "head_dim"
        elif m == "scale_nonfp8" and dtype != FP8:
            kw[rng.choice(["k_scale", "v_scale"])] = rng.choice([0.5, 2.0])
            bad, name = "a scale on a non-fp8 cache", "scale"
        elif m == "scale_value":
            kw["dtype"], dtype = FP8, FP8
            sname = rng.choice(["k_scale", "v_scale"])
            kw[sname] = rng.choice(BAD_SCALES)
            bad, name = f"{sname}={kw[sname]}", sname
        elif m == "layout":
            kw["layout"], bad, name = rng.choice(["NHD", "HND", "bhsd", "SBHD"]), "unknown layout", "layout"
        elif m == "dtype":
            kw["dtype"], bad, name = rng.choice([torch.int8, torch.float8_e5m2, torch.complex64]), "dtype", "dtype"
        elif m == "batch":
            batch, bad, name = -1, "batch < 0", "batch"
        elif m == "capacity":
            cap, bad, name = rng.choice([0, -2]), "capacity <= 0", "capacity"
        elif m == "heads":
            H, bad, name = 0, "kv_heads 0", "kv_heads"
        elif m == "head_scales":
            kw["dtype"], dtype = FP8, FP8
            sname = rng.choice(["k_scale", "v_scale"])
            kw[sname] = rng.choice([[0.5] * (H + 1), [], [0.5] * (H - 1) + [rng.choice(BAD_SCALES)]])
            bad, name = f"{sname}={kw[sname]}", sname
    what = f"KVCache({batch}, {H}, {cap}, {D}, {kw})"
    try:
        cache = rotary.KVCache(batch, H, cap, D, **kw)
    except (ValueError, TypeError) as e:
        judge_options_refusal(what, e, bad, name)
        return kind, f"refused: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    if bad:
        raise Finding(f"{what}: accepted ({bad})")
    rope = rotary.CppRotaryEmbedding(dim, 64, interleaved=rng.random() < 0.5)
    work = torch.float32 if dtype == FP8 else dtype
    inv = rotary.inv_frequencies(dim)[0].numpy()
    bufs = dict(cache.named_buffers())
    ks = bufs.get("k_scale")
    vs = bufs.get("v_scale")
    outcomes = []
    for step in range(rng.randrange(1, 4)):
        S = rng.randrange(1, 4)
        filled = cache.length
        start = None if rng.random() < 0.6 else rng.randrange(0, 20)
        Hq = H * rng.choice([1, 2])
        q = torch.randn(batch, Hq, S, D, generator=gen).to(work)
        k = torch.randn(batch, H, S, D, generator=gen).to(work)
        v = torch.randn(batch, H, S, D, generator=gen).to(work)
        q0, k0, v0 = q.clone(), k.clone(), v.clone()
        snap = [bits(t) for t in cache.buffers()]
        over = filled + S > cap
        try:
            rope.forward_with_cache(q, k, v, cache, start) if start is not None else rope.forward_with_cache(q, k, v, cache)
        except DOCUMENTED as e:
            if not over:
                raise Finding(f"{what}: forward_with_cache refused a valid call: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]}") from None
            if cache.length != filled or any(not same_bits(t, s) for t, s in zip(cache.buffers(), snap)) \
                    or not torch.equal(q, q0) or not torch.equal(k, k0):
                raise Finding(f"{what}: a refused forward_with_cache changed the cache or q/k") from None
            outcomes.append("refused")
            continue
        except Exception as e:  # noqa: BLE001
            raise Finding(f"{what}: forward_with_cache: undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        if over:
            raise Finding(f"{what}: forward_with_cache accepted {S} tokens past the capacity")
        p = filled if start is None else start
        ang = exact_angle(np.broadcast_to(np.arange(p, p + S, dtype=np.int64)[None, :], (batch, S)), inv)
        for nm, t, t0 in (("q", q, q0), ("k", k, k0)):
            check_close(t, reference(t0.double(), ang, 0, dim, rope.interleaved), work, f"{what} forward_with_cache {nm}")
        if cache.length != filled + S:
            raise Finding(f"{what}: length {cache.length} after appending {S} to {filled}")
        for cname, src, sc in (("k", k, ks), ("v", v0, vs)):
            buf = bufs[cname]
            rows = (buf.transpose(1, 2) if layout == "BSHD" else buf)[:, :, filled : filled + S]
            per = sc.view(1, -1, 1, 1) if dtype == FP8 and sc.dim() == 1 else sc  # one scale per kv head
            want = (src.to(torch.float32) / per).clamp(-448, 448).to(FP8) if dtype == FP8 else src
            if not torch.equal(bits(rows), bits(want)):
                raise Finding(f"{what}: cache.{cname} rows {filled}..{filled + S} differ from the rotated k / v")
        outcomes.append("accepted")
    return kind, f"accepted ({', '.join(outcomes)})"


def run_kv_module_scalars(seed):
    """bool / float where the KVCache and forward_with_cache take ints."""
    rng = random.Random(seed)
    kind = set_kind("scalars")
    value = rng.choice([True, 2.0, 1.5, float("nan")])
    where = rng.choice(["batch", "kv_heads", "capacity", "head_dim", "start_pos"])
    if where != "start_pos":
        a = dict(batch=1, kv_heads=1, capacity=4, head_dim=8)
        a[where] = value
        try:
            rotary.KVCache(a["batch"], a["kv_heads"], a["capacity"], a["head_dim"])
        except (TypeError, ValueError) as e:
            if where not in str(e) or any(leak in str(e) for leak in LEAKS):
                raise Finding(f"KVCache({where}={value!r}): message does not name {where} clearly: "
                              f"{str(e).splitlines()[0][:160]}") from None
            return kind, f"refused: {type(e).__name__}"
        except Exception as e:  # noqa: BLE001
            raise Finding(f"KVCache({where}={value!r}): undocumented {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        raise Finding(f"KVCache({where}={value!r}): accepted")
    cache = rotary.KVCache(1, 1, 4, 8)
    rope = rotary.CppRotaryEmbedding(8, 16)
    q, k, v = (torch.randn(1, 1, 1, 8) for _ in range(3))
    q0, k0 = q.clone(), k.clone()
    snap = [bits(t) for t in cache.buffers()]
    try:
        rope.forward_with_cache(q, k, v, cache, value)
    except (TypeError, ValueError) as e:
        if "start_pos" not in str(e) or any(leak in str(e) for leak in LEAKS):
            raise Finding(f"forward_with_cache(start_pos={value!r}): message does not name start_pos clearly: "
                          f"{str(e).splitlines()[0][:160]}") from None
        if cache.length or any(not same_bits(t, s) for t, s in zip(cache.buffers(), snap)) or not torch.equal(q, q0) \
                or not torch.equal(k, k0):
            raise Finding(f"forward_with_cache(start_pos={value!r}): refused but changed the cache or q/k") from None
        return kind, f"refused: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001
        raise Finding(f"forward_with_cache(start_pos={value!r}): undocumented {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160]}") from None
    raise Finding(f"forward_with_cache(start_pos={value!r}): accepted")
