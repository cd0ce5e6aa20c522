#!/usr/bin/env bash
# Everything a GPU-machine run needs, in one call (about 5 minutes on an H200):
#   configure + build, gtest, every CUDA case of tests/python (the device
#   fixture's cuda parameter and the CUDA-only tests),
#   the linked-runtime check and the Python error, runtime and variant tests,
#   compute-sanitizer memcheck and racecheck over the gtests' CUDA cases, an Nsight
#   Compute summary of the bf16 prefill launches (DRAM %, achieved occupancy,
#   registers), and the GPU benchmark table (clone, torch.compile of the HF
#   formula, Liger, FlashInfer), the fused KV-cache step against the unfused
#   one and FlashInfer's, and the q/k-norm prologue.
# Each step has its own timeout and log under $OUT (or /tmp/rotary-gpu); a
# failed step is reported at the end and the later steps still run.
#
# The GPU machine has no network. Prepare, here, before the device run:
#   cp -r /usr/src/googletest .gtest-src          # GoogleTest source (no package there)
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl liger-kernel
#   .venv/bin/python benchmarks/peers/build_flashinfer.py   # FlashInfer's RoPE kernels, built for sm_90
# liger-kernel is a pure-Python wheel (py3-none-any), so the platform tag does
# not matter; it installs with --no-deps into /tmp/site (triton and torch are
# in the image). The FlashInfer wheel is over the carry limit: its RoPE header
# is compiled here into .peers/lib/rotary_flashinfer_peer.so (a few MB). The
# folders are git-ignored: pass .gtest-src, .whl and .peers/lib in the carry.
#
# The image sets CXX and CUDAHOSTCXX to /opt/gcc/bin/g++, whose libstdc++.so
# is a broken link (it would link a private static C++ runtime into the
# libraries): the build uses /usr/bin/g++ for both.
#
# Order: build, gtest, the figures (launch model, bf16 benchmark table, fused
# KV-cache step, ncu, fp32 table), then the Python suites, the sanitizers and the prologue
# benchmark. The run keeps to GPU_CHECK_BUDGET seconds (360): a session's
# device time is 15 minutes, the machine's start (1-2 minutes) included, so
# two calls of 360 s fit with a margin. A step that would not fit is
# skipped, named, and the summary prints the command that runs the rest on
# the still-warm machine (its build tree is kept; the passed steps get
# T_<STEP>=0).
#
# Usage: bash benchmarks/gpu_check.sh
# Env:   PYTHON (python3), OUT (log dir), BUILD_DIR (build-gpu), GPU_CHECK_BUDGET (360),
#        T_<STEP> overrides a step's timeout in seconds (T_BUILD=300 ...; 0 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-/tmp/rotary-gpu}
BUILD=${BUILD_DIR:-build-gpu}
HOST_CXX=${ROTARY_HOST_CXX:-/usr/bin/g++}
mkdir -p "$LOG_DIR"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
failed=()
passed=()
over_budget=()
T0=$SECONDS
# The whole run's budget. A step gets at most what is left of it, and is
# skipped, named, when too little is.
BUDGET=${GPU_CHECK_BUDGET:-360}

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
  else
    if ((rc == 124 || rc == 137)); then
      echo "=== $name: TIMED OUT after ${secs}s"
      ((cut)) && over_budget+=("$name")  # cut short by the budget: the rest reruns it
    fi
    echo "=== $name: FAILED rc=$rc ($((SECONDS - start)) s)"
    failed+=("$name")
  fi
  return $rc
}

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
  -DPython3_EXECUTABLE="$(command -v "$PY")")
[ -d .gtest-src ] && cmake_args+=(-DROTARY_GTEST_SOURCE_DIR="$ROOT/.gtest-src")
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
if ((built)); then
  step gtest 180 "$TESTS" --gtest_brief=1
  if ((have_gpu)); then
    # No GTEST_SKIP may hide a GPU test here: count them.
    grep -q "SKIPPED" "$LOG_DIR/gtest.log" && echo "gtest: some tests were skipped (see gtest.log)"
  fi
else
  skip gtest "build failed"
fi

# ---- the figures first, after the gtests (the GPU benchmark table checks
# ours against the references before timing; Liger from the carried wheel)
BENCH_PATH=$ROOT/python
if compgen -G ".whl/*.whl" > /dev/null; then
  step liger_install 60 "$PY" -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl &&
    BENCH_PATH=$BENCH_PATH:/tmp/site
else
  echo "=== liger: no .whl/*.whl carried, the Liger column is skipped"
fi
if [ -f .peers/lib/rotary_flashinfer_peer.so ]; then
  echo "=== flashinfer: .peers/lib/rotary_flashinfer_peer.so carried (the FlashInfer columns)"
