"""What kv_cases.py does to a drawn call before it runs: one invalid
mutation (sometimes), or, with the views focus, one argument as a negative
or conjugate view. Each edits the draw's arguments and says why the call
must now be refused."""

from __future__ import annotations

import torch

from .arg_draw import neg_view, position_problem
from .kv_oracle import BAD_SCALES, FP8

MUTATIONS = ["scale_value", "scale_value", "scale_value", "scale_nonfp8", "scale_dtype", "scale_shape", "no_slot",
             "slot_contig", "cpos_paged", "kv_layout", "cache_dtype", "cache_heads", "v_is_k", "v_in_cache",
             "caches_alias", "cache_expanded", "dest_float", "v_dtype"]
# The argument each mutation's refusal must name (None: the op may say it otherwise).
MENTION = {"scale_value": None, "scale_nonfp8": "k_scale", "scale_dtype": "scale", "scale_shape": "scale",
           "no_slot": "slot_mapping", "slot_contig": "slot_mapping", "cpos_paged": "cache_positions",
           "kv_layout": "kv_layout", "cache_dtype": "k_cache", "cache_heads": "cache", "v_is_k": "v",
           "v_in_cache": "v", "caches_alias": "cache", "cache_expanded": "cache", "dest_float": None,
           "v_dtype": "v", "scalar": "start_pos"}


def mutate(c, args):
    """One invalid mutation of args ([q, k, v, k_cache, v_cache, freqs]) and
    c.kw, or none; returns its name. Sets c.mention to what the refusal must name."""
    rng, kw, reasons = c.rng, c.kw, c.reasons
    mutation = None
    if c.focus is None and rng.random() < 0.4:
        mutation = rng.choice(MUTATIONS)
    if c.focus == "scalars":
        mutation = "scalar"
    mention = MENTION.get(mutation)
    if mutation == "scale_value":
        if not c.fp8:
            args[3], args[4] = c.kc.to(FP8), c.vc.to(FP8)
            c.b.buffers += [args[3], args[4]]
            c.fp8, c.cdtype = True, FP8
        name = rng.choice(["k_scale", "v_scale"])
        n = rng.choice([0, 1, c.Hk])
        vals = [rng.uniform(0.05, 2.0) for _ in range(max(n, 1))]
        vals[rng.randrange(len(vals))] = rng.choice(BAD_SCALES)
        kw[name] = torch.tensor(vals[0] if n == 0 else vals, dtype=torch.float32)
        reasons.append(f"{name} {vals}")
        mention = name
    elif mutation == "scale_nonfp8" and not c.fp8:
        kw["k_scale"] = torch.tensor(rng.choice([1.0, 0.5]))
        reasons.append("k_scale on a non-fp8 cache")
    elif mutation == "scale_dtype" and c.fp8:
        kw[rng.choice(["k_scale", "v_scale"])] = torch.tensor(0.5, dtype=rng.choice([torch.float64, torch.float16,
                                                                                    torch.int32]))
        reasons.append("scale not float32")
    elif mutation == "scale_shape" and c.fp8:
        kw[rng.choice(["k_scale", "v_scale"])] = torch.full((c.Hk + 1,), 0.5)
        reasons.append("scale shape")
    elif mutation == "no_slot" and c.paged:
        kw.pop("slot_mapping")
        reasons.append("paged without slot_mapping")
    elif mutation == "slot_contig" and not c.paged:
        kw["slot_mapping"] = torch.zeros(c.T, dtype=torch.int64)
        reasons.append("slot_mapping with a contiguous cache")
    elif mutation == "cpos_paged" and c.paged:
        kw["cache_positions"] = torch.zeros(c.T, dtype=torch.int64)
        reasons.append("cache_positions with a paged cache")
    elif mutation == "kv_layout":
        kw["kv_layout"] = rng.choice(["bhsd", "THD", "", "SBHD", "NHD " if c.paged else "BHSD "])
        reasons.append("unknown kv_layout")
    elif mutation == "cache_dtype":
        other = torch.float64 if c.dtype != torch.float64 else torch.float32
        other = rng.choice([other, torch.int8, torch.float8_e5m2])
        args[3], args[4] = c.kc.to(other), c.vc.to(other)
        c.b.buffers += [args[3], args[4]]
        reasons.append("cache dtype")
    elif mutation == "cache_heads":
        ax = 2 if c.kv_layout in ("BSHD", "NHD") else 1
        args[3] = c.kc.narrow(ax, 0, 1).repeat_interleave(c.Hk + 1, ax)
        args[4] = c.vc.narrow(ax, 0, 1).repeat_interleave(c.Hk + 1, ax)
        c.b.buffers += [args[3], args[4]]
        reasons.append("cache heads")
    elif mutation == "v_is_k" and c.T:
        args[2] = c.k
        reasons.append("v is k")
    elif (mutation == "v_in_cache" and c.T and c.kv_layout == "BHSD" and not c.fp8 and c.shape[2] >= c.S
          and c.shape[0] >= c.B and c.layout == "BHSD"):
        args[2] = c.vc[:c.B, :, :c.S] if not c.varlen else c.vc
        if args[2].shape == c.v.shape:
            reasons.append("v inside v_cache")
        else:
            args[2] = c.v
    elif mutation == "caches_alias":
        args[4] = args[3]
        reasons.append("v_cache is k_cache")
    elif mutation == "cache_expanded" and c.shape[0] > 1:
        args[3] = c.kc.narrow(0, 0, 1).expand(c.shape)
        reasons.append("expanded k_cache")
    elif mutation == "dest_float":
        name = "slot_mapping" if c.paged else "cache_positions"
        kw[name] = torch.zeros(c.T if c.T else 1, dtype=torch.float32)
        reasons.append(f"{name} float")
        mention = name
    elif mutation == "v_dtype":
        args[2] = c.v.to(torch.float64 if c.dtype != torch.float64 else torch.float32)
        c.b.buffers.append(args[2])
        reasons.append("v dtype")
    elif mutation == "scalar":
        c.start = rng.choice([True, False, 2.0, 1.5, float("nan"), "1", torch.tensor(1.0)])
        reasons.append(f"start_pos={c.start!r}")
    else:
        mutation = None
    if mutation:
        c.mention = mention if len(reasons) == 1 else None
    elif len(reasons) > 1:
        c.mention = None
    return mutation


