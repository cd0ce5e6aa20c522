#!/usr/bin/env bash
# Everything a GPU machine run needs, in one call: build, the GPU tests
# (gtest + pytest), compute-sanitizer memcheck over the CUDA gtests, and the
# GPU benchmark table. Uses the machine's own python3 with torch (no network,
# no venv). GoogleTest is built from .gtest-src when the package is missing:
#   cp -r /usr/src/googletest .gtest-src    (here, before the device run)
# Usage: bash benchmarks/gpu_check.sh   (logs under $OUT or /tmp/rotary-gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-/tmp/rotary-gpu}
mkdir -p "$LOG_DIR"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONUNBUFFERED=1
failed=()

step() {
  local name=$1
  shift
  echo "=== $name: $*"
  local start=$SECONDS
  if "$@" 2>&1 | tee "$LOG_DIR/$name.log"; then
    echo "=== $name: ok ($((SECONDS - start)) s)"
  else
    echo "=== $name: FAILED ($((SECONDS - start)) s)"
    failed+=("$name")
  fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

gtest_args=()
[ -d .gtest-src ] && gtest_args=(-DROTARY_GTEST_SOURCE_DIR="$PWD/.gtest-src")
step configure cmake -S . -B build-gpu -DROTARY_CUDA=ON -DROTARY_BUILD_BENCHMARKS=OFF \
  -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DPython3_EXECUTABLE="$(command -v "$PY")" "${gtest_args[@]}"
step build cmake --build build-gpu -j"$(nproc)"
step gtest ./build-gpu/tests/cpp/rotary_tests
step pytest env PYTHONPATH="$PWD/python" "$PY" -m pytest -q -x tests/python
if command -v compute-sanitizer >/dev/null; then
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
    ./build-gpu/tests/cpp/rotary_tests --gtest_filter='Cuda.*'
else
  echo "=== memcheck: compute-sanitizer not found, skipped"
fi
step bench env PYTHONPATH="$PWD/python" "$PY" benchmarks/bench.py --device cuda --markdown "$LOG_DIR/bench_gpu.md"

if ((${#failed[@]})); then
  echo "gpu_check: FAILED steps: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
