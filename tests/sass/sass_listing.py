"""A cuobjdump listing as the SASS contract (contract.py) reads it: the
kernel instantiations by their mangled names (rope_kernel, rope_kv_kernel,
norm_rope_kernel) and their labels, their instructions and registers, the
resident blocks those registers leave per sm_90 SM, and the rules every
kernel keeps (no local memory outside the subroutines it calls, room for
enough resident blocks). Split from contract.py, which states the whole
contract."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

KERNEL = re.compile(r"rope_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<il>[01])ELb(?P<vec>[01])E(?P<idx>[il])E")
NORM_KERNEL = re.compile(
    r"norm_rope_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<fp8>[01])E(?P<cache>v|h|S\d*_|f|d)Lb(?P<vec>[01])EE")
FUSED_KERNEL = re.compile(
    r"rope_kv_kernelI(?P<T>13__nv_bfloat16|6__half|f|d)Lb(?P<il>[01])E(?P<cache>h|S2_|f|d)(?P<idx>[il])"
    r"Lb(?P<copy>[01])EE")
TYPES = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32", "d": "fp64"}
FP8_CACHE_STORE = {"bf16": ".E.64", "fp16": ".E.64", "fp32": ".E"}  # one byte per element of 16 bytes
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


def _spill_budget(mem, budget: int):
    """mem without its stack-frame LDL/STL when there are at most budget."""
    spills = [(a, t, op, mods) for a, t, op, mods in mem if op in ("LDL", "STL") and "[R1" in t]
    return [m for m in mem if m not in spills] if len(spills) <= budget else mem


def kernels_of(sass: str, res_usage: str = "", pattern: "re.Pattern[str]" = KERNEL) -> List[Kernel]:
    """The instantiations of a listing whose names match pattern (default:
    rope_kernel), with their registers."""
    regs = parse_regs(res_usage)
    kernels = [k for n, k in sorted(parse_sass(sass).items()) if pattern.search(n)]
    for k in kernels:
        k.regs = regs.get(k.name)
    return kernels
