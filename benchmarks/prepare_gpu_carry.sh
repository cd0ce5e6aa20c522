#!/usr/bin/env bash
# The three git-ignored folders gpu_check.sh needs carried to the GPU machine
# (it has no network): GoogleTest's source, the wheels it installs into
# /tmp/site, and FlashInfer's RoPE kernels built for sm_90. Run here, then
# pass carry=[".gtest-src", ".whl", ".peers/lib"] with the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -d .gtest-src ] || cp -r /usr/src/googletest .gtest-src
[ -d .whl ] || python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  liger-kernel transformers==5.24.0 kernels==0.18.3 tomlkit
[ -f .peers/lib/rotary_flashinfer_peer.so ] || "$PY" benchmarks/peers/build_flashinfer.py
# The carry limit is 64 MiB for the three together.
du -sch .gtest-src .whl .peers/lib | tail -n 1
