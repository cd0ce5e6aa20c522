"""The SASS contract of the CUDA RoPE kernel, read from the sm_90 cubin with
cuobjdump (no GPU needed).

For every instantiation of rotary::kernel::rope_kernel:
- no local memory (LDL / STL) outside the subroutines it calls (the cold
  float64 sin/cos slow path that on-the-fly rows reach);
- no float32 division (FCHK, the IEEE division's range check) in its body:
  a thread steps from row to row without dividing, and the fused fp8 write
  multiplies by Fp8Scale's reciprocal (the kernels before it divided per
  element);
- registers leave room for at least --min-blocks resident blocks of
  --block-threads threads per SM (2 of 256: the kernel's launch bounds; at
  3, 80 registers, today's vector paths spill);
and for every vectorized one:
- q and k data move only as 128-bit accesses: every global store is 128-bit,
  and so is every streaming (.EF) load, of which there is at least one;
- the data loads of a row go out before its table read: walking back from
  each 128-bit table load (no .EF), a streaming data load comes before any
  store or the kernel's start;
- the next row's lines are asked of L2 with this row's loads: at least one
  L2 prefetch (CCTL.E.PF2), but in the float64 interleaved ones (at the
  register cap, they do not prefetch), and walking back from each, a
  streaming data load comes before any store or the kernel's start.

For every instantiation of rotary::kernel::rope_kv_kernel (the fused
KV-cache launch; the int32 ones also with copy blocks, which copy v beside
the rotation), the rope_kernel rules above, and:
- cache rows are written with one store per 16-byte vector of q/k data:
  128-bit for a cache of the data's dtype, 64-bit for an fp8 cache of 16-bit
  data, 32-bit for one of float32 data; nothing narrower or wider;
- the fp8-cache ones make at most FUSED_FP8_SPILL_BUDGET stack accesses
  (interleaved ones spill row and copy setup values today, up to 12
  accesses in the int64-index ones), a known gap; the others none.

For every instantiation of rotary::kernel::norm_rope_kernel (the prologue,
with and without the fp8 q output, and with the KV-cache write):
- no local memory outside the subroutines it calls, but for NORM_SPILL_BUDGET
  stack accesses (LDL/STL at [R1 + ...]), none today (the fp8 q ones made
  four to six before the loads were batched);
- registers leave room for at least 4 resident blocks of its 128 threads
  (3 for the vector instantiations, whose lanes hold two heads' items);
- the sum of squares goes NORM_BATCH loads at a time: at least two runs
  (the per-head and the across-heads norm) of NORM_BATCH square-sum FMAs
  with no load or branch between them, so the loads they sum were all
  issued before the first (one memory round trip per batch, not per
  element);
- the fp8 q ones divide no more often than their twins without it (as
  many FCHK: the norm's own divisions; the scale's reciprocal is taken once
  per head, Fp8Scale, not a division per element), and their vector
  instantiations write q as one streaming store per vector of the fp8 width
  (at least NORM_VECTOR_ACCESSES of STG.E.EF.64 for 16-bit data, STG.E.EF
  for float32);
- the vector instantiations (kVector; one per dtype and cache, and per
  dtype with fp8 q) ask L2 for the block's next row (at least one CCTL.E.PF2; but
  float32 with an fp8 cache, which spilled with it) and have a vector path: at least NORM_VECTOR_ACCESSES 16-byte
  streaming loads and stores of q/k, and every table read (16 bytes; with
  N-D positions, a pair's 8) shares its basic block with a q/k vector load
  (one round trip per head, not a table read that waits for a branch on the
  data or the data on it);
- the per-head sum of squares is reduced in registers: a warp butterfly of
  at least five SHFL.BFLY, no shared-memory round trip for it;
- with a cache, a block barrier beyond the norm's two (three BAR.SYNC): the
  cache write reads k back from the row's other warps (the host emulation
  runs that barrier too); after the last barrier the write loads a batch
  (2 x NORM_BATCH loads: k and v) before its first store, and the vector
  instantiations also hold the vector write: NORM_CACHE_BATCH 16-byte
  loads, then as many stores of the cache's chunk (16 bytes, or 8 / 4
  bytes of fp8 for 16- / 32-bit data).

For every copy of the subroutine kernel::reduced_angle (the exact angle of a
position past the table; found by its 1/(2*pi) constant, 0x3fc45f30...):
- exactly REDUCED_ANGLE_DFMA fused multiply-adds, its explicit fma calls:
  nvcc contracts a * b + c by default, and one more DFMA there counts a
  product's rounding error twice (the angle loses its phase past 2^40).

Usage: python tests/sass/contract.py OBJECT [--cuobjdump PATH]; exit status 1
on a violation, each printed. tests/python/test_sass_contract.py runs it on
the build's object and on listings made to break each rule.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

KERNEL = re.compile(r"rope_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<il>[01])ELb(?P<vec>[01])E(?P<idx>[il])E")
NORM_KERNEL = re.compile(
    r"norm_rope_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<fp8>[01])E(?P<cache>v|h|S\d*_|f|d)Lb(?P<vec>[01])EE")
FUSED_KERNEL = re.compile(
    r"rope_kv_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<il>[01])E(?P<cache>h|S2_|f|d)(?P<idx>[il])"
    r"Lb(?P<copy>[01])EE")
TYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32", "d": "fp64"}
FP8_CACHE_STORE = {"bf16": ".E.64", "fp16": ".E.64", "fp32": ".E"}  # one byte per element of 16 bytes
FUSED_FP8_SPILL_BUDGET = 16
# The vector instantiations hold kNormLaneHeads heads' items per lane (64
# bytes of bf16 in flight): 3 blocks of them keep more bytes in flight per
# SM than 4 of the element path's (benchmarks/launch_model.py).
NORM_BLOCK_THREADS, NORM_MIN_BLOCKS, NORM_VECTOR_MIN_BLOCKS = 128, 4, 3
INSTR = re.compile(r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<text>[^;]*);")
MEM = re.compile(r"^(?:@!?U?P\w+\s+)?(?P<op>LDG|STG|LDL|STL)(?P<mods>(?:\.[A-Z0-9_]+)*)\s")
PREFETCH = re.compile(r"^(?:@!?U?P\w+\s+)?CCTL(?:\.[A-Z0-9_]+)*\.PF2\s")
CALL = re.compile(r"\bCALL\.\w+(?:\.\w+)*\s+(?P<target>0x[0-9a-f]+)")
REG = re.compile(r"Function (?P<name>\S+):\s*\n\s*REG:(?P<regs>\d+)")

# sm_90: 64K registers and 64 warps per SM, registers allocated per warp in
# units of 256 (8 per thread).
SM_REGS, SM_WARPS, WARP_UNIT = 65536, 64, 256


@dataclass
class Kernel:
    name: str
    instrs: List[Tuple[int, str]]
    regs: Optional[int] = None

    @property
    def label(self) -> str:
        f = FUSED_KERNEL.search(self.name)
        if f:
            return (f"rope_kv_kernel<{TYPES[f['T']]}, {'interleaved' if f['il'] == '1' else 'half'}, "
                    f"{'fp8' if f['cache'] == 'h' else 'same-dtype'} cache, {'int32' if f['idx'] == 'i' else 'int64'}"
                    f"{', copy blocks' if f['copy'] == '1' else ''}>")
        n = NORM_KERNEL.search(self.name)
        if n:
            cache = {"v": ""}.get(n["cache"], ", fp8 cache" if n["cache"] == "h" else ", same-dtype cache")
            return (f"norm_rope_kernel<{TYPES[n['T']]}{', fp8 q' if n['fp8'] == '1' else ''}{cache}"
                    f"{', vector' if n['vec'] == '1' else ''}>")
        m = KERNEL.search(self.name)
        if not m:
            return self.name
        return (f"rope_kernel<{TYPES[m['T']]}, {'interleaved' if m['il'] == '1' else 'half'}, "
                f"{'vector' if m['vec'] == '1' else 'strided'}, {'int32' if m['idx'] == 'i' else 'int64'}>")

    @property
    def vectorized(self) -> bool:
        m = KERNEL.search(self.name)
        return bool(m) and m["vec"] == "1" or bool(FUSED_KERNEL.search(self.name))

    @property
    def prefetches(self) -> bool:
        """A vectorized instantiation that prefetches next rows (Tile::kPrefetch)."""
        m = KERNEL.search(self.name) or FUSED_KERNEL.search(self.name)
        return self.vectorized and not (m["T"] == "d" and m["il"] == "1")

    @property
    def cache_store(self) -> Optional[str]:
        """The modifiers of a fused kernel's cache stores (None: not fused)."""
        f = FUSED_KERNEL.search(self.name)
        if not f:
            return None
        return FP8_CACHE_STORE.get(TYPES[f["T"]], "?") if f["cache"] == "h" else ".E.128"


