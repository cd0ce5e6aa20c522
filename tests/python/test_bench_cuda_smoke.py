"""benchmarks/bench_cuda.py's tables run on the CPU too, so the GPU benchmark
script cannot rot between device runs: one tiny case of each kind, one round,
through the same peer checks (ours against the eager references first) and
table code. Nothing is timed against a bound."""

import argparse
import os
import re
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import bench_common  # noqa: E402
import bench_cuda  # noqa: E402
from protocol import LoadGuard  # noqa: E402

TINY = [bench_common.Case("prefill", (2, 4, 16, 64), (2, 2, 16, 64)),
        bench_common.Case("decode", (3, 4, 1, 64), (3, 2, 1, 64), decode=True)]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_tables_run_on_cpu(dtype):
    args = argparse.Namespace(cuda_dtype=dtype, repeat=1, seed=0)
    out = []
    bench_cuda.run_cuda(args, bench_common.Timer("cpu"), {"prefill", "decode"}, False, out,
                        LoadGuard(max_load=1e9), cases=TINY)
    text = "\n".join(out)
    assert f"#### cuda prefill {dtype}" in text and "cuda decode" in text and "cuda summary" in text
    # The peers that need a GPU are named, not silently dropped.
    assert "CUDA only" in text and "not installed" in text


def test_flashinfer_rows_are_views_of_q_and_k():
    """The FlashInfer column reads q and k as [tokens, heads, head_dim] views:
    the HF layout and one-sequence BHSD are such views (same storage, every
    element in place); BHSD rows of several sequences are not (the column is
    then left out, named). Off the GPU it is left out as CUDA only."""
    for b, layout in ((2, "hf"), (1, "bhsd")):
        gen = torch.Generator().manual_seed(0)
        q = bench_cuda.cuda_heads((b, 4, 8, 64), layout, torch.float32, gen)
        k = bench_cuda.cuda_heads((b, 2, 8, 64), layout, torch.float32, gen)
        qt, kt = bench_cuda.token_major(q, k)
        for x, t in ((q, qt), (k, kt)):
            assert t.data_ptr() == x.data_ptr() and t.shape == (b * 8, x.shape[1], 64)
            assert torch.equal(t.view(b, 8, -1, 64).transpose(1, 2), x)
    q = torch.randn(2, 4, 8, 64)
    assert bench_cuda.token_major(q, q) is None
    fns, notes = {}, {}
    bench_cuda.add_flashinfer(fns, notes, q, q, None, None, {}, "cpu")
    assert "flashinfer" not in fns and notes["flashinfer"] == "CUDA only"
    if not os.path.exists(bench_common.FLASHINFER_LIB):
        assert bench_common.flashinfer_ops() == (None, "not built (benchmarks/peers/build_flashinfer.py)")


@pytest.mark.parametrize("env, why", [({"T_CONFIGURE": "0"}, "configure: skipped (T_CONFIGURE=0)"),
                                      ({"GPU_CHECK_BUDGET": "40"}, "configure: skipped (the run's 40 s budget is spent)")])
def test_gpu_check_names_what_it_skips(tmp_path, env, why):
    """benchmarks/gpu_check.sh keeps to its budget and T_<STEP>=0 skips a step:
    what is not run is named in its summary, and the run fails, never passes."""
    import subprocess

    root = os.path.join(HERE, "..", "..")
    # T_WHEELS=0: a carried .whl would otherwise be installed over this run's own packages.
    run_env = dict(os.environ, OUT=str(tmp_path / "logs"), BUILD_DIR=str(tmp_path / "build"), PYTHON=sys.executable,
                   T_WHEELS="0", **env)
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=root, env=run_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert why in r.stdout and "gpu_check: FAILED or skipped:" in r.stdout, r.stdout
    for later in ("gtest(skipped)", "launch_model(skipped)", "bench_bf16(skipped)", "bench_fp32(skipped)",
                  "bench_kv_cache(skipped)", "pytest_cuda(skipped)", "memcheck(skipped)", "fuzz_cuda(skipped)"):
        assert later in r.stdout, r.stdout
    assert not (tmp_path / "build").exists()
    # Skipped for the budget: the summary gives the command for the rest.
    # (a carried .whl adds its install step to the rest)
    rest = re.search(r"gpu_check: the rest \(configure( wheels)?\): GPU_CHECK_RESUME=1 bash benchmarks/gpu_check.sh",
                     r.stdout)
    assert bool(rest) == ("GPU_CHECK_BUDGET" in env)