else
  echo "=== flashinfer: no .peers/lib carried, the FlashInfer columns are skipped"
fi
if ((built)); then  # the prediction the table below confirms or refutes
  step launch_model 60 env PYTHONPATH="$ROOT/python" "$PY" benchmarks/launch_model.py
else
  skip launch_model "build failed"
fi
if ((built && have_gpu)); then
  # One step per dtype (each compiles the HF formula per row), so either fits a call.
  step bench_bf16 240 env PYTHONPATH="$BENCH_PATH" "$PY" benchmarks/bench.py --device cuda --cuda-dtype bf16 --repeat 11 \
    --wait-load 60 --max-load 4 --markdown "$LOG_DIR/bench_gpu_bf16.md"
  # The fused KV-cache write (one launch) vs the RoPE launch + index_copy_, torch.compile and the
  # copy floor, as GPU time of CUDA-graph replays: decode B=64 and prefill S=8192.
  step bench_kv_cache 240 env PYTHONPATH="$ROOT/python" "$PY" benchmarks/bench_kv_cache.py --device cuda --graph \
    --rounds 11 --max-load 4
else
  skip bench_bf16 "needs the build and a GPU"
  skip bench_kv_cache "needs the build and a GPU"
fi

# One run of each variant of the bf16 prefill case (S=8192, 32/8 heads, D=128):
# HF layout and BHSD, both pairings, out of place and in place.
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
# The decode step with a paged cache (B=64, one token each): the fused launch, bf16 and fp8.
B, D = 64, 128
q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
slots = torch.arange(B, device="cuda") * 64 + 7
f = rotary.freqs_table(D, 64).cuda()
for cdt in (torch.bfloat16, torch.float8_e4m3fn):
    kc, vc = (torch.zeros(B * 4, 16, HK, D, device="cuda", dtype=cdt) for _ in range(2))
    rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 7, False, layout="BSHD", slot_mapping=slots, kv_layout="NHD")
torch.cuda.synchronize()
print("ncu driver: 10 launches (hf/bhsd x interleaved/half x out of place/in place; decode with a bf16 and an fp8 cache)")
'
if ((built && have_gpu)) && command -v ncu > /dev/null; then
  metrics=dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,sm__maximum_warps_per_active_cycle_pct,launch__registers_per_thread,launch__grid_size
  metrics+=,launch__block_size,gpu__time_duration.sum
  step ncu 180 env PYTHONPATH="$ROOT/python" ncu --clock-control none --kernel-name regex:rope_k \
    --metrics "$metrics" --csv "$PY" -c "$NCU_DRIVER"
else
  skip ncu "needs the build, a GPU and ncu"
fi

if ((built && have_gpu)); then
  step bench_fp32 240 env PYTHONPATH="$BENCH_PATH" "$PY" benchmarks/bench.py --device cuda --cuda-dtype fp32 --repeat 11 \
    --wait-load 60 --max-load 4 --markdown "$LOG_DIR/bench_gpu_fp32.md"
else
  skip bench_fp32 "needs the build and a GPU"
fi

# ---- the Python suites on the GPU
if ((built)); then
  step pytest_cuda 300 env PYTHONPATH="$ROOT/python" "$PY" -m pytest -q -rs tests/python -k cuda
  # Error messages that format numbers must come back whole (no private C++ runtime).
  step cxx_runtime 60 ctest --test-dir "$BUILD" -R cxx_runtime --output-on-failure
  step pytest_errors_variants 240 env PYTHONPATH="$ROOT/python" "$PY" -m pytest -q -rs \
    tests/python/test_errors.py tests/python/test_layouts.py tests/python/test_varlen.py \
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
  step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$TESTS" --gtest_filter='*/cuda:RopeErrors.DeviceMismatch'
  step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 1 "$TESTS" --gtest_filter='*/cuda:RopeErrors.DeviceMismatch'
else
  skip memcheck "needs the build, a GPU and compute-sanitizer"
  skip racecheck "needs the build, a GPU and compute-sanitizer"
fi

if ((built && have_gpu)); then
  # The prologue (q/k RMSNorm + RoPE): fused vs unfused vs torch.compile vs the copy floor.
  step bench_qk_norm 240 env PYTHONPATH="$ROOT/python" "$PY" benchmarks/bench_qk_norm.py --device cuda --rounds 11 \
    --threads 1 --max-load 4
else
  skip bench_qk_norm "needs the build and a GPU"
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
      [[ $name == configure || $name == build || $name == liger_install ]] || done_steps+="T_${name^^}=0 "
    done
    echo "gpu_check: the rest (${over_budget[*]}): ${done_steps}bash benchmarks/gpu_check.sh"
  fi
  exit 1
fi
echo "gpu_check: all steps passed"
