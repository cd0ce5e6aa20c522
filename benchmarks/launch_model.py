"""Launch model of the CUDA RoPE kernel on an H200, printed without a GPU.

For each CUDA case of bench.py (contiguous BHSD, out of place), both
pairings, bf16 and fp32, it prints the launch the op makes (rotary._C.
_cuda_launch_shape: the same prepare_rope and make_grid as the op), the
registers of that instantiation (read from the sm_90 cubin of librotary),
resident blocks and warps per SM, q/k bytes in flight per SM per memory
round trip, and a predicted time / clone:

- a row costs one round trip (its data loads go out before the table
  read; tests/sass/contract.py checks that in SASS), so bytes in flight =
  resident threads x load bytes per thread; a launch that prefetches
  (l2_prefetch: a vector path whose grid strides) also has each thread's
  next row in flight, twice the bytes; the column "without prefetch" is
  the same launch with the switch off (rotary._C._cuda_set_l2_prefetch),
  what the H200 measured on 2026-12-04 but for the even grid;
- bandwidth is min(1, in flight / need) of the copy's, and the last partial
  pass of the grid-stride loop runs with fewer blocks in flight. need is
  fitted to that measurement (MEASURED: BHSD, out of place, time / clone):
  54-74 KB per SM, two to three times the textbook 20-34 KB (shared/GPU.md), as
  a round trip under full load takes about 2.5 us;
- our bytes are the copy's plus one read of the table rows used.

The decode step with a KV cache (apply_rope_with_kv_cache_, the decode
case's shapes, bf16, contiguous and paged caches, same-dtype and fp8, both
pairings) is latency-bound, not bandwidth-bound: its GPU time is modelled
as launches x LAUNCH_US plus dependent memory round trips x TRIP_US. The
fused launch (rotary._C._cuda_kv_launch says whether the call gets it, its
grid and the round trips of a row's busiest thread) is one launch: when its
rows fit in one wave, copy blocks copy v beside the rotation (the trips of
the slower of the two), else the rope rows copy after their rotation (the
sum; the H200's 5.0 us decode, half pairing, had 1 + 2). The two launches
have the RoPE kernel's one and the element-wise cache kernel's three (slot,
then k, then v after the k store). A second prediction fits the trip to
that 5.0 us (DECODE_MEASURED_US), as NEED_KB is fitted for prefill; neither
counts the fp8 encoding's instructions (the H200's fp8-cache launch took
2.7x the bf16 one under Nsight Compute).

The prologue (apply_qk_norm_rope, bench_qk_norm.py's CUDA shapes) has two
paths (rotary._C._cuda_norm_launch says which a call takes). The vector
path (aligned rows): a lane loads its item of two heads
(vector_lane_heads), two 16-byte vectors each, and their shared table
reads in one trip, and keeps them for phase 2 (the weights: one on-chip
trip; norm "heads" loads them again after the block's sums: one more);
its bytes in flight per SM are warps x 32 lanes x the share of lanes with an
item x the item's bytes, plus, when the blocks stride over rows
(l2_prefetch), each resident block's next row, which it asks of L2. The
element path (fp64, strided or unaligned rows): a thread has `batch` loads of its phase-1 elements in
flight, then re-reads its pairs from L1 and reads their table entries
(phase 2), one dependent on-chip trip per item; warps x 32 lanes x batch x
element bytes in flight. Either is weighted by the share of a warp's time
spent waiting on DRAM (trips x TRIP_US against on-chip trips x ONCHIP_US);
prefill is predicted as need / that, and decode (one row per block, a
warp's heads in turn) as a launch plus its warps' dependent trips; with a
cache, plus the write's trips for v (batch elements of k and v loaded per
trip). The last column is the element path for the same call.

Every kernel change states its predicted effect here before a device
confirms it (benchmarks/gpu_check.sh times the same cases).

Usage: PYTHONPATH=python python benchmarks/launch_model.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

import rotary

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "sass"))
from bench import CUDA_CASES  # noqa: E402
from bench_qk_norm import CUDA_SHAPES as PROLOGUE_SHAPES  # noqa: E402
import contract  # noqa: E402

SMS, MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM = 132, 32, 2048
NEED_KB = (54.0, 74.0)  # bytes in flight per SM for the copy's bandwidth, fitted to MEASURED
# The prologue's model keeps the textbook line: it counts only the share of a
# warp's time spent waiting on DRAM, and on the one H200 figure (bf16 prefill,
# 2.04x the copy floor) it is optimistic (1.1-1.9), not refitted.
PROLOGUE_NEED_KB = (20.0, 34.0)
# The H200's time / clone of the kernel without prefetch (docs/performance/gpu.md,
# 2026-12-04, BHSD out of place), by (case, dtype, pairing): the fit's data.
MEASURED = {("prefill", "bf16", "interleaved"): 1.09, ("prefill", "bf16", "half"): 1.08,
            ("training", "bf16", "interleaved"): 1.06, ("training", "bf16", "half"): 1.12,
            ("prefill", "fp32", "interleaved"): 1.08, ("prefill", "fp32", "half"): 1.11,
            ("training", "fp32", "interleaved"): 1.07, ("training", "fp32", "half"): 1.11,
            ("long", "fp32", "interleaved"): 1.08, ("long", "fp32", "half"): 1.17}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAUNCH_US = (1.5, 2.0)  # one small kernel on a stream: launch, ramp and drain
TRIP_US = (0.5, 0.8)    # one dependent DRAM round trip at low occupancy
# The H200's fused decode step (2026-12-04: bf16, half pairing, paged NHD,
# the rope rows copying v after their rotation) and FlashInfer's, in us. A
# trip fitted to it: (DECODE_MEASURED_US - LAUNCH_US) / that launch's trips.
DECODE_MEASURED_US, DECODE_FLASHINFER_US = 5.0, 3.0
ONCHIP_US = (0.15, 0.3)  # one dependent L1 / L2 hit (the prologue's phase 2)


def predicted(rows_total, row_blocks, grid, inflight_kb, data_bytes, table_bytes, need_kb):
    """time / clone: passes of the grid at full occupancy, then the last
    partial one, each at min(1, in flight / need) of the copy's bandwidth."""
    full, rest = divmod(row_blocks, grid)
    frac_full = min(1.0, inflight_kb / need_kb)
    frac_tail = min(1.0, inflight_kb * (rest / grid) / need_kb) if rest else 1.0
    per_pass = grid / row_blocks  # share of the bytes one full pass moves
    t = full * per_pass / frac_full + (rest / row_blocks) / frac_tail
    return t * (data_bytes + table_bytes) / data_bytes


