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
# outside the tree and run one op. The CUDA kernels are already compiled and
# linked by `build`; this checks the packaging, so it skips them.
test-install: $(DEPS_STAMP)
	ROTARY_CUDA=OFF $(VPY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
	cd /tmp && $(VPY) -c "import torch, rotary; \
	  x = torch.randn(1, 2, 3, 8); y = rotary.RotaryEmbedding(8, 16)(x, start_pos=2); \
	  print('installed rotary from', rotary.__file__, tuple(y.shape))"

test: test-cpp test-python test-consumer test-install test-docs test-asan test-bench

# The gtest suite under AddressSanitizer + UndefinedBehaviorSanitizer, in its
# own build directory: CPU kernels only, no Python, benchmarks or examples,
# -O1. LeakSanitizer stays on for everything but allocations made inside
# libtorch / libc10 (none are reported today; the suppressions keep a torch
# upgrade from failing CI on torch's own caches).
ASAN_BUILD := build-asan
.PHONY: test-asan
test-asan: $(DEPS_STAMP)
	cmake -S . -B $(ASAN_BUILD) -DROTARY_SANITIZE=ON -DROTARY_CUDA=OFF -DROTARY_BUILD_PYTHON=OFF \
	  -DROTARY_BUILD_BENCHMARKS=OFF -DROTARY_BUILD_EXAMPLES=OFF \
	  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" > /dev/null
	cmake --build $(ASAN_BUILD) -j$(JOBS) --target rotary_tests
	printf 'leak:libtorch_cpu.so\nleak:libc10.so\n' > $(ASAN_BUILD)/lsan.supp
	ASAN_OPTIONS=detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/$(ASAN_BUILD)/lsan.supp \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ./$(ASAN_BUILD)/tests/cpp/rotary_tests --gtest_brief=1

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

# One tiny benchmark case, so the script cannot rot; nothing is timed against a bound.
.PHONY: test-bench
test-bench: build
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench.py --quick

clean:
	rm -rf $(BUILD) python/rotary/*.so
