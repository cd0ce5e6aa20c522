"""The SASS contract (tests/sass/contract.py) on the sm_90 cubin of the built
library, and on small listings made to break each rule, so that each rule
is seen to fail. No GPU needed: cuobjdump reads the cubin."""

import os
import sys

import pytest
import torch

import rotary

HERE = os.path.dirname(os.path.abspath(__file__))
# As benchmarks/launch_model.py imports it: one module, so one cached listing.
sys.path.insert(0, os.path.join(HERE, "..", "sass"))
import contract  # noqa: E402

BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("rotary::apply_rope", "CUDA")
HOT = "_ZN6rotary6kernel11rope_kernelI13__nv_bfloat16Lb1ELb1EiEEvNS0_10RopeParamsENS0_4GridE"
STRIDED = "_ZN6rotary6kernel11rope_kernelIfLb0ELb0ElEEvNS0_10RopeParamsENS0_4GridE"


def listing(name, *instrs):
    """A cuobjdump -sass listing of one function; instrs are SASS texts."""
    body = "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(instrs))
    return f"\n\tcode for sm_90\n\t\tFunction : {name}\n{body}\n"


def res(name, regs):
    return f" Function {name}:\n  REG:{regs} STACK:40 SHARED:0 LOCAL:0\n"


GOOD = [
    "LDG.E.EF.128 R4, desc[UR4][R2.64]",
    "LDG.E.EF.128 R8, desc[UR4][R6.64]",
    "CCTL.E.PF2 [R14]",  # the next row's line, with this row's loads
    "LDG.E.128.CONSTANT R12, desc[UR6][R10.64]",  # the table, after the data
    "FMUL R4, R4, R12",
    "STG.E.EF.128 desc[UR4][R2.64], R4",
    "STG.E.EF.128 desc[UR4][R6.64], R8",
    "EXIT",
]


def violations(sass, regs=80):
    n, bad = contract.check(sass, res(HOT, regs))
    assert n == 1
    return bad


def test_a_compliant_listing_passes():
    assert violations(listing(HOT, *GOOD)) == []


@pytest.mark.parametrize("case,edit,expect", [
    ("narrow store", lambda g: g[:5] + ["STG.E desc[UR4][R2.64], R4"] + g[6:], "a store narrower than 128 bits"),
    ("narrow data load", lambda g: ["LDG.E.EF.64 R4, desc[UR4][R2.64]"] + g[1:], "a data load narrower than 128"),
    ("table first", lambda g: [g[3], g[0], g[1], g[2]] + g[4:], "not preceded by a data load"),
    ("table after a store", lambda g: g[:3] + [g[5], g[3], g[4]] + g[6:], "not preceded by a data load"),
    ("no prefetch", lambda g: g[:2] + g[3:], "no L2 prefetch"),
    ("prefetch after a store", lambda g: g[:2] + g[3:6] + [g[2]] + g[6:], "not issued with a row's data loads"),
    ("prefetch first", lambda g: [g[2]] + g[:2] + g[3:], "not issued with a row's data loads (back to the kernel's"),
    ("no streaming", lambda g: [t.replace(".EF", "") for t in g], "no streaming (.EF) data load"),
    ("local memory", lambda g: ["STL.64 [R1], R4"] + g, "local memory outside the slow path"),
    ("a division", lambda g: g[:4] + ["FCHK P0, R4, R12"] + g[4:], "1 FCHK: a float32 division in the body"),
])
def test_each_rule_can_fail(case, edit, expect):
    bad = violations(listing(HOT, *edit(list(GOOD))))
    assert any(expect in b for b in bad), (case, bad)


def test_float64_interleaved_needs_no_prefetch():
    """At the register cap it does not prefetch; its half pairing must."""
    no_prefetch = [t for t in GOOD if not t.startswith("CCTL")]
    for name, want in ((HOT.replace("13__nv_bfloat16Lb1E", "dLb1E"), []),
                       (HOT.replace("13__nv_bfloat16Lb1E", "dLb0E"), ["no L2 prefetch"])):
        n, bad = contract.check(listing(name, *no_prefetch), res(name, 80))
        assert n == 1 and [w for w in want if any(w in b for b in bad)] == want and len(bad) == len(want), bad


