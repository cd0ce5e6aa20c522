"""The SASS contract's rules for rotary::kernel::rope_kernel and the fused
KV-cache rope_kv_kernel (stated in contract.py's docstring): no division in
the body, 128-bit streaming q/k accesses, the data loads of a row before its
table read, the next row's L2 prefetch with this row's loads, and the cache
stores' width. Split from contract.py."""

from __future__ import annotations

import re
from typing import List, Tuple

from sass_listing import (FUSED_KERNEL, KERNEL, MEM, PREFETCH, Kernel, _body, _common, _divisions, _spill_budget,
                          kernels_of)


FUSED_FP8_SPILL_BUDGET = 16


def check_kernel(k: Kernel, block_threads: int = 256, min_blocks: int = 2) -> List[str]:
    body = _body(k)
    mem = [(a, t, m["op"], m["mods"]) for a, t in body for m in [MEM.match(t)] if m]
    cache_store = k.cache_store
    if cache_store is not None and cache_store != ".E.128":
        mem = _spill_budget(mem, FUSED_FP8_SPILL_BUDGET)
    bad = _common(k, mem, block_threads, min_blocks)
    divisions = _divisions(k)
    if divisions:
        bad.append(f"{k.label}: {divisions} FCHK: a float32 division in the body (rows step without dividing; the "
                   "fp8 write multiplies by Fp8Scale's reciprocal)")
    if not k.vectorized:
        return bad
    data_loads = [(a, mods) for a, _, op, mods in mem if op == "LDG" and ".EF" in mods]
    if not data_loads:  # then no load can be told from a table load
        return bad + [f"{k.label}: no streaming (.EF) data load: q and k loads must stream"] + [
            f"{k.label}: a store narrower than 128 bits at 0x{a:04x}: {t}"
            for a, t, op, mods in mem if op == "STG" and ".128" not in mods]
    for a, t, op, mods in mem:
        if op == "STG" and cache_store is not None and ".EF" not in mods:
            if mods != cache_store:
                bad.append(f"{k.label}: a cache store {mods or 'STG'} at 0x{a:04x}, not one STG{cache_store} per "
                           f"16 bytes of data: {t}")
        elif op == "STG" and ".128" not in mods:
            bad.append(f"{k.label}: a store narrower than 128 bits at 0x{a:04x}: {t}")
        if op == "LDG" and ".EF" in mods and ".128" not in mods:
            bad.append(f"{k.label}: a data load narrower than 128 bits at 0x{a:04x}: {t}")
    for i, (a, t, op, mods) in enumerate(mem):
        if op != "LDG" or ".EF" in mods or ".128" not in mods:
            continue
        before = next((m for m in reversed(mem[:i]) if m[2] == "STG" or (m[2] == "LDG" and ".EF" in m[3])), None)
        if before is None or before[2] == "STG":
            where = "the kernel's start" if before is None else f"the store at 0x{before[0]:04x}"
            bad.append(f"{k.label}: the table load at 0x{a:04x} is not preceded by a data load (back to {where}): "
                       "a row takes two dependent memory round trips")
    prefetches = [a for a, t in body if PREFETCH.match(t)]
    if not prefetches and k.prefetches:
        bad.append(f"{k.label}: no L2 prefetch (CCTL.E.PF2): the next row's bytes are not in flight with this row's")
    for a in prefetches:
        before = next((m for m in reversed(mem) if m[0] < a and (m[2] == "STG" or (m[2] == "LDG" and ".EF" in m[3]))),
                      None)
        if before is None or before[2] == "STG":
            where = "the kernel's start" if before is None else f"the store at 0x{before[0]:04x}"
            bad.append(f"{k.label}: the L2 prefetch at 0x{a:04x} is not issued with a row's data loads (back to "
                       f"{where})")
    return bad


def check(sass: str, res_usage: str = "", block_threads: int = 256, min_blocks: int = 2,
          pattern: "re.Pattern[str]" = KERNEL) -> Tuple[int, List[str]]:
    """(kernels checked, violations); pattern FUSED_KERNEL checks the fused
    KV-cache kernels."""
    kernels = kernels_of(sass, res_usage, pattern)
    bad: List[str] = []
    for k in kernels:
        bad += check_kernel(k, block_threads, min_blocks)
    if not kernels:
        bad.append(f"no {'rope_kv_kernel' if pattern is FUSED_KERNEL else 'rope_kernel'} instantiation in the listing")
    return len(kernels), bad
