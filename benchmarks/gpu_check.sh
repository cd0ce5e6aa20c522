#!/usr/bin/env bash
# Everything a GPU-machine run needs, in one call (about 5 minutes on an H200):
#   configure + build, gtest, every CUDA case of tests/python (the device
#   fixture's cuda parameter and the CUDA-only tests),
#   the linked-runtime check and the Python error, runtime and variant tests,
#   compute-sanitizer memcheck and racecheck over the gtests' CUDA cases
#   and memcheck over the Python suites' eager CUDA cases, an Nsight
#   Compute summary of the bf16 prefill launches (DRAM %, achieved occupancy,
#   registers), and the GPU benchmark table (clone, torch.compile of the HF
#   formula, Liger, FlashInfer), the fused KV-cache step against the unfused
#   one and FlashInfer's, and the q/k-norm prologue; last, the fuzzer's op
#   cases on the GPU.
# Each step has its own timeout and log under $OUT (or /tmp/rotary-gpu); a
# failed step is reported at the end and the later steps still run.
#
# The GPU machine has no network. Prepare, here, before the device run
# (bash benchmarks/prepare_gpu_carry.sh runs these three and sizes them):
#   cp -r /usr/src/googletest .gtest-src          # GoogleTest source (no package there)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     liger-kernel transformers==5.24.0 kernels==0.18.3 tomlkit
#   .venv/bin/python benchmarks/peers/build_flashinfer.py   # FlashInfer's RoPE kernels, built for sm_90
# The wheels install with --no-deps into /tmp/site, first on every Python
# step's path (triton, torch and transformers' other needs are in the image):
# Liger for its column; transformers and kernels at the CPU CI's pins, as the
# image's transformers is older and it has no kernels (the Hub route's CUDA
# test needs both). The FlashInfer wheel is over the carry limit: its RoPE header
# is compiled here into .peers/lib/rotary_flashinfer_peer.so (a few MB). The
# folders are git-ignored: pass .gtest-src, .whl and .peers/lib in the carry.
#
# The image sets CXX and CUDAHOSTCXX to /opt/gcc/bin/g++, whose libstdc++.so
# is a broken link (it would link a private static C++ runtime into the
# libraries): the build uses /usr/bin/g++ for both.
#
# Order: build, gtest, the figures (launch model, bf16 benchmark table, fused
# KV-cache step, ncu, fp32 table, the prologue), then the Python suites and
# the sanitizers. The run keeps to GPU_CHECK_BUDGET seconds (360): a session's
# device time is 15 minutes, the machine's start (1-2 minutes) included, so
# two calls of 360 s fit with a margin. A step that would not fit is
# skipped, named, and the summary prints the command that runs the rest:
# GPU_CHECK_RESUME=1 on the still-warm machine (its build tree and the list
# of steps that ran are kept; the machine goes back 30 s after a call, so
# send it at once), or T_<STEP>=0 for each step that ran on a fresh one.
#
# Usage: bash benchmarks/gpu_check.sh
# Env:   PYTHON (python3), OUT (log dir), BUILD_DIR (build-gpu), GPU_CHECK_BUDGET (360),
#        GPU_CHECK_RESUME (0), GPU_MAX_LOAD (12), BENCH_CASES (prefill,training,long,decode),
#        T_<STEP> overrides a step's timeout in seconds (T_BUILD=300 ...; 0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
# At most 8 files come back from the device's $OUT: the step logs go in
# logs/ and are packed into one archive at the end, beside the two tables.
LOG_ROOT=${OUT:-/tmp/rotary-gpu}
LOG_DIR=$LOG_ROOT/logs
BUILD=${BUILD_DIR:-build-gpu}
# Steps that ran (ok or failed, not cut by the budget), kept in the build tree:
# GPU_CHECK_RESUME=1 on the still-warm machine runs only the others.
DONE=$BUILD/gpu_check.done
HOST_CXX=${ROTARY_HOST_CXX:-/usr/bin/g++}
mkdir -p "$LOG_DIR"
[[ ${GPU_CHECK_RESUME:-0} == 1 ]] || rm -f "$DONE"
pack() {
  cp "$DONE" "$LOG_ROOT/gpu_check.done" 2> /dev/null
  for md in "$LOG_DIR"/*.md; do [ -f "$md" ] && cp "$md" "$LOG_ROOT/"; done
  tar czf "$LOG_ROOT/gpu_check_logs.tgz" -C "$LOG_ROOT" logs && rm -rf "$LOG_DIR"
}
trap pack EXIT
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
failed=()
passed=()
over_budget=()
T0=$SECONDS
# The whole run's budget. A step gets at most what is left of it, and is
# skipped, named, when too little is.
BUDGET=${GPU_CHECK_BUDGET:-360}
# The 16-core machine's 1-minute load stays high for a minute after the -j16
# build though nothing runs: GPU-timed steps accept up to 12 (printed with
# each table) rather than wait it out.
GPU_MAX_LOAD=${GPU_MAX_LOAD:-12}
BENCH_CASES=${BENCH_CASES:-prefill,training,long,decode}

# step NAME SECONDS CMD...: runs CMD under a timeout, logs to $LOG_DIR/NAME.log.
step() {
  local name=$1 secs=$2
  shift 2
  local var="T_${name^^}"
  secs=${!var:-$secs}
  local left=$((BUDGET - (SECONDS - T0) - 20))  # 20 s for the summary
  if ((secs == 0)); then
    skip "$name" "$var=0"
    return 1
  fi
  if [[ ${GPU_CHECK_RESUME:-0} == 1 && $name != configure && $name != build && $name != wheels ]] &&
    grep -qx "$name .*" "$DONE" 2> /dev/null; then
    echo "=== $name: ran in an earlier call ($(grep -x "$name .*" "$DONE" | tail -n 1 | cut -d' ' -f2-))"
    return 0
  fi
  if ((left < 30)); then
    skip "$name" "the run's ${BUDGET} s budget is spent"
    over_budget+=("$name")
    return 1
  fi
  local cut=0
  ((secs > left)) && secs=$left cut=1
  echo "=== $name (timeout ${secs}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$LOG_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$LOG_DIR/$name.log"
  if ((rc == 0)); then
    echo "=== $name: ok ($((SECONDS - start)) s)"
    passed+=("$name")
    done_step "$name ok"
  else
    if ((rc == 124 || rc == 137)); then
      echo "=== $name: TIMED OUT after ${secs}s"
      ((cut)) && over_budget+=("$name")  # cut short by the budget: the rest reruns it
    fi
    echo "=== $name: FAILED rc=$rc ($((SECONDS - start)) s)"
    failed+=("$name")
    # Cut by the budget, or refused for the load (the protocol's rc 3): the rest reruns it.
    ((cut && (rc == 124 || rc == 137))) || ((rc == 3)) || done_step "$name failed rc=$rc"
  fi
  return $rc
}

# Noted in the build tree, which configure makes (nothing is noted before it).
done_step() { [ -d "$BUILD" ] && echo "$1" >> "$DONE"; }

skip() {
  echo "=== $1: skipped ($2)"
  failed+=("$1(skipped)")
}

echo "gpu_check: $(date -u +%FT%TZ), logs in $LOG_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 ||
  echo "nvidia-smi: not available"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else "(no CUDA device)")' 2>&1

# ---- build (the host compiler named explicitly, whatever CXX says)
cmake_args=(-S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DROTARY_CUDA=ON -DROTARY_BUILD_BENCHMARKS=OFF
  -DROTARY_BUILD_EXAMPLES=OFF -DCMAKE_CXX_COMPILER="$HOST_CXX" -DCMAKE_CUDA_HOST_COMPILER="$HOST_CXX"
  -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
  -DPython3_EXECUTABLE="$(command -v "$PY")" -DROTARY_PYTHON_OUTPUT_DIR="$ROOT/python/rotary")
# Without the carried GoogleTest source, configure would fail on find_package
# (no package on the image) and every step with it: the gtests alone are left out.
have_gtest=1
if [ -d .gtest-src ]; then
  cmake_args+=(-DROTARY_GTEST_SOURCE_DIR="$ROOT/.gtest-src")
else
  echo "gpu_check: WARNING: no .gtest-src (bash benchmarks/prepare_gpu_carry.sh makes it): building without the gtests"
  cmake_args+=(-DROTARY_BUILD_TESTS=OFF)
  have_gtest=0
fi
command -v ninja > /dev/null && [ ! -f "$BUILD/CMakeCache.txt" ] && cmake_args+=(-G Ninja)
built=0
if step configure 120 env -u CXX -u CUDAHOSTCXX -u CC cmake "${cmake_args[@]}" &&
  step build 300 env -u CXX -u CUDAHOSTCXX -u CC cmake --build "$BUILD" -j"$(nproc)"; then
  built=1
fi
TESTS=./$BUILD/tests/cpp/rotary_tests
have_gpu=0
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null && have_gpu=1

# ---- tests
if ((built && !have_gtest)); then
  skip gtest "no .gtest-src carried"
elif ((built)); then
  # A hung test is named (with every thread's stack) and the rest still runs.
  step gtest 180 "$PY" tests/cpp/gtest_watchdog.py "$TESTS" --per-test 30
  if ((have_gpu)); then
    # No GTEST_SKIP may hide a GPU test here: count them.
    grep -q "SKIPPED" "$LOG_DIR/gtest.log" && echo "gtest: some tests were skipped (see gtest.log)"
  fi
else
  skip gtest "build failed"
fi

# ---- the figures first, after the gtests (the GPU benchmark table checks
# ours against the references before timing; Liger from the carried wheel)
# The carried wheels (Liger; transformers and kernels at the CPU CI's pins) go
# first on every Python step's path.
PY_PATH=$ROOT/python
if compgen -G ".whl/*.whl" > /dev/null; then
  step wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && PY_PATH=/tmp/site:$PY_PATH
else
  echo "=== wheels: no .whl/*.whl carried: the Liger column is skipped, the image's transformers is used"
fi
BENCH_PATH=$PY_PATH
if [ -f .peers/lib/rotary_flashinfer_peer.so ]; then
  echo "=== flashinfer: .peers/lib/rotary_flashinfer_peer.so carried (the FlashInfer columns)"
else
  echo "=== flashinfer: no .peers/lib carried, the FlashInfer columns are skipped"
fi
if ((built)); then  # the prediction the table below confirms or refutes
  step launch_model 60 env PYTHONPATH="$PY_PATH" "$PY" benchmarks/launch_model.py
else
  skip launch_model "build failed"
fi
if ((built && have_gpu)); then
  # One step per dtype (each compiles the HF formula per row), so either fits a call.
  step bench_bf16 240 env PYTHONPATH="$BENCH_PATH" "$PY" benchmarks/bench.py --device cuda --cuda-dtype bf16 --cases "$BENCH_CASES" --repeat 11 \
    --wait-load 20 --max-load "$GPU_MAX_LOAD" --markdown "$LOG_DIR/bench_gpu_bf16.md"
  # The fused KV-cache write (one launch) vs the RoPE launch + index_copy_, torch.compile, the
  # copy floor and the fused launch without copy blocks, as GPU time of CUDA-graph replays:
  # decode B=64 and prefill S=8192.
  step bench_kv_cache 240 env PYTHONPATH="$PY_PATH" "$PY" benchmarks/bench_kv_cache.py --device cuda --graph \
    --rounds 11 --wait-load 20 --max-load "$GPU_MAX_LOAD"
else
  skip bench_bf16 "needs the build and a GPU"
  skip bench_kv_cache "needs the build and a GPU"
fi

# One run of each variant of the bf16 prefill case (S=8192, 32/8 heads, D=128):
# HF layout and BHSD, both pairings, out of place and in place, and the half
# pairing out of place without the L2 prefetch.
NCU_DRIVER='
import torch, rotary
torch.manual_seed(0)
B, S, HQ, HK, D = 1, 8192, 32, 8, 128
for layout in ("hf", "bhsd"):
    if layout == "hf":
        q = torch.randn(B, S, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, S, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
    for interleaved in (True, False):
        rope = rotary.RotaryEmbedding(D, S, interleaved=interleaved).cuda()
        rope(q, k)
        torch.ops.rotary.apply_rope_qk_(q, k, rope.freqs, 0, interleaved)
    # The same module call without the L2 prefetch of next rows (the A/B).
    rotary._C._cuda_set_l2_prefetch(False)
    rope(q, k)
    rotary._C._cuda_set_l2_prefetch(True)
# The decode step with a paged cache (B=64, one token each): the fused launch, bf16 and fp8.
B, D = 64, 128
q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
slots = torch.arange(B, device="cuda") * 64 + 7
f = rotary.freqs_table(D, 64).cuda()
# Each with copy blocks (v copied beside the rotation) and without (the A/B).
for cdt in (torch.bfloat16, torch.float8_e4m3fn):
    kc, vc = (torch.zeros(B * 4, 16, HK, D, device="cuda", dtype=cdt) for _ in range(2))
    for blocks in (True, False):
        rotary._C._cuda_set_copy_blocks(blocks)
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 7, False, layout="BSHD", slot_mapping=slots,
                                         kv_layout="NHD")
rotary._C._cuda_set_copy_blocks(True)
torch.cuda.synchronize()
print("ncu driver: 14 launches (hf/bhsd x (interleaved/half x out of place/in place, half without L2 prefetch); "
      "decode with a bf16 and an fp8 cache, with and without copy blocks)")
'
if ((built && have_gpu)) && command -v ncu > /dev/null; then
  metrics=dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,sm__maximum_warps_per_active_cycle_pct,launch__registers_per_thread,launch__grid_size
  metrics+=,launch__block_size,gpu__time_duration.sum
  step ncu 180 env PYTHONPATH="$PY_PATH" ncu --clock-control none --kernel-name regex:rope_k \
    --metrics "$metrics" --csv "$PY" -c "$NCU_DRIVER"
else
  skip ncu "needs the build, a GPU and ncu"
fi

if ((built && have_gpu)); then
  step bench_fp32 240 env PYTHONPATH="$BENCH_PATH" "$PY" benchmarks/bench.py --device cuda --cuda-dtype fp32 --cases "$BENCH_CASES" --repeat 11 \
    --wait-load 20 --max-load "$GPU_MAX_LOAD" --markdown "$LOG_DIR/bench_gpu_fp32.md"
else
  skip bench_fp32 "needs the build and a GPU"
fi

if ((built && have_gpu)); then
  # The prologue (q/k RMSNorm + RoPE): fused vs unfused vs torch.compile vs the copy floor.
  step bench_qk_norm 240 env PYTHONPATH="$PY_PATH" "$PY" benchmarks/bench_qk_norm.py --device cuda --rounds 11 \
    --threads 1 --wait-load 20 --max-load "$GPU_MAX_LOAD"
else
  skip bench_qk_norm "needs the build and a GPU"
fi

# ---- the Python suites on the GPU
if ((built)); then
  step pytest_cuda 300 env PYTHONPATH="$PY_PATH" "$PY" -m pytest -q -rs tests/python -k cuda
  # Error messages that format numbers must come back whole (no private C++ runtime).
  step cxx_runtime 60 ctest --test-dir "$BUILD" -R cxx_runtime --output-on-failure
  step pytest_errors_variants 240 env PYTHONPATH="$PY_PATH" "$PY" -m pytest -q -rs \
    tests/python/test_errors.py tests/python/test_errors_inplace.py tests/python/test_errors_now_valid.py \
    tests/python/test_errors_start_pos_overflow.py tests/python/test_layouts.py tests/python/test_varlen.py \
    tests/python/test_partial_rotary.py tests/python/test_position_forms.py tests/python/test_inv_freq.py \
    tests/python/test_inplace.py tests/python/test_variant_gradients.py tests/python/test_variant_opcheck.py \
    tests/python/test_variant_compile.py tests/python/test_variant_errors.py tests/python/test_runtime.py
else
  skip pytest_cuda "build failed"
  skip cxx_runtime "build failed"
  skip pytest_errors_variants "build failed"
fi
# ---- sanitizers (need a GPU)
if ((built && have_gpu)) && command -v compute-sanitizer > /dev/null; then
  if ((have_gtest)); then
    step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$TESTS" --gtest_filter='*/cuda:RopeErrors.DeviceMismatch'
    step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 "$TESTS" \
      --gtest_filter='*/cuda:RopeErrors.DeviceMismatch'
  else
    skip memcheck "no .gtest-src carried"
    skip racecheck "no .gtest-src carried"
  fi
  # The Python suites' CUDA kernels under memcheck (the compiled cases left out:
  # cudagraph trees and inductor's own kernels are not ours).
  step memcheck_py 300 env PYTHONPATH="$PY_PATH" compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$PY" -m pytest -q -x tests/python/test_ops_devices.py tests/python/test_kv_cache_layouts.py \
    tests/python/test_kv_cache_devices.py tests/python/test_kv_cache_mla.py \
    tests/python/test_qk_norm.py tests/python/test_qk_norm_kv_cache.py tests/python/test_qk_norm_fp8.py \
    tests/python/test_cos_sin.py -k "cuda and not compile"
else
  skip memcheck "needs the build, a GPU and compute-sanitizer"
  skip racecheck "needs the build, a GPU and compute-sanitizer"
  skip memcheck_py "needs the build, a GPU and compute-sanitizer"
fi
# ---- the fuzzer's op cases on the GPU (the CPU machines run them on the CPU,
# and the CUDA kernels' host emulation under their own fuzz in gtest)
if ((built && have_gpu)); then
  step fuzz_cuda 120 env ROTARY_FUZZ_DEVICE=cuda PYTHONPATH="$PY_PATH:$ROOT/tests" "$PY" -m fuzz.run --cases 1500 \
    --seed 100000
else
  skip fuzz_cuda "needs the build and a GPU"
fi

# ---- the short summary last (the device reply carries the end of the output)
if [ -s "$LOG_DIR/ncu.log" ]; then
  echo
  echo "ncu (bf16 prefill, --clock-control none): one line per launch"
  "$PY" - "$LOG_DIR/ncu.log" << 'NCU_SUMMARY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if rows:
    head, rows = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(head)}
    launches = {}
    for r in rows:
        key = (r[col["ID"]], r[col["Kernel Name"]].split("(")[0].replace("rotary::kernel::", ""))
        launches.setdefault(key, {})[r[col["Metric Name"]]] = r[col["Metric Value"]]
    for (i, name), m in launches.items():
        print(f"  #{i} {name[:70]}: DRAM {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '?')}%"
              f", occupancy {m.get('sm__warps_active.avg.pct_of_peak_sustained_active', '?')}%"
              f" (theoretical {m.get('sm__maximum_warps_per_active_cycle_pct', '?')}%)"
              f", {m.get('launch__registers_per_thread', '?')} regs, grid {m.get('launch__grid_size', '?')}"
              f" x {m.get('launch__block_size', '?')}, {m.get('gpu__time_duration.sum', '?')} ns")
NCU_SUMMARY
fi
for md in "$LOG_DIR"/bench_gpu_bf16.md "$LOG_DIR"/bench_gpu_fp32.md; do
  [ -s "$md" ] && { echo; cat "$md"; }
done

echo
echo "gpu_check: ${SECONDS}s in all ($((SECONDS - T0)) s of steps); passed: ${passed[*]:-none}"
if ((${#failed[@]})); then
  echo "gpu_check: FAILED or skipped: ${failed[*]}"
  if ((${#over_budget[@]})); then
    done_steps=""
    for name in "${passed[@]}"; do
      # the build is incremental, and the Liger install sets the tables' path
      [[ $name == configure || $name == build || $name == wheels ]] || done_steps+="T_${name^^}=0 "
    done
    echo "gpu_check: the rest (${over_budget[*]}): GPU_CHECK_RESUME=1 bash benchmarks/gpu_check.sh on the warm"
    echo "  machine; on a fresh one: ${done_steps}bash benchmarks/gpu_check.sh"
  fi
  exit 1
fi
echo "gpu_check: all steps passed"