def test_registers_for_the_resident_blocks():
    assert violations(listing(HOT, *GOOD), regs=128) == []
    bad = violations(listing(HOT, *GOOD), regs=136)
    assert bad == ["rope_kernel<bf16, interleaved, vector, int32>: 136 registers leave 1 resident blocks of 256 "
                   "threads per SM, fewer than 2"]
    n, bad = contract.check(listing(HOT, *GOOD), res(HOT, 88), min_blocks=3)
    assert bad == ["rope_kernel<bf16, interleaved, vector, int32>: 88 registers leave 2 resident blocks of 256 "
                   "threads per SM, fewer than 3"]
    assert contract.resident_blocks(118, 256) == 2 and contract.resident_blocks(80, 256) == 3
    assert contract.resident_blocks(64, 256) == 4


def test_local_memory_in_a_called_slow_path_is_allowed():
    sass = listing(STRIDED, "LDG.E R4, desc[UR4][R2.64]", "CALL.REL.NOINC 0x0040", "STG.E desc[UR4][R2.64], R4",
                   "EXIT", "STL.64 [R1], R4", "LDL.64 R4, [R1]", "RET.REL.NODEC R20 0x0")
    n, bad = contract.check(sass, res(STRIDED, 40))
    assert n == 1 and bad == []  # strided kernels may store element by element


@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="rotary was built without CUDA: no cubin to read")
def test_the_built_kernels_keep_the_contract():
    tool = contract.find_cuobjdump()
    assert tool, "no cuobjdump (the CUDA toolkit's, or the one in triton's wheel)"
    sass, usage = contract.dump(rotary.library_path(), tool)
    n, bad = contract.check(sass, usage)
    assert n == 32, f"{n} rope_kernel instantiations in the sm_90 cubin, expected 32"
    assert not bad, "\n".join(bad)


FUSED = ("_ZN6rotary6kernel14rope_kv_kernelI13__nv_bfloat16Lb0ES2_iLb0EEEvNS0_13KVCacheParamsENS0_4GridENS0_"
         "8CopyGridE")
FUSED_FP8 = FUSED.replace("Lb0ES2_iLb0E", "Lb0EhiLb0E")
FUSED_FP32_FP8 = FUSED.replace("13__nv_bfloat16Lb0ES2_iLb0E", "fLb1EhlLb0E")
FUSED_COPY_BLOCKS = FUSED.replace("S2_iLb0E", "S2_iLb1E")


def fused_listing(name, cache_store, before_store=()):
    """GOOD with the cache writes of the rotated k and of a v vector (and
    before_store ahead of the first)."""
    return listing(name, *(GOOD[:6] + list(before_store) + [
        f"{cache_store} desc[UR4][R20.64], R4", "LDG.E.EF.128 R8, desc[UR4][R22.64]",
        f"{cache_store} desc[UR4][R24.64], R8"] + GOOD[6:]))


@pytest.mark.parametrize("name,good,wrong", [
    (FUSED, "STG.E.128", "STG.E"),
    (FUSED_FP8, "STG.E.64", "STG.E.128"),
    (FUSED_FP32_FP8, "STG.E", "STG.E.U16"),
    (FUSED_COPY_BLOCKS, "STG.E.128", "STG.E"),
])
def test_each_fused_rule_can_fail(name, good, wrong):
    n, bad = contract.check(fused_listing(name, good), res(name, 120), pattern=contract.FUSED_KERNEL)
    assert n == 1 and bad == [], bad
    n, bad = contract.check(fused_listing(name, wrong), res(name, 120), pattern=contract.FUSED_KERNEL)
    assert len(bad) == 2 and all("a cache store" in b for b in bad), bad
    # The rope_kernel rules hold for it too.
    n, bad = contract.check(listing(name, GOOD[3], *GOOD[:3], *GOOD[4:]), res(name, 120), pattern=contract.FUSED_KERNEL)
    assert any("not preceded by a data load" in b for b in bad), bad
    n, bad = contract.check(listing(name, *GOOD), res(name, 136), pattern=contract.FUSED_KERNEL)
    assert any("fewer than 2" in b for b in bad), bad
    # The fp8 write divided per element before Fp8Scale: a division anywhere in the body is refused.
    divided = fused_listing(name, good, ["MUFU.RCP R7, R6", "FCHK P0, R4, R6", "@P0 BRA 0x2000"])
    n, bad = contract.check(divided, res(name, 120), pattern=contract.FUSED_KERNEL)
    assert bad == [f"{contract.Kernel(name, []).label}: 1 FCHK: a float32 division in the body (rows step without "
                   "dividing; the fp8 write multiplies by Fp8Scale's reciprocal)"], bad


