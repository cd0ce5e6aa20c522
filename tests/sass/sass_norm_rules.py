"""The SASS contract's rules for rotary::kernel::norm_rope_kernel, the
prologue (stated in contract.py's docstring): its spill budget and resident
blocks, the sum of squares NORM_BATCH loads at a time and reduced as a warp
butterfly, the vector path and its table reads, the fp8 q write, and the
cache write after its block barrier. Split from contract.py."""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

from sass_listing import (FP8_CACHE_STORE, MEM, NORM_KERNEL, PREFETCH, TYPES, Kernel, _body, _common, _divisions,
                          _spill_budget, kernels_of)


# The vector instantiations hold kNormLaneHeads heads' items per lane (64
# bytes of bf16 in flight): 3 blocks of them keep more bytes in flight per
# SM than 4 of the element path's (benchmarks/launch_model.py).
NORM_BLOCK_THREADS, NORM_MIN_BLOCKS, NORM_VECTOR_MIN_BLOCKS = 128, 4, 3


NORM_SPILL_BUDGET = 0  # stack-frame LDL/STL a prologue instantiation may make
# kNormBatch, read from the kernel's launch description.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csrc", "cuda",
                       "norm_grid.cuh")) as _src:
    NORM_BATCH = int(re.search(r"constexpr int kNormBatch = (\d+);", _src.read()).group(1))
# kNormCacheBatch, the vector cache write's loads before its stores.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csrc", "cuda",
                       "norm_cache.cuh")) as _src:
    NORM_CACHE_BATCH = int(re.search(r"constexpr int kNormCacheBatch = (\d+);", _src.read()).group(1))
# x * x into a sum (or the first product), fp32 or fp64.
SQUARE = re.compile(r"\b(?:FFMA|DFMA)(?:\.\w+)* R\d+, (?P<a>R\d+), (?P=a), "
                    r"|\b(?:FMUL|DMUL)(?:\.\w+)* R\d+, (?P<b>R\d+), (?P=b) ;")


def square_runs(body: List[Tuple[int, str]]) -> List[int]:
    """Lengths of the runs of square ops with no load or branch between them."""
    runs, cur = [], 0
    for _, t in body:
        if SQUARE.search(t):
            cur += 1
        elif ("LDG" in t or "BRA" in t) and cur:
            runs.append(cur)
            cur = 0
    return runs + [cur] if cur else runs


# The vector path (norm_vector.cuh) of the vector instantiations:
# q/k as 16-byte streaming loads and stores (a rotated item of half
# pairing is two, a pass-through item one), cos/sin as 16-byte table reads
# (N-D positions: a pair's 8 bytes from its axis's row).
NORM_VECTOR_ACCESSES = 3
DATA_VECTOR_LOAD, DATA_VECTOR_STORE = re.compile(r"\bLDG\.E\.EF\.128\b"), re.compile(r"\bSTG\.E\.EF\.128\b")
TABLE_LOAD = re.compile(r"\bLDG\.E\.(?:64|128)\.CONSTANT\b")


def check_norm_vector(k: Kernel, body: List[Tuple[int, str]]) -> List[str]:
    """The vector path's accesses, and its table reads issued with its data loads."""
    loads = sum(bool(DATA_VECTOR_LOAD.search(t)) for _, t in body)
    stores = sum(bool(DATA_VECTOR_STORE.search(t)) for _, t in body)
    bad = []
    if min(loads, stores) < NORM_VECTOR_ACCESSES:
        bad.append(f"{k.label}: {loads} 16-byte streaming loads and {stores} stores of q/k "
                   f"({NORM_VECTOR_ACCESSES} of each wanted): the vector path must move whole vectors")
    texts = [t for _, t in body]
    for i, t in enumerate(texts):
        if not TABLE_LOAD.search(t):
            continue
        # The table read's basic block (up to the branches on either side).
        lo = next((j + 1 for j in range(i - 1, -1, -1) if "BRA" in texts[j]), 0)
        hi = next((j for j in range(i + 1, len(texts)) if "BRA" in texts[j] or "EXIT" in texts[j]), len(texts))
        if not any(DATA_VECTOR_LOAD.search(u) for u in texts[lo:hi]):
            bad.append(f"{k.label}: a table read at 0x{body[i][0]:04x} with no q/k vector load in its block: a head "
                       "would cost two dependent round trips")
    return bad


