"""Fuzz cases for apply_rope_cos_sin: tables as callers hand them (Hugging
Face's per-token cos/sin in any float dtype, [max_pos, R] tables or vLLM's
cos_sin_cache with ids), random layouts (3-D tokens too), strides, partial
spans at an offset, both pairings; valid and invalid. Expected values come
from a float64 rotation by the tables as built here, never from rotary."""

from __future__ import annotations

import random

import torch

import rotary

from .common import DEVICE, DOCUMENTED, FLOATS, Finding, bits, check_close, check_vmap, judge_refusal, set_kind
from .op_inputs import Builder, canonical, logical_shape

LAYOUTS = ["BHSD", "BSHD", "SBHD", "THD"]  # THD here: vLLM's [tokens, heads, head_dim]
FORMS = ["S", "1S", "BS", "ids", "cache"]
MODES = ["dense", "permuted", "gapped", "offset"]


def _rotate(x, c, s, rd, off, interleaved):
    """float64 rotation of canonical [B, H, S, D] x by per-token c, s [B | 1, S, rd / 2]."""
    out = x.clone()
    c, s = c[:, None], s[:, None]
    span = x[..., off:off + rd]
    x1, x2 = (span[..., 0::2], span[..., 1::2]) if interleaved else (span[..., :rd // 2], span[..., rd // 2:])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out[..., off:off + rd] = torch.stack([o1, o2], -1).flatten(-2) if interleaved else torch.cat([o1, o2], -1)
    return out


def run_cos_sin(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kind = set_kind("cos_sin:apply_rope_cos_sin")
    dtype, tdtype = rng.choice(FLOATS), rng.choice(FLOATS)
    layout, form = rng.choice(LAYOUTS), rng.choice(FORMS)
    B = 1 if layout == "THD" else rng.randrange(1, 4)
    Hq, Hk, S = rng.randrange(1, 4), rng.randrange(1, 3), rng.choice([0, 1, 2, 5, 9])
    D = rng.choice([2, 4, 8, 16, 32, 48])
    rd = rng.choice([D, D] + list(range(2, D, 2)))
    off = rng.randrange(0, D - rd + 1) if rd < D and rng.random() < 0.5 else 0
    interleaved, L = rng.random() < 0.5, rng.randrange(1, 20)
    b = Builder(rng, gen)
    q = b.tensor(logical_shape(layout, B, Hq, S, D), dtype, rng.choice(MODES))
    k = b.tensor(logical_shape(layout, B, Hk, S, D), dtype, rng.choice(MODES))

    # Per-token float64 angles [B | 1, S, rd / 2], then the tables that hold them.
    per_batch = form == "BS" or (form in ("ids", "cache") and layout != "THD" and rng.random() < 0.5)
    rows_b = B if per_batch else 1
    table = torch.rand(L, rd // 2, generator=gen, dtype=torch.float64) * 6.3
    ids = torch.randint(0, L, (rows_b, S) if per_batch else (S,), generator=gen)
    if form in ("ids", "cache"):
        a = table[ids].reshape(rows_b, S, rd // 2)
    else:
        a = torch.rand(rows_b, S, rd // 2, generator=gen, dtype=torch.float64) * 6.3

    def hf(t):  # [..., rd / 2] -> the pairing's full-width table in tdtype
        return (t.repeat_interleave(2, -1) if interleaved else torch.cat([t, t], -1)).to(tdtype)

    sin_arg, pos = None, None
    if form == "cache":
        cos_arg, pos = torch.cat([table.cos(), table.sin()], -1).to(tdtype), ids
        read_c, read_s = cos_arg[:, :rd // 2][ids], cos_arg[:, rd // 2:][ids]
    else:
        src = table if form == "ids" else a
        cos_arg, sin_arg = hf(src.cos()), hf(src.sin())
        if form == "S":
            cos_arg, sin_arg = cos_arg[0], sin_arg[0]
        pos = ids if form == "ids" else None
        half = (lambda t: t[..., 0::2]) if interleaved else (lambda t: t[..., :rd // 2])
        read_c, read_s = half(cos_arg), half(sin_arg)
        if form == "ids":
            read_c, read_s = read_c[ids], read_s[ids]
    read_c = read_c.float().double().reshape(rows_b, S, rd // 2)
    read_s = read_s.float().double().reshape(rows_b, S, rd // 2)

    reasons = []
    mutation = rng.choice(["not_rope", "rows", "ids_past", "ids_float", "span", "int_table", "no_ids", "layout_3d",
                           "k_rank"]) if rng.random() < 0.3 else None
    if mutation == "not_rope" and sin_arg is not None and S and rd >= 2:
        cos_arg = cos_arg.clone()
        row = cos_arg[ids.view(-1)[0]] if form == "ids" else cos_arg  # a row the call reads
        row[..., -1] += 0.5  # the repeated value no longer repeats
        reasons.append("cos not a table of the pairing")
    elif mutation == "rows" and form in ("S", "1S", "BS") and S:
        cos_arg, sin_arg = torch.cat([cos_arg, cos_arg], -2), torch.cat([sin_arg, sin_arg], -2)
        reasons.append("cos rows != seq")
    elif mutation == "ids_past" and pos is not None and S and DEVICE == "cpu":  # a device asserts
        pos = pos.clone()
        pos.view(-1)[0] = rng.choice([L, L + 5, -1])
        reasons.append("position_ids past the table")
    elif mutation == "ids_float" and pos is not None:
        pos = pos.double()
        reasons.append("float position_ids")
    elif mutation == "span":
        off = D - rd + rng.randrange(1, 3)
        reasons.append("rotary_offset + R > head_dim")
    elif mutation == "int_table":
        cos_arg = cos_arg.to(torch.int32)
        reasons.append("integer table")
    elif mutation == "no_ids" and form == "cache":
        pos = None
        reasons.append("cos_sin_cache without position_ids")
    elif mutation == "layout_3d" and layout == "THD":
        reasons.append("layout with 3-D q")
    elif mutation == "k_rank":
        k = k.flatten(0, 1) if k.dim() == 4 else k.unsqueeze(0)  # flatten: batch may be empty
        reasons.append("k rank != q rank")
    else:
        mutation = None

    kw = {"interleaved": interleaved, "rotary_offset": off}
    if layout != "THD" or mutation == "layout_3d":
        kw["layout"] = "BSHD" if layout == "THD" else layout
    if pos is not None:
        kw["position_ids"] = pos.to(DEVICE)
    args = (q, k, cos_arg.to(DEVICE), None if sin_arg is None else sin_arg.to(DEVICE))
    saved = [bits(t) for t in b.buffers]
    before = [x.detach().to("cpu", torch.float64) for x in (q, k)]
    try:
        out = rotary.apply_rope_cos_sin(*args, **kw)
    except DOCUMENTED as e:
        return kind, "refused: " + judge_refusal("apply_rope_cos_sin", e, b.buffers, saved, reasons,
                                                 mention="apply_rope_cos_sin")
    except Exception as e:  # noqa: BLE001
        raise Finding(f"apply_rope_cos_sin: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if reasons:
        raise Finding(f"apply_rope_cos_sin: accepted bad input ({', '.join(reasons)})")
    for name, o, x in zip(("q", "k"), out, before):
        if o.dtype != dtype or o.shape != x.shape:
            raise Finding(f"apply_rope_cos_sin: output {name} is {o.dtype} {tuple(o.shape)}, input {tuple(x.shape)}")
        expected = _rotate(canonical(x, layout), read_c, read_s, rd, off, interleaved)
        check_close(canonical(o, layout), expected, dtype, f"apply_rope_cos_sin {name} ({layout}, {form})",
                    atol_extra=2e-6 if dtype == torch.float64 else 0.0)
    if any(not torch.equal(bits(t), s) for t, s in zip(b.buffers, saved)):
        raise Finding("apply_rope_cos_sin: out of place, but an input changed")
    if rng.random() < 0.2:
        check_vmap(rng, gen, rotary.apply_rope_cos_sin, [q, k], args[2:], kw, False,
                   lambda name, x: _rotate(canonical(x.to("cpu", torch.float64), layout), read_c, read_s, rd, off,
                                           interleaved),
                   lambda o, want, what: check_close(canonical(o, layout), want, dtype,
                                                     f"apply_rope_cos_sin vmap {what} ({layout}, {form})",
                                                     atol_extra=2e-6 if dtype == torch.float64 else 0.0))
    return kind, "accepted"
