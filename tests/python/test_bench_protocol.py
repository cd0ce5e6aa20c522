"""The benchmark harness measures what its docs say: each thread-count pass
compiles its torch.compile baselines for that thread count, the KV-cache
copy floor reads written memory, and --processes gathers every process's
medians. Nothing here is timed."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import bench_kv_cache  # noqa: E402
from protocol import thread_passes  # noqa: E402


def test_each_thread_pass_compiles_for_its_thread_count():
    """Inductor writes no OpenMP region for one thread, and its FX-graph
    cache is not keyed on the thread count: a 2-thread pass after a
    1-thread one ran the serial code until each pass compiled afresh."""
    x = torch.randn(1 << 18)
    regions, saved = {}, torch._inductor.config.force_disable_caches
    for nt in thread_passes([1, 2], reset_compiled=True):
        _, code = run_and_get_code(torch.compile(lambda t: t * 2 + 1), x)
        regions[nt] = sorted(set(re.findall(r"#pragma omp parallel num_threads\(\d+\)", "".join(code))))
    assert regions == {1: [], 2: ["#pragma omp parallel num_threads(2)"]}
    assert torch._inductor.config.force_disable_caches == saved


def test_the_kv_copy_floor_reads_written_sources():
    """An allocation never written reads the kernel's one zero page on the
    CPU: the floor would time a write-only stream."""
    fns, _, _ = bench_kv_cache.cases("cpu", torch.float32, 2, 8, 4, 2, 16, "NHD", compile_=False)
    floor = fns["floor"]
    cells = dict(zip(floor.__code__.co_freevars, (c.cell_contents for c in floor.__closure__)))
    for name in ("src", "src_k"):  # drawn from N(0, 1): E|x| = 0.798, not an allocator's leftovers
        assert 0.7 < cells[name].abs().mean().item() < 0.9, name


def test_processes_gives_each_ratio_over_every_process():
    """A process's heap and code layout move a decode call's ratio by more
    than its own rounds show: --processes runs N and gives the spread."""
    script = os.path.join(HERE, "..", "..", "benchmarks", "bench_decode.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, script, "--quick", "--threads", "1", "--processes", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert re.findall(r"^process (\d): load average before", out.stdout, re.M) == ["1", "2"]
    rows = re.findall(r"^\| ([^|]+) \| [\d.]+ \| \*?([\d.]+)x \[([\d.]+)-([\d.]+)\] \| [\d.]+ \|$", out.stdout, re.M)
    names = [r[0] for r in rows]
    assert names[0] == "2x torch.add" and "rotary.CppRotaryEmbedding" in names and len(names) == 11, out.stdout
    for name, med, lo, hi in rows:
        assert float(lo) <= float(med) <= float(hi), name
    assert rows[0][1:] == ("1.00", "1.00", "1.00")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_benchmark_checks_each_fused_row_before_timing(dtype):
    """Each fused row leaves what its unfused partner leaves; a wrong one is caught."""
    kw = dict(B=2, S=3, kv_layout="NHD")
    bench_kv_cache.check_fused("cpu", dtype, kw)
    real = bench_kv_cache.cases

    def broken(*args, **kwargs):
        fns, inputs, state = real(*args, **kwargs)
        right = fns["fused"]
        fns["fused"] = lambda: (right(), state["kc"].view(-1)[:1].add_(1))
        return fns, inputs, state

    bench_kv_cache.cases = broken
    try:
        with pytest.raises(AssertionError, match="fused vs unfused: kc differs"):
            bench_kv_cache.check_fused("cpu", dtype, kw)
    finally:
        bench_kv_cache.cases = real