def check_norm_vector_cache(k: Kernel, n: "re.Match[str]", after: List[str]) -> List[str]:
    """The vector cache write after the last barrier: NORM_CACHE_BATCH 16-byte
    loads of k and v, then as many stores of the cache's chunk (16 bytes, or
    one byte per element for fp8), the first after the batch's loads."""
    width = FP8_CACHE_STORE[TYPES[n["T"]]] if n["cache"] == "h" else ".E.128"
    store = re.compile(rf"\bSTG{re.escape(width)}\s")
    loads = [i for i, t in enumerate(after) if DATA_VECTOR_LOAD.search(t)]
    stores = [i for i, t in enumerate(after) if store.search(t)]
    if (len(loads) < NORM_CACHE_BATCH or len(stores) < NORM_CACHE_BATCH
            or stores[0] < loads[NORM_CACHE_BATCH - 1]):
        return [f"{k.label}: {len(loads)} 16-byte loads and {len(stores)} STG{width} after the last barrier "
                f"({NORM_CACHE_BATCH} loads, then {NORM_CACHE_BATCH} stores, wanted): the vector cache write must "
                "move whole vectors, a batch at a time"]
    return []


def check_norm_kernel(k: Kernel) -> List[str]:
    body = _body(k)
    mem = [(a, t, m["op"], m["mods"]) for a, t in body for m in [MEM.match(t)] if m]
    n = NORM_KERNEL.search(k.name)
    vector = bool(n) and n["vec"] == "1"
    bad = _common(k, _spill_budget(mem, NORM_SPILL_BUDGET), NORM_BLOCK_THREADS,
                  NORM_VECTOR_MIN_BLOCKS if vector else NORM_MIN_BLOCKS)
    if vector:
        bad += check_norm_vector(k, body)
        if not any(PREFETCH.match(t) for _, t in body) and k.label != "norm_rope_kernel<fp32, fp8 cache, vector>":
            bad.append(f"{k.label}: no L2 prefetch (CCTL.E.PF2): the block's next row is not asked of L2")
    batched = sum(r >= NORM_BATCH for r in square_runs(body))
    if batched < 2:
        bad.append(f"{k.label}: {batched} runs of {NORM_BATCH} square sums with no load between them (2 wanted): "
                   "the sum of squares must load a batch before it sums one")
    shuffles = sum("SHFL.BFLY" in t for _, t in body)
    if shuffles < 5:
        bad.append(f"{k.label}: {shuffles} SHFL.BFLY: the per-head sum of squares must reduce as a warp butterfly")
    barriers = [i for i, (_, t) in enumerate(body) if "BAR.SYNC" in t]
    if n and n["cache"] != "v":
        if len(barriers) < 3:
            bad.append(f"{k.label}: {len(barriers)} BAR.SYNC: the cache write must wait at a block barrier for the "
                       "row's k")
        else:
            after = [t for _, t in body[barriers[-1]:]]
            first_store = next((i for i, t in enumerate(after) if "STG" in t), len(after))
            loads = sum("LDG" in t for t in after[:first_store])
            if loads < 2 * NORM_BATCH:
                bad.append(f"{k.label}: {loads} loads before the cache write's first store ({2 * NORM_BATCH} wanted): "
                           "the write must load a batch of k and v before it stores one")
            if vector:
                bad += check_norm_vector_cache(k, n, after)
    return bad

# The fp8 q vector write: a vector's bytes in one streaming store.
FP8_Q_STORE = {"bf16": ".E.EF.64", "fp16": ".E.EF.64", "fp32": ".E.EF"}


def check_norm_fp8_q(k: Kernel, twin: Optional[Kernel]) -> List[str]:
    """An fp8 q instantiation against its twin without fp8 q."""
    n = NORM_KERNEL.search(k.name)
    if not n or n["fp8"] != "1":
        return []
    body = _body(k)
    bad = []
    divisions = _divisions(k)
    twin_divisions = _divisions(twin) if twin else 0
    if divisions > twin_divisions:
        bad.append(f"{k.label}: {divisions} FCHK against {twin_divisions} without fp8 q: q's fp8 write divides "
                   "per element")
    if n["vec"] == "1":
        width = FP8_Q_STORE[TYPES[n["T"]]]
        store = re.compile(rf"\bSTG{re.escape(width)}\s")
        stores = sum(bool(store.search(t)) for _, t in body)
        if stores < NORM_VECTOR_ACCESSES:
            bad.append(f"{k.label}: {stores} STG{width} ({NORM_VECTOR_ACCESSES} wanted): the vector path must write "
                       "fp8 q a vector's bytes at a time")
    return bad


def check_norm(sass: str, res_usage: str = "") -> Tuple[int, List[str]]:
    """(prologue kernels checked, violations)."""
    kernels = kernels_of(sass, res_usage, NORM_KERNEL)
    by_name = {k.name: k for k in kernels}
    bad = [b for k in kernels for b in check_norm_kernel(k)]
    for k in kernels:
        n = NORM_KERNEL.search(k.name)
        twin = k.name[:n.start("fp8")] + "0" + k.name[n.end("fp8"):] if n else ""
        bad += check_norm_fp8_q(k, by_name.get(twin))
    return len(kernels), bad + ([] if kernels else ["no norm_rope_kernel instantiation in the listing"])
