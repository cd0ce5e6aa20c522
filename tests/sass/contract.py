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
from typing import List, Optional, Sequence, Tuple

# The rules live beside this file, one module per kernel family; their names
# stay importable from here (test_sass_contract.py, benchmarks/launch_model.py).
from sass_listing import (CALL, FUSED_KERNEL, INSTR, KERNEL, NORM_KERNEL, Kernel, kernels_of,  # noqa: F401
                          resident_blocks)
from sass_norm_rules import NORM_BATCH, NORM_CACHE_BATCH, NORM_SPILL_BUDGET, check_norm  # noqa: F401
from sass_rope_rules import FUSED_FP8_SPILL_BUDGET, check  # noqa: F401


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