def test_the_fused_fp8_spill_budget_is_a_bound():
    spills = [f"STL [R1+0x{4 * i:x}], R{i}" for i in range(contract.FUSED_FP8_SPILL_BUDGET)]
    for name, store in ((FUSED_FP8, "STG.E.64"), (FUSED, "STG.E.128")):
        n, bad = contract.check(listing(name, *(spills + GOOD[:6] + [f"{store} desc[UR4][R20.64], R4"] + GOOD[6:])),
                                res(name, 120), pattern=contract.FUSED_KERNEL)
        if name == FUSED_FP8:
            assert bad == [], bad
        else:  # the same-dtype kernels get no budget
            assert len(bad) == contract.FUSED_FP8_SPILL_BUDGET and "local memory" in bad[0], bad
    over = spills + ["LDL R9, [R1+0x40]"]
    n, bad = contract.check(listing(FUSED_FP8, *(over + GOOD)), res(FUSED_FP8, 120), pattern=contract.FUSED_KERNEL)
    assert len(bad) == contract.FUSED_FP8_SPILL_BUDGET + 1 and "local memory" in bad[0]


@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="rotary was built without CUDA: no cubin to read")
def test_the_built_fused_kernels_keep_the_contract():
    sass, usage = contract.dump(rotary.library_path(), contract.find_cuobjdump())
    n, bad = contract.check(sass, usage, pattern=contract.FUSED_KERNEL)
    # 4 dtypes x 2 pairings x (int32, int64, int32 with copy blocks) x (same-dtype, fp8) cache, less
    # float64 with fp8.
    assert n == 42, f"{n} rope_kv_kernel instantiations in the sm_90 cubin, expected 42"
    assert not bad, "\n".join(bad)


NORM = "_ZN6rotary6kernel16norm_rope_kernelI13__nv_bfloat16Lb0EvLb1EEEvNS0_13KVCacheParamsENS0_10NormParamsE"
# One batch of the sum of squares: its loads, then its square sums.
BATCH = ([f"LDG.E.U16 R{10 + i}, desc[UR4][R2.64+0x{2 * i:x}]" for i in range(contract.NORM_BATCH)]
         + [f"FFMA R4, R{10 + i}, R{10 + i}, R4" for i in range(contract.NORM_BATCH)])
# The vector path: a rotated item of half pairing (two q/k vectors, its
# table reads in the same block) and a pass-through item.
VECTOR = (["LDG.E.EF.128 R20, desc[UR8][R20.64]", "LDG.E.EF.128 R24, desc[UR8][R24.64]",
           "LDG.E.128.CONSTANT R40, desc[UR6][R2.64]", "LDG.E.128.CONSTANT R44, desc[UR6][R2.64+0x10]",
           "STG.E.EF.128 desc[UR8][R2.64], R68", "STG.E.EF.128 desc[UR8][R76.64], R4", "BRA 0x100",
           "LDG.E.EF.128 R28, desc[UR8][R28.64]", "STG.E.EF.128 desc[UR8][R6.64], R28", "BRA 0x200"])
NORM_GOOD = VECTOR + BATCH + BATCH + [f"SHFL.BFLY PT, R5, R4, {m}, 0x1f" for m in (16, 8, 4, 2, 1)] + [
    "CCTL.E.PF2 [R30]", "MUFU.RSQ R6, R5", "STG.E.U16 desc[UR4][R2.64], R6", "EXIT"]  # with the next row's prefetch


def unbatched(g):
    """Each square summed right after its own load."""
    loads, sums = [t for t in g if t.startswith("LDG")], [t for t in g if t.startswith("FFMA")]
    return [t for pair in zip(loads, sums) for t in pair] + [t for t in g if t not in loads and t not in sums]