def cubin_regs(pattern=contract.KERNEL):
    """Registers of each instantiation in librotary's sm_90 cubin, by label."""
    tool = contract.find_cuobjdump()
    if tool is None:
        raise SystemExit("no cuobjdump: install nvidia-cuda-cuobjdump or the CUDA toolkit")
    sass, usage = contract.dump(rotary.library_path(), tool)
    return {k.label: k.regs for k in contract.kernels_of(sass, usage, pattern)}


def model_rows():
    regs = cubin_regs()
    for case in (c for c in CUDA_CASES if not c.decode):
        for dname, dtype in DTYPES.items():
            for interleaved in (True, False):
                q = torch.empty(case.q_shape, dtype=dtype)  # never touched: no pages mapped
                k = torch.empty(case.k_shape, dtype=dtype)
                freqs = rotary.freqs_table(case.q_shape[-1], case.q_shape[2])
                s = rotary._C._cuda_launch_shape(q, k, freqs, interleaved, False)
                if not s:
                    raise SystemExit("librotary was built without CUDA kernels: nothing to model")
                label = (f"rope_kernel<{dname}, {'interleaved' if interleaved else 'half'}, "
                         f"{'vector' if s['vectorized'] else 'strided'}, {'int32' if s['int32'] else 'int64'}>")
                r = regs[label]
                bt = s["block_threads"]
                bps = min(contract.resident_blocks(r, bt), MAX_BLOCKS_PER_SM, MAX_THREADS_PER_SM // bt)
                grid = rotary._C._cuda_launch_shape(q, k, freqs, interleaved, False, SMS * bps)["blocks"]
                per_sm = min(bps, math.ceil(grid / SMS))
                warps = per_sm * math.ceil(bt / 32)
                row_kb = per_sm * bt * s["load_bytes"] / 1024  # one row per thread
                prefetch = bool(s["l2_prefetch"]) and s["row_blocks"] > grid
                inflight_kb = row_kb * (2 if prefetch else 1)
                data = 2 * (q.numel() + k.numel()) * q.element_size()
                table = case.q_shape[2] * freqs.shape[1] * 8  # one read of the complex64 rows used
                now = [predicted(s["rows"], s["row_blocks"], grid, inflight_kb, data, table, n) for n in NEED_KB]
                without = [predicted(s["rows"], s["row_blocks"], grid, row_kb, data, table, n) for n in NEED_KB]
                pairing = "interleaved" if interleaved else "half"
                yield dict(case=case.name, dtype=dname, pairing=pairing, label=label, regs=r, grid=grid, block=bt,
                           blocks_per_sm=per_sm, warps=warps, prefetch=prefetch, inflight_kb=inflight_kb, now=now,
                           without=without, measured=MEASURED.get((case.name, dname, pairing)))


def measured_decode_trips():
    """Round trips of the launch the H200 measured at DECODE_MEASURED_US:
    bench_kv_cache.py's decode step (B=64, 32/8 heads, D=128, bf16, half
    pairing, paged NHD blocks of 16), its rope rows copying v."""
    q = torch.empty(64, 32, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(64, 8, 1, 128, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.empty(64 * 8, 16, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(64).reshape(64, 1) * 128 + 100
    s = rotary._C._cuda_kv_launch(q, k, v, kc, vc, rotary.freqs_table(128, 128), 100, slots, "NHD", 0, False)
    return s["rope_trips"] + s["row_copy_trips"]


def decode_rows():
    """The decode step with a KV cache: launches, grid and predicted GPU time."""
    regs = cubin_regs(contract.FUSED_KERNEL)
    fit = [(DECODE_MEASURED_US - l) / measured_decode_trips() for l in LAUNCH_US]  # us per trip
    for case in (c for c in CUDA_CASES if c.decode):
        B, Hq, _, D = case.q_shape
        Hk = case.k_shape[1]
        for kv_layout in ("BHSD", "NHD"):
            for cache in ("bf16", "fp8"):
                for interleaved in (False, True):
                    cdt = torch.bfloat16 if cache == "bf16" else torch.float8_e4m3fn
                    q = torch.empty(case.q_shape, dtype=torch.bfloat16)
                    k = torch.empty(case.k_shape, dtype=torch.bfloat16)
                    v = torch.empty(case.k_shape, dtype=torch.bfloat16)
                    if kv_layout == "BHSD":
                        shape, slots = (B, Hk, 64, D), None
                    else:
                        shape, slots = (B * 4, 16, Hk, D), torch.arange(B, dtype=torch.int64).reshape(B, 1) * 64
                    kc, vc = torch.empty(shape, dtype=cdt), torch.empty(shape, dtype=cdt)
                    freqs = rotary.freqs_table(D, 64)
                    s = rotary._C._cuda_kv_launch(q, k, v, kc, vc, freqs, 7, slots, kv_layout, 0, interleaved)
                    if not s:
                        raise SystemExit("librotary was built without CUDA kernels: nothing to model")
                    pairing = "interleaved" if interleaved else "half"
                    copy_blocks, trips = 0, 1 + 3
                    rows_trips = trips
                    if s["fused"]:
                        label = (f"rope_kv_kernel<bf16, {pairing}, {'fp8' if cache == 'fp8' else 'same-dtype'} "
                                 f"cache, {'int32' if s['int32'] else 'int64'}>")
                        bps = min(contract.resident_blocks(regs[label], s["block_threads"]), MAX_BLOCKS_PER_SM)
                        s = rotary._C._cuda_kv_launch(q, k, v, kc, vc, freqs, 7, slots, kv_layout, SMS * bps,
                                                      interleaved)
                        copy_blocks = s["copy_blocks"]
                        # Copy blocks run beside the rotation; else the rows copy after it.
                        rows_trips = s["rope_trips"] + s["row_copy_trips"]
                        trips = max(s["rope_trips"], s["copy_block_trips"]) if copy_blocks else rows_trips
                    us = [s["launches"] * l + trips * t for l, t in zip(LAUNCH_US, TRIP_US)]
                    rows_us = [s["launches"] * l + rows_trips * t for l, t in zip(LAUNCH_US, TRIP_US)]
                    fitted_us = [s["launches"] * l + trips * t for l, t in zip(LAUNCH_US, fit)]
                    rows_fitted_us = [s["launches"] * l + rows_trips * t for l, t in zip(LAUNCH_US, fit)]
                    unfused = [2 * l + 4 * t for l, t in zip(LAUNCH_US, TRIP_US)]
                    yield dict(case=case.name, kv_layout=kv_layout, cache=cache, pairing=pairing,
                               fused=bool(s["fused"]), launches=s["launches"], grid=s["row_blocks"],
                               copy_blocks=copy_blocks, block=s["block_threads"], trips=trips, us=us,
                               rows_trips=rows_trips, rows_us=rows_us, fitted_us=fitted_us,
                               rows_fitted_us=rows_fitted_us,
                               ratio=[a / b for a, b in zip(us, unfused)])


def prologue_rows():
    """The prologue: per shape, dtype and norm (for norm "head", per pairing;
    at decode, also with a same-dtype cache and with q written as fp8), the launch, the bytes in flight,
    and prefill time / copy floor or decode GPU time, for the kernel as built
    ("now": the vector path where the launch takes it) and the element path
    ("before": what every call ran before the vector path)."""
    regs = cubin_regs(contract.NORM_KERNEL)
    for name, B, S, Hq, Hk, D in PROLOGUE_SHAPES:
        for dname, dtype in DTYPES.items():
            cases = [("head", True, ""), ("head", False, ""), ("heads", True, "")]
            decode = [("head", False, "cache"), ("head", False, "fp8 q")] if name == "decode" else []
            for norm, interleaved, extra in cases + decode:
                cache, fp8_q = extra == "cache", extra == "fp8 q"
                q, k = torch.empty(B, Hq, S, D, dtype=dtype), torch.empty(B, Hk, S, D, dtype=dtype)
                s = rotary._C._cuda_norm_launch(q, k, rotary.freqs_table(D, S), norm, SMS, interleaved,
                                                q_fp8_scale=torch.tensor(0.05) if fp8_q else None)
                if not s:
                    raise SystemExit("librotary was built without CUDA kernels: nothing to model")
                bt = s["block_threads"]
                cache_elems = math.ceil(Hk * D / bt)  # a thread's k and v elements of the row
                out = dict(case=name + (", " + extra if extra else ""), dtype=dname, norm=norm,
                           pairing="interleaved" if interleaved else "rotate_half", grid=s["blocks"], block=bt,
                           vector=s["vector_items"] > 0)
                for key in ("now", "before"):
                    vector = key == "now" and out["vector"]
                    suffix = ((", fp8 q" if fp8_q else "") + (", same-dtype cache" if cache else "")
                              + (", vector" if vector else ""))
                    r = regs[f"norm_rope_kernel<{dname}{suffix}>"]  # each path's own instantiation
                    per_sm = min(contract.resident_blocks(r, bt), MAX_BLOCKS_PER_SM, math.ceil(s["blocks"] / SMS))
                    warps = per_sm * bt // 32
                    if key == "now":
                        out.update(regs=r, blocks_per_sm=per_sm, warps=warps)
                    if vector:
                        # A lane's item of vector_lane_heads heads (two vectors each) and their shared
                        # table reads in one trip; a warp steps over 32 / lanes x that many heads at a
                        # time. Phase 2: the weights, one on-chip trip; norm "heads" loads the items
                        # again after the block's sums, from L1 or L2: one more.
                        lanes = s["vector_lanes"]
                        lane_bytes = 32 * s["vector_lane_heads"]  # a rotated item: two 16-byte vectors a head
                        kb = warps * 32 * (s["vector_items"] / lanes) * lane_bytes / 1024
                        trips, items = 1, 2 if norm == "heads" else 1
                        units = math.ceil((Hq + Hk) / (bt // 32 * (32 // lanes) * s["vector_lane_heads"]))
                    else:
                        # Element path: a unit is one head for a warp ("head"), or q's heads for the
                        # block ("heads"); `batch` loads per trip, phase 2 re-reads pairs on chip.
                        unit_threads, unit = (32, D) if norm == "head" else (bt, Hq * D)
                        per_thread = math.ceil(unit / unit_threads)
                        b = min(s["batch"], per_thread)
                        trips = math.ceil(per_thread / b)
                        items = math.ceil(unit // 2 / unit_threads)  # phase 2: pairs (the whole head rotates)
                        kb = warps * 32 * b * q.element_size() / 1024
                        units = math.ceil((Hq + Hk) / (bt // 32)) if norm == "head" else 2
                    if vector and s["l2_prefetch"]:  # each block's next row, asked of L2 (no register holds it)
                        kb += per_sm * (Hq + Hk) * D * q.element_size() / 1024
                    duty = [trips * d / (trips * d + items * o) for d, o in zip(TRIP_US, ONCHIP_US)]
                    if name == "decode":  # latency: a launch, a block's units in turn, then its cache write
                        per_unit = [trips * d + items * o for d, o in zip(TRIP_US, ONCHIP_US)]
                        write = math.ceil(cache_elems / min(s["batch"], cache_elems)) if cache else 0  # v from DRAM
                        out[key] = [l + units * u + write * d for l, u, d in zip(LAUNCH_US, per_unit, TRIP_US)]
                    else:  # bandwidth: Little's law on the bytes in flight while waiting on DRAM
                        need = PROLOGUE_NEED_KB
                        out[key] = [max(1.0, need[0] / (kb * max(duty))), max(1.0, need[1] / (kb * min(duty)))]
                    out[key + "_kb"] = kb
                yield out


def main() -> int:
    print("| case | dtype | pairing | instantiation | regs | grid x block | blocks / warps per SM | L2 prefetch | "
          "KB in flight per SM | predicted / clone | without prefetch | H200, without prefetch |")
    print("|---|---|---|---|--:|--:|--:|---|--:|--:|--:|--:|")
    for m in model_rows():
        lo, hi = sorted(m["now"])
        lo2, hi2 = sorted(m["without"])
        measured = f"{m['measured']:.2f}" if m["measured"] else "owed"
        print(f"| {m['case']} | {m['dtype']} | {m['pairing']} | `{m['label']}` | {m['regs']} | "
              f"{m['grid']} x {m['block']} | {m['blocks_per_sm']} / {m['warps']} | "
              f"{'next row' if m['prefetch'] else 'none'} | {m['inflight_kb']:.0f} | "
              f"{lo:.2f}-{hi:.2f} | {lo2:.2f}-{hi2:.2f} | {measured} |")
    print(f"\nH200: {SMS} SMs; {NEED_KB[0]:.0f}-{NEED_KB[1]:.0f} KB in flight per SM give the copy's bandwidth "
          "(the 1.00 line), fitted to the last column. A model, not a measurement: docs/performance/gpu.md has the "
          "H200's figures.")
    print("\n| decode step | cache | pairing | fused | launches | row blocks + copy blocks x block | "
          "dependent round trips | predicted GPU time | / two launches | trips fitted to the H200 | "
          "rows copying: trips, GPU time, fitted |")
    print("|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for m in decode_rows():
        print(f"| {m['case']} {m['kv_layout']} | {m['cache']} | {m['pairing']} | {'yes' if m['fused'] else 'no'} | "
              f"{m['launches']} | {m['grid']} + {m['copy_blocks']} x {m['block']} | {m['trips']} | "
              f"{m['us'][0]:.1f}-{m['us'][1]:.1f} us | {m['ratio'][0]:.2f}-{m['ratio'][1]:.2f} | "
              f"{m['fitted_us'][0]:.1f}-{m['fitted_us'][1]:.1f} us | {m['rows_trips']}, "
              f"{m['rows_us'][0]:.1f}-{m['rows_us'][1]:.1f} us, {m['rows_fitted_us'][0]:.1f}-"
              f"{m['rows_fitted_us'][1]:.1f} us |")
    print(f"\n{LAUNCH_US[0]}-{LAUNCH_US[1]} us per launch, {TRIP_US[0]}-{TRIP_US[1]} us per dependent round trip: "
          "a model of a latency-bound step; docs/performance/fused.md has the H200's decode rows. \"Fitted\": trips of "
          f"(DECODE_MEASURED_US - launch) / its trips, which gives the H200's {DECODE_MEASURED_US} us for the "
          "launch it ran (no copy blocks, half pairing, paged NHD); FlashInfer took "
          f"{DECODE_FLASHINFER_US} us there. The last column is each launch without copy blocks.")
    print("\n| prologue | dtype | norm | pairing | path | regs | grid x block | blocks / warps per SM | "
          "KB in flight per SM (element path) | predicted: prefill / copy floor, decode GPU time | element path |")
    print("|---|---|---|---|---|--:|--:|--:|--:|--:|--:|")
    for m in prologue_rows():
        unit = " us" if m["case"].startswith("decode") else ""
        print(f"| {m['case']} | {m['dtype']} | {m['norm']} | {m['pairing']} | "
              f"{'vector' if m['vector'] else 'element'} | {m['regs']} | {m['grid']} x {m['block']} | "
              f"{m['blocks_per_sm']} / {m['warps']} | {m['now_kb']:.1f} ({m['before_kb']:.1f}) | "
              f"{m['now'][0]:.1f}-{m['now'][1]:.1f}{unit} | {m['before'][0]:.1f}-{m['before'][1]:.1f}{unit} |")
    print(f"\nPhase-2 items at {ONCHIP_US[0]}-{ONCHIP_US[1]} us per dependent on-chip trip. A model, not a "
          "measurement: docs/performance/fused.md has the H200's figures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
