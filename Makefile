# The two commands of the README: `make demo` and `make test`. Both start from
# a fresh clone: they create .venv, install the pinned torch and the test
# dependencies, configure and build with CMake, then run. Re-runs are incremental.
PYTHON ?= python3
TORCH_VERSION := 2.11.0
VENV := .venv
VPY := $(abspath $(VENV))/bin/python
BUILD := build
JOBS ?= $(shell nproc)
DEPS_STAMP := $(VENV)/.rotary-deps-$(TORCH_VERSION)
CMAKE_ARGS ?=

.PHONY: all venv build test test-cpp test-python demo bench clean

all: build

$(DEPS_STAMP): requirements-test.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION) -r requirements-test.txt
	touch $@

venv: $(DEPS_STAMP)

$(BUILD)/CMakeCache.txt: $(DEPS_STAMP)
	cmake -S . -B $(BUILD) \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE=$(VPY) $(CMAKE_ARGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j$(JOBS)

test-python: build
	PYTHONPATH=$(CURDIR)/python $(VPY) -m pytest -q tests/python

test: test-cpp test-python

demo: build
	PYTHONPATH=$(CURDIR)/python $(VPY) examples/relative_position.py

bench: build
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench.py

clean:
	rm -rf $(BUILD) python/rotary/*.so