@pytest.mark.parametrize("case,edit,expect", [
    ("compliant", lambda g: g, None),
    ("local memory", lambda g: ["STL.64 [R1], R4"] * 3 + g, "local memory outside the slow path"),
    ("no butterfly", lambda g: [t for t in g if "SHFL" not in t], "0 SHFL.BFLY"),
    ("a load per square", unbatched, "0 runs of"),
    ("one batched path", lambda g: g[:len(VECTOR)] + g[len(VECTOR) + len(BATCH):], "1 runs of"),
    ("no vector path", lambda g: [t for t in g if ".128" not in t], "0 16-byte streaming loads and 0 stores"),
    ("narrow q/k stores", lambda g: [t.replace("STG.E.EF.128", "STG.E.U16") for t in g], "3 16-byte streaming loads "
     "and 0 stores"),
    ("table read after a branch on the data", lambda g: g[:2] + ["@P0 BRA 0x80"] + g[2:], "no q/k vector load in its "
     "block"),
    # N-D positions: a pair's 8-byte read from its axis's row, in the data's block or after a branch.
    ("N-D pair reads", lambda g: g[:2] + ["LDG.E.64.CONSTANT R40, desc[UR6][R2.64]"] * 2 + g[4:], None),
    ("N-D pair read after a branch on the data",
     lambda g: g[:2] + ["@P0 BRA 0x80", "LDG.E.64.CONSTANT R40, desc[UR6][R2.64]"] + g[4:],
     "no q/k vector load in its block"),
    ("no prefetch", lambda g: [t for t in g if not t.startswith("CCTL")], "no L2 prefetch"),
])
def test_each_norm_rule_can_fail(case, edit, expect):
    n, bad = contract.check_norm(listing(NORM, *edit(list(NORM_GOOD))), res(NORM, 72))
    assert n == 1
    assert (bad == []) if expect is None else any(expect in b for b in bad), (case, bad)
    n, bad = contract.check_norm(listing(NORM, *NORM_GOOD), res(NORM, 176))
    assert bad == ["norm_rope_kernel<bf16, vector>: 176 registers leave 2 resident blocks of 128 threads per SM, "
                   "fewer than 3"]
    element = NORM.replace("Lb1EE", "Lb0EE")
    n, bad = contract.check_norm(listing(element, *NORM_GOOD[len(VECTOR):]), res(element, 136))
    assert bad == ["norm_rope_kernel<bf16>: 136 registers leave 3 resident blocks of 128 threads per SM, fewer than 4"]


def test_the_element_path_instantiations_have_no_vector_path_to_check():
    for name in (NORM.replace("Lb0EvLb1E", "Lb1EvLb0E"), NORM.replace("Lb1EE", "Lb0EE")):  # fp8 q; element path
        n, bad = contract.check_norm(listing(name, *NORM_GOOD[len(VECTOR):]), res(name, 72))
        assert n == 1 and bad == [], (name, bad)


# The fp8 q vector path: k's vectors as before, q's as one 8-byte store each.
FP8_Q = NORM.replace("Lb0EvLb1E", "Lb1EvLb1E")
FP8_Q_ELEMENT = NORM.replace("Lb0EvLb1E", "Lb1EvLb0E")
FP8_Q_GOOD = [t.replace("BRA 0x200", "STG.E.EF.64 desc[UR8][R8.64], R30") for t in NORM_GOOD] + [
    "STG.E.EF.64 desc[UR8][R10.64], R32", "STG.E.EF.64 desc[UR8][R12.64], R34"]


def two(name, body, twin_body):
    """A listing of name and of its twin without fp8 q."""
    twin = name.replace("Lb1E", "Lb0E", 1)
    return listing(name, *body) + listing(twin, *twin_body), res(name, 72) + res(twin, 72)


