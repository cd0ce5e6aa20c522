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
# Ninja when there is one (every build tree the Makefile configures): it
# compiles other files while librotary's precompiled header builds (the demo:
# 2m40 vs 3m20 on 2 cores). A tree configured before keeps its generator.
NINJA_GENERATOR := $(if $(shell command -v ninja 2>/dev/null),-G Ninja)

.PHONY: all venv build test test-cpp test-python test-consumer test-install demo bench clean

all: build

$(DEPS_STAMP): requirements-test.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION) -r requirements-test.txt
	touch $@

venv: $(DEPS_STAMP)

$(BUILD)/CMakeCache.txt: $(DEPS_STAMP)
	cmake -S . -B $(BUILD) $(NINJA_GENERATOR) \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE=$(VPY) -DROTARY_PYTHON_OUTPUT_DIR=$(CURDIR)/python/rotary $(CMAKE_ARGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j$(JOBS)

test-python: build
	PYTHONPATH=$(CURDIR)/python $(VPY) -m pytest -q tests/python

# The CMake package installed under build/install, for the consumers below.
.PHONY: install-local
install-local: build
	cmake --install $(BUILD) --prefix $(CURDIR)/$(BUILD)/install > /dev/null

CONSUMER_PREFIX = $(CURDIR)/$(BUILD)/install;$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')

# A downstream CMake project against the installed package (find_package).
test-consumer: install-local
	cmake -S tests/consumer -B $(BUILD)/consumer -DCMAKE_PREFIX_PATH="$(CONSUMER_PREFIX)" > /dev/null
	cmake --build $(BUILD)/consumer -j$(JOBS)
	$(BUILD)/consumer/consumer $(BUILD)/consumer/rope.pt

# Deployment from C++: Python exports an attention block using the op and
# packages it with AOTInductor; a find_package(rotary) program that calls no
# rotary function (linked with --as-needed) loads and runs it against the
# eager result. docs/deploy.md describes the same steps.
.PHONY: test-aoti
test-aoti: install-local
	PYTHONPATH=$(CURDIR)/python $(VPY) tests/aoti/make_package.py $(BUILD)/aoti
	cmake -S tests/aoti -B $(BUILD)/aoti-consumer -DCMAKE_PREFIX_PATH="$(CONSUMER_PREFIX)" > /dev/null
	cmake --build $(BUILD)/aoti-consumer -j$(JOBS)
	$(BUILD)/aoti-consumer/aoti_consumer $(BUILD)/aoti

# pip install --no-build-isolation . into the venv, then import it from
# outside the tree and run one op. This checks the packaging: setup.py
# packages the libraries `build` made (ROTARY_BUILD_DIR) instead of compiling
# them a second time.
test-install: build
	ROTARY_BUILD_DIR=$(CURDIR)/$(BUILD) $(VPY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps .
	cd /tmp && $(VPY) -c "import torch, rotary; \
	  x = torch.randn(1, 2, 3, 8); y = rotary.RotaryEmbedding(8, 16)(x, start_pos=2); \
	  print('installed rotary from', rotary.__file__, tuple(y.shape))"

# The sanitizer build and its gtest run (test-asan) go at low priority while
# the suites run, on the cores their single-threaded stretches leave idle; its
# log is printed at the end, whole if it failed. (Started beside the main build
# instead, a fresh-clone CI took 1614 s against 1531 s this way, on a tree
# with slightly more to build and test: it did not pay off. Its run after the
# suites instead of beside them: 1430 s, the build done 4 min before them.)
TEST_SUITES := test-cpp test-runtime test-python test-consumer test-aoti test-install test-fresh-install test-docs \
  test-bench test-clang
test: build
	@nice -n 15 $(MAKE) --no-print-directory test-asan > $(BUILD)/asan.log 2>&1 & asan=$$!; \
	status=0; $(MAKE) --no-print-directory $(TEST_SUITES) || status=$$?; \
	if ! wait $$asan; then cat $(BUILD)/asan.log; echo "test-asan failed"; exit 1; fi; \
	sed -n '/^test-asan, /,$$p' $(BUILD)/asan.log; \
	exit $$status

# The C++ runtime rules (cmake/CxxRuntime.cmake) on a one-file library:
# static or broken-link runtimes are caught, refused or repaired.
.PHONY: test-runtime
test-runtime:
	bash tests/runtime/run.sh

# The gtest suite under AddressSanitizer + UndefinedBehaviorSanitizer, in its
# own build directory: CPU kernels only (the capability builds this host runs:
# an AVX2 host never runs AVX-512's), no Python, benchmarks or examples,
# but with the host emulations of the CUDA kernels where the CUDA toolkit's
# headers are (every access of their bodies over whole grids checked;
# 41 tests, 20 s of the run);
# librotary at -O0: 173 CPU-s to compile instead of 318 at -O1, for a run
# 23 s longer; the tests at -Og (tests/cpp/CMakeLists.txt). LeakSanitizer stays on for
# everything but allocations made inside libtorch / libc10 (none are
# reported today; the suppressions keep a torch upgrade from failing CI on
# torch's own caches). allocator_may_return_null:
# tests of refused giant allocations expect c10's out-of-memory error, which
# ASan would otherwise turn into an abort.
ASAN_BUILD := build-asan
.PHONY: test-asan
.PHONY: test-asan-build
test-asan-build: $(DEPS_STAMP)
	cmake -S . -B $(ASAN_BUILD) $(NINJA_GENERATOR) -DROTARY_SANITIZE=ON -DROTARY_CPU_HOST_CAPABILITIES=ON \
	  -DROTARY_CUDA=OFF -DROTARY_BUILD_PYTHON=OFF \
	  -DROTARY_BUILD_BENCHMARKS=OFF -DROTARY_BUILD_EXAMPLES=OFF \
	  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" > /dev/null
	cmake --build $(ASAN_BUILD) -j$(JOBS) --target rotary_tests

# Two processes, one per core: CpuCapability's bit-for-bit comparisons of
# every capability build, about half the run, and the rest (62 s instead of
# 115 on an idle 2-core machine). Each one's log is printed when it fails.
ASAN_RUN = ASAN_OPTIONS=detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:allocator_may_return_null=1 \
	LSAN_OPTIONS=suppressions=$(CURDIR)/$(ASAN_BUILD)/lsan.supp UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	./$(ASAN_BUILD)/tests/cpp/rotary_tests --gtest_brief=1
test-asan: test-asan-build
	printf 'leak:libtorch_cpu.so\nleak:libc10.so\n' > $(ASAN_BUILD)/lsan.supp
	@status=0; \
	$(ASAN_RUN) --gtest_filter='CpuCapability.*' > $(ASAN_BUILD)/asan-capability.log 2>&1 & capability=$$!; \
	$(ASAN_RUN) --gtest_filter='-CpuCapability.*' > $(ASAN_BUILD)/asan-rest.log 2>&1 || status=1; \
	wait $$capability || status=1; \
	for log in rest capability; do echo "test-asan, $$log:"; grep -E '^\[ *(PASSED|SKIPPED|FAILED) *\] [0-9]+ test' $(ASAN_BUILD)/asan-$$log.log; done; \
	if [ $$status -ne 0 ]; then cat $(ASAN_BUILD)/asan-rest.log $(ASAN_BUILD)/asan-capability.log; echo "test-asan failed"; fi; \
	exit $$status

# The fuzzer (tests/fuzz): its regression cases plus FUZZ_CASES seeded random
# cases over every entry point, in child processes; then the C++ op fuzz and
# the emulation fuzz of the RoPE, KV-cache and prologue launches under ASan + UBSan when
# build-asan exists (make test-asan builds it), and
# the op cases on CUDA when a GPU and the CUDA kernels are there. `make test`
# runs a fixed 300-case smoke of it (tests/python/test_fuzz_smoke.py).
FUZZ_CASES ?= $(or $(ROTARY_FUZZ_CASES),20000)
FUZZ_SEED ?= $(or $(ROTARY_FUZZ_SEED),100000)
FUZZ_ASAN_CASES ?= 2000
.PHONY: fuzz
fuzz: build
	status=0; \
	PYTHONPATH=$(CURDIR)/python:$(CURDIR)/tests $(VPY) -m fuzz.run --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) || status=1; \
	if [ -x $(ASAN_BUILD)/tests/cpp/rotary_tests ]; then \
	  ROTARY_FUZZ_CASES=$(FUZZ_ASAN_CASES) ROTARY_FUZZ_SEED=$(FUZZ_SEED) \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    ./$(ASAN_BUILD)/tests/cpp/rotary_tests --gtest_brief=1 --gtest_filter='FuzzOps.*:MemoryOverlap.*:*EmulationFuzz.*' || status=1; \
	else echo "fuzz: no $(ASAN_BUILD) (make test-asan builds it); C++ fuzz under ASan skipped"; fi; \
	if PYTHONPATH=$(CURDIR)/python $(VPY) -c "import sys, torch, rotary; \
	    sys.exit(0 if torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key('rotary::apply_rope', 'CUDA') else 1)"; then \
	  ROTARY_FUZZ_DEVICE=cuda PYTHONPATH=$(CURDIR)/python:$(CURDIR)/tests $(VPY) -m fuzz.run --cases $(FUZZ_CASES) --seed $(FUZZ_SEED) || status=1; \
	else echo "fuzz: no GPU with the CUDA kernels; CUDA fuzz skipped"; fi; \
	exit $$status

# The CPU kernel builds with clang too: its capability objects
# (csrc/cpu/kernel/rope_kernel.cpp as DEFAULT, AVX2, AVX512, AVX512_BF16)
# compiled by clang++ with the flags CMake gives them, and the AVX2 / AVX-512
# objects really hold 256- / 512-bit vector code (ymm / zmm registers) while
# DEFAULT holds none; AVX512_BF16 holds the bf16 conversion instructions.
# Only those objects are built (x86-64 hosts).
CLANG_BUILD := build-clang
CLANGXX ?= clang++
.PHONY: test-clang
test-clang: $(DEPS_STAMP)
	cmake -S . -B $(CLANG_BUILD) -DCMAKE_CXX_COMPILER=$(CLANGXX) -DROTARY_CUDA=OFF -DROTARY_BUILD_PYTHON=OFF \
	  -DROTARY_BUILD_TESTS=OFF -DROTARY_BUILD_BENCHMARKS=OFF -DROTARY_BUILD_EXAMPLES=OFF \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" > /dev/null
	cmake --build $(CLANG_BUILD) -j$(JOBS) --target rotary_cpu_default rotary_cpu_avx2 rotary_cpu_avx512 \
	  rotary_cpu_avx512_bf16
	@set -e; for spec in default:ymm:0 default:zmm:0 avx2:ymm:1 avx2:zmm:0 avx512:zmm:1 avx512_bf16:zmm:1; do \
	  cap=$${spec%%:*}; rest=$${spec#*:}; reg=$${rest%%:*}; want=$${rest#*:}; \
	  obj=$$(find $(CLANG_BUILD)/CMakeFiles/rotary_cpu_$$cap.dir -name 'rope_kernel.cpp.o'); \
	  n=$$(objdump -d --no-show-raw-insn $$obj | grep -c "%$$reg" || true); \
	  echo "clang $$cap: $$n instructions on $$reg"; \
	  if [ $$want = 1 ] && [ $$n -lt 100 ]; then echo "clang $$cap: expected $$reg vector code"; exit 1; fi; \
	  if [ $$want = 0 ] && [ $$n -ne 0 ]; then echo "clang $$cap: unexpected $$reg code"; exit 1; fi; \
	done; \
	for cap in avx512 avx512_bf16; do \
	  obj=$$(find $(CLANG_BUILD)/CMakeFiles/rotary_cpu_$$cap.dir -name 'rope_kernel.cpp.o'); \
	  n=$$(objdump -d --no-show-raw-insn $$obj | grep -c 'vcvtne2\?ps2bf16' || true); \
	  echo "clang $$cap: $$n bf16 conversion instructions"; \
	  if [ $$cap = avx512 ] && [ $$n -ne 0 ]; then echo "clang avx512: unexpected bf16 instructions"; exit 1; fi; \
	  if [ $$cap = avx512_bf16 ] && [ $$n -lt 4 ]; then echo "clang avx512_bf16: expected bf16 instructions"; exit 1; fi; \
	done

# The demo, in its own build tree with only what it runs (no CUDA kernels,
# gtest suite or benchmarks): librotary, rotary._C and rotary_demo. The
# extension goes to $(DEMO_PKG) with copies of the package's .py files, so the
# in-tree python/rotary/_C*.so of `make build` is left alone.
# 1. The LibTorch demo: relative-position proof, KV-cache decode checked
#    against a full recompute at every step, RoPE time vs the seed's formula.
# 2. examples/hf_drop_in.py --quick: a tiny random-weight Hugging Face Llama,
#    patched, against the unpatched one (logits and greedy tokens).
DEMO_BUILD := build-demo
DEMO_PKG := $(DEMO_BUILD)/python/rotary

$(DEMO_BUILD)/CMakeCache.txt: $(DEPS_STAMP)
	cmake -S . -B $(DEMO_BUILD) $(NINJA_GENERATOR) -DROTARY_CUDA=OFF -DROTARY_BUILD_TESTS=OFF -DROTARY_BUILD_BENCHMARKS=OFF \
	  -DROTARY_BUILD_EXAMPLES=ON -DROTARY_BUILD_PYTHON=ON -DROTARY_PYTHON_OUTPUT_DIR=$(CURDIR)/$(DEMO_PKG) \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
	  -DPython3_EXECUTABLE=$(VPY) > /dev/null

demo: $(DEMO_BUILD)/CMakeCache.txt
	cmake --build $(DEMO_BUILD) -j$(JOBS) --target rotary rotary_python rotary_demo
	@# The package's Python files beside the demo's extension (stale copies removed first).
	find $(DEMO_PKG) -name '*.py' -delete
	cd python && find rotary -name '*.py' -exec cp --parents {} $(CURDIR)/$(DEMO_BUILD)/python/ \;
	./$(DEMO_BUILD)/examples/rotary_demo
	PYTHONPATH=$(CURDIR)/$(DEMO_BUILD)/python $(VPY) examples/hf_drop_in.py --quick

# Every fenced code block of README.md and docs/*.md: python run, cpp compiled once and run.
.PHONY: test-docs
test-docs: build
	PYTHONPATH=$(CURDIR)/python $(VPY) -m pytest -q tests/docs

bench: build
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench.py

# One tiny benchmark case, so the script cannot rot; nothing is timed against a bound.
.PHONY: test-bench
test-bench: build
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench.py --quick
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench_hf.py --quick
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench_qk_norm.py --quick
	PYTHONPATH=$(CURDIR)/python $(VPY) benchmarks/bench_vmap.py --quick

clean:
	rm -rf $(BUILD) $(DEMO_BUILD) python/rotary/*.so

# The README's Python install steps in a new venv made by the base interpreter
# of .venv (tests/install/fresh_venv.sh): torch is seen from .venv through a
# .pth file rather than downloaded again; setuptools and wheel are installed
# as the README says; setup.py packages what `build` made (ROTARY_BUILD_DIR).
.PHONY: test-fresh-install
test-fresh-install: build
	bash tests/install/fresh_venv.sh $(VPY) $(CURDIR)/$(BUILD)