def negative_view(c, args):
    """One argument as a negative / conjugate view (the bits a kernel must
    resolve first); returns which, "none" where the draw had none to make."""
    rng, kw = c.rng, c.kw
    which = rng.choice(["q", "k", "v", "k_cache", "v_cache", "freqs_conj", "freqs_neg", "slot_or_pos", "positions",
                        "k_scale"])
    idx = {"q": 0, "k": 1, "v": 2, "k_cache": 3, "v_cache": 4}
    if which in idx:
        view, base = neg_view(args[idx[which]], rng)
        if view is None:
            which = None
        else:
            c.b.buffers.append(base)
            args[idx[which]] = view
    elif which == "freqs_conj":
        args[5] = c.table.conj()  # turns the other way; inv_freq stays the table's own
    elif which == "freqs_neg":
        args[5] = torch._neg_view(c.table)
        if c.use_inv:
            kw.pop("inv_freq")
            c.use_inv = False
            why = position_problem(c.pos, c.use_inv, c.L)
            if why and why not in c.reasons:
                c.reasons.append(why)
    elif which == "slot_or_pos":
        name = "slot_mapping" if c.paged else "cache_positions"
        if name in kw and kw[name].dtype in (torch.int32, torch.int64):
            kw[name], _ = neg_view(kw[name], rng)
    elif which == "positions":
        name = "offsets" if "offsets" in kw else ("position_ids" if "position_ids" in kw else None)
        if name and kw[name].dtype in (torch.int32, torch.int64):
            kw[name], _ = neg_view(kw[name], rng)
    return which or "none"