@pytest.mark.parametrize("case,name,body,expect", [
    ("compliant vector", FP8_Q, FP8_Q_GOOD, None),
    ("compliant element", FP8_Q_ELEMENT, NORM_GOOD[len(VECTOR):], None),
    ("a division per element", FP8_Q, ["FCHK P0, R4, R5"] + FP8_Q_GOOD, "1 FCHK against 0 without fp8 q"),
    ("a division per element, element path", FP8_Q_ELEMENT,
     ["FCHK P0, R4, R5"] + NORM_GOOD[len(VECTOR):], "1 FCHK against 0 without fp8 q"),
    ("fp8 q a byte at a time", FP8_Q, [t.replace("STG.E.EF.64", "STG.E.U8") for t in FP8_Q_GOOD],
     "0 STG.E.EF.64 (3 wanted)"),
])
def test_each_fp8_q_rule_can_fail(case, name, body, expect):
    twin_body = NORM_GOOD if "Lb1EE" in name else NORM_GOOD[len(VECTOR):]
    n, bad = contract.check_norm(*two(name, body, twin_body))
    assert n == 2
    assert (bad == []) if expect is None else (len(bad) == 1 and expect in bad[0]), (case, bad)
    if expect is None:  # the twin's own divisions (the norm's) are allowed as many times
        n, bad = contract.check_norm(*two(name, ["FCHK P0, R4, R5"] + body, ["FCHK P0, R4, R5"] + twin_body))
        assert bad == [], (case, bad)


# The cache write of one batch: k and v loads, then their cache stores.
CACHE_BATCH = ([f"LDG.E.U16 R{20 + i}, desc[UR4][R6.64+0x{2 * i:x}]" for i in range(2 * contract.NORM_BATCH)]
               + [f"STG.E.U16 desc[UR4][R8.64+0x{2 * i:x}], R{20 + i}" for i in range(2 * contract.NORM_BATCH)])


ELEMENT = NORM.replace("Lb1EE", "Lb0EE")  # the element path's instantiation


def test_a_cache_instantiation_needs_the_barrier_before_its_cache_write():
    cached = ELEMENT.replace("Lb0EvL", "Lb0EhL")
    bars = ["BAR.SYNC.DEFER_BLOCKING 0x0"] * 2
    body = NORM_GOOD[:-1]  # without its EXIT
    n, bad = contract.check_norm(listing(cached, *(bars + body + CACHE_BATCH + ["EXIT"])), res(cached, 72))
    assert bad == ["norm_rope_kernel<bf16, fp8 cache>: 2 BAR.SYNC: the cache write must wait at a block barrier "
                   "for the row's k"]
    n, bad = contract.check_norm(listing(cached, *(bars + body + bars[:1] + CACHE_BATCH + ["EXIT"])), res(cached, 72))
    assert bad == []
    n, bad = contract.check_norm(listing(NORM, *(bars + NORM_GOOD)), res(NORM, 72))
    assert bad == []  # no cache: the norm's two are enough


def test_the_cache_write_loads_a_batch_before_it_stores():
    cached = ELEMENT.replace("Lb0EvL", "Lb0ES2_L")
    bars = ["BAR.SYNC.DEFER_BLOCKING 0x0"] * 3
    loads, stores = CACHE_BATCH[:2 * contract.NORM_BATCH], CACHE_BATCH[2 * contract.NORM_BATCH:]
    one_by_one = [t for pair in zip(loads, stores) for t in pair]  # each element stored as it arrives
    n, bad = contract.check_norm(listing(cached, *(bars[:2] + NORM_GOOD[:-1] + bars[:1] + one_by_one + ["EXIT"])),
                                 res(cached, 72))
    assert bad == ["norm_rope_kernel<bf16, same-dtype cache>: 1 loads before the cache write's first store (16 "
                   "wanted): the write must load a batch of k and v before it stores one"], bad


def vector_cache(store):
    """The vector cache write of one batch: 16-byte loads of k and v, then their chunk stores."""
    n = contract.NORM_CACHE_BATCH
    return ([f"LDG.E.EF.128 R{40 + 4 * i}, desc[UR8][R10.64+0x{16 * i:x}]" for i in range(n)]
            + [f"{store} desc[UR4][R12.64+0x{16 * i:x}], R{40 + 4 * i}" for i in range(n)])