def parse_sass(text: str) -> Dict[str, Kernel]:
    kernels: Dict[str, Kernel] = {}
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        instrs = [(int(m["addr"], 16), " ".join(m["text"].split())) for m in INSTR.finditer(part)]
        kernels[name] = Kernel(name, instrs)
    return kernels


def parse_regs(text: str) -> Dict[str, int]:
    return {m["name"]: int(m["regs"]) for m in REG.finditer(text)}


def resident_blocks(regs: int, block_threads: int) -> int:
    warps = (block_threads + 31) // 32
    per_warp = -(-regs * 32 // WARP_UNIT) * WARP_UNIT
    return min(SM_REGS // (per_warp * warps), SM_WARPS // warps)


def _body(k: Kernel) -> List[Tuple[int, str]]:
    """The kernel's instructions before the first subroutine it calls."""
    targets = [int(m["target"], 16) for _, t in k.instrs for m in [CALL.search(t)] if m]
    body_end = min(targets) if targets else float("inf")
    return [(a, t) for a, t in k.instrs if a < body_end]


def _divisions(k: Kernel) -> int:
    """float32 divisions in the kernel's body: its FCHK range checks."""
    return sum("FCHK" in t for _, t in _body(k))


def _common(k: Kernel, mem, block_threads: int, min_blocks: int) -> List[str]:
    bad = [f"{k.label}: local memory outside the slow path at 0x{a:04x}: {t}"
           for a, t, op, _ in mem if op in ("LDL", "STL")]
    if k.regs is not None and resident_blocks(k.regs, block_threads) < min_blocks:
        bad.append(f"{k.label}: {k.regs} registers leave {resident_blocks(k.regs, block_threads)} resident blocks of "
                   f"{block_threads} threads per SM, fewer than {min_blocks}")
    return bad


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


def _spill_budget(mem, budget: int):
    """mem without its stack-frame LDL/STL when there are at most budget."""
    spills = [(a, t, op, mods) for a, t, op, mods in mem if op in ("LDL", "STL") and "[R1" in t]
    return [m for m in mem if m not in spills] if len(spills) <= budget else mem


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


def kernels_of(sass: str, res_usage: str = "", pattern: "re.Pattern[str]" = KERNEL) -> List[Kernel]:
    """The instantiations of a listing whose names match pattern (default:
    rope_kernel), with their registers."""
    regs = parse_regs(res_usage)
    kernels = [k for n, k in sorted(parse_sass(sass).items()) if pattern.search(n)]
    for k in kernels:
        k.regs = regs.get(k.name)
    return kernels


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


REDUCED_ANGLE_DFMA = 3
INV_TWO_PI = "0x3fc45f30"  # the high word of 1/(2*pi), only reduced_angle holds it
DFMA = re.compile(r"\bDFMA\b")


def check_reduced_angle(sass: str) -> Tuple[int, List[str]]:
    """(copies of reduced_angle checked, violations)."""
    copies, bad = 0, []
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        instrs = [(int(m["addr"], 16), " ".join(m["text"].split())) for m in INSTR.finditer(part)]
        targets = sorted({int(m["target"], 16) for _, t in instrs for m in [CALL.search(t)] if m})
        for addr in [a for a, t in instrs if INV_TWO_PI in t]:
            copies += 1
            start = max((x for x in targets if x <= addr), default=None)
            label = Kernel(name, []).label
            if start is None:
                bad.append(f"{label}: reduced_angle at 0x{addr:04x} is inlined, not a subroutine")
                continue
            end = next((a for a, t in instrs if a > addr and t.startswith("RET")), instrs[-1][0])
            n = sum(bool(DFMA.search(t)) for a, t in instrs if start <= a <= end)
            if n != REDUCED_ANGLE_DFMA:
                bad.append(f"{label}: reduced_angle at 0x{start:04x} has {n} DFMA, expected {REDUCED_ANGLE_DFMA} "
                           "(a contracted a * b + c breaks its error-free sums)")
    return copies, bad + ([] if copies else ["no reduced_angle in the listing"])


def find_cuobjdump() -> Optional[str]:
    """cuobjdump on PATH or in CUDA_HOME, else the one triton's wheel ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
    if os.path.exists(path):
        return path
    try:
        import triton  # noqa: F401  (torch's CUDA wheels depend on it)
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def dump(obj: str, cuobjdump: str, arch: str = "sm_90") -> Tuple[str, str]:
    """(SASS, resource usage) of obj's arch cubin. One listing of librotary
    takes about 13 s: a process lists each version of a file once."""
    st = os.stat(obj)
    return _dump(os.path.realpath(obj), st.st_mtime_ns, st.st_size, cuobjdump, arch)


@functools.lru_cache(maxsize=4)
def _dump(obj: str, mtime_ns: int, size: int, cuobjdump: str, arch: str) -> Tuple[str, str]:
    run = lambda *flags: subprocess.run([cuobjdump, *flags, "-arch", arch, obj], capture_output=True, text=True,
                                        check=True).stdout
    return run("-sass"), run("-res-usage")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", help="an object or library holding the sm_90 cubin (e.g. build/.../rope_cuda.cu.o)")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--block-threads", type=int, default=256)
    ap.add_argument("--min-blocks", type=int, default=2)
    args = ap.parse_args(argv)
    tool = args.cuobjdump or find_cuobjdump()
    if tool is None:
        print("no cuobjdump: install nvidia-cuda-cuobjdump from PyPI or put the CUDA toolkit's on PATH")
        return 2
    sass, res = dump(args.object, tool)
    n, bad = check(sass, res, args.block_threads, args.min_blocks)
    n_fused, bad_fused = check(sass, res, args.block_threads, args.min_blocks, FUSED_KERNEL)
    n_norm, bad_norm = check_norm(sass, res)
    n_angle, bad_angle = check_reduced_angle(sass)
    bad += bad_fused + bad_norm + bad_angle
    for line in bad:
        print(line)
    print(f"{n} rope_kernel, {n_fused} rope_kv_kernel and {n_norm} norm_rope_kernel instantiations, "
          f"{n_angle} copies of reduced_angle, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
