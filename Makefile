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

.PHONY: all venv build test test-cpp test-python test-consumer test-install demo bench clean

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

# A downstream CMake project against the installed package (find_package).
test-consumer: build
	cmake --install $(BUILD) --prefix $(CURDIR)/$(BUILD)/install > /dev/null
	cmake -S tests/consumer -B $(BUILD)/consumer \
	  -DCMAKE_PREFIX_PATH="$(CURDIR)/$(BUILD)/install;$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" > /dev/null
	cmake --build $(BUILD)/consumer -j$(JOBS)
	$(BUILD)/consumer/consumer

# pip install --no-build-isolation . into the venv, then import it from
# outside the tree and run one op.
test-install: $(DEPS_STAMP)
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
	cd /tmp && $(VPY) -c "import torch, rotary; \
	  x = torch.randn(1, 2, 3, 8); y = rotary.RotaryEmbedding(8, 16)(x, start_pos=2); \
	  print('installed rotary from', rotary.__file__, tuple(y.shape))"

test: test-cpp test-python test-consumer test-install test-docs

# The LibTorch demo: relative-position proof, KV-cache decode checked against
# a full recompute at every step, RoPE time vs the seed's eager formula.
demo: build
	./$(BUILD)/examples/rotary_demo

# Every fenced code block of README.md: python run, cpp compiled once and run.
.PHONY: test-docs
test-docs: build
	PYTHONPATH=$(CURDIR)/python $(VPY) -m pytest -q tests/docs

bench: build
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench.py

clean:
	rm -rf $(BUILD) python/rotary/*.so