@pytest.mark.parametrize("cache,store", [("S2_", "STG.E.128"), ("h", "STG.E.64")])
def test_a_vector_instantiation_writes_the_cache_as_vectors(cache, store):
    cached = NORM.replace("Lb0EvL", f"Lb0E{cache}L")
    bars = ["BAR.SYNC.DEFER_BLOCKING 0x0"] * 3
    head = bars[:2] + NORM_GOOD[:-1] + bars[:1] + CACHE_BATCH
    n, bad = contract.check_norm(listing(cached, *(head + vector_cache(store) + ["EXIT"])), res(cached, 72))
    assert bad == [], bad
    for broken in ([t.replace(".128", "") for t in vector_cache(store)],  # narrow loads
                   [t.replace(store, "STG.E.U16") for t in vector_cache(store)],  # element stores
                   [t for pair in zip(vector_cache(store)[:contract.NORM_CACHE_BATCH],
                                      vector_cache(store)[contract.NORM_CACHE_BATCH:]) for t in pair]):  # one by one
        n, bad = contract.check_norm(listing(cached, *(head + broken + ["EXIT"])), res(cached, 72))
        assert len(bad) == 1 and "the vector cache write must move whole vectors" in bad[0], bad


def test_the_prologue_spill_budget_is_a_bound():
    spills = [f"STL [R1+0x{4 * i:x}], R{i}" for i in range(contract.NORM_SPILL_BUDGET)]
    n, bad = contract.check_norm(listing(NORM, *(spills + NORM_GOOD)), res(NORM, 72))
    assert bad == []
    n, bad = contract.check_norm(listing(NORM, *(spills + ["LDL R9, [R1+0x40]"] + NORM_GOOD)), res(NORM, 72))
    assert len(bad) == contract.NORM_SPILL_BUDGET + 1 and "local memory" in bad[0]  # past it, every one counts
    n, bad = contract.check_norm(listing(NORM, *(["LDL R9, [R2]"] + NORM_GOOD)), res(NORM, 72))
    assert bad and "local memory" in bad[0]  # the budget is for stack-frame spills only


@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="rotary was built without CUDA: no cubin to read")
def test_the_built_prologue_kernels_keep_the_contract():
    sass, usage = contract.dump(rotary.library_path(), contract.find_cuobjdump())
    n, bad = contract.check_norm(sass, usage)
    # 4 dtypes x (fp8 q, plain, same-dtype cache, fp8 cache), and each with the vector path for all but fp64.
    assert n == 28, f"{n} norm_rope_kernel instantiations in the sm_90 cubin, expected 28"
    assert not bad, "\n".join(bad)


def angle_listing(*subroutine):
    """A kernel calling a reduced_angle subroutine made of `subroutine`."""
    return listing(HOT, "CALL.REL.NOINC 0x0020", "EXIT", *subroutine)


ANGLE_GOOD = ["DMUL R4, R2, R6", "DFMA R8, R2, R6, -R4", "DFMA R10, R2, R6, -R4", "DMUL R12, R4, 0x3fc45f30",
              "FRND.F64 R12, R12", "DFMA R14, R12, R16, -R18", "DADD R4, R4, -R18", "RET.REL.NODEC R20 0x0"]


def test_reduced_angle_rule_can_fail():
    assert contract.check_reduced_angle(angle_listing(*ANGLE_GOOD)) == (1, [])
    fused = ANGLE_GOOD[:6] + ["DFMA R4, -R12, R16, R4"] + ANGLE_GOOD[7:]  # sum - k * kTurn1, contracted
    n, bad = contract.check_reduced_angle(angle_listing(*fused))
    assert n == 1 and len(bad) == 1 and "has 4 DFMA, expected 3" in bad[0]
    n, bad = contract.check_reduced_angle(listing(HOT, *ANGLE_GOOD))  # no CALL: inlined
    assert "is inlined, not a subroutine" in bad[0]


@pytest.mark.skipif(not BUILT_WITH_CUDA, reason="rotary was built without CUDA: no cubin to read")
def test_the_built_reduced_angle_rounds_every_step():
    sass, _ = contract.dump(rotary.library_path(), contract.find_cuobjdump())
    n, bad = contract.check_reduced_angle(sass)
    assert n >= 85 and not bad, "\n".join(bad)
