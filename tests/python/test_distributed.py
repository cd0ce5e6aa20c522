"""The rotary ops on DTensor (torch.distributed, gloo, CPU): tensor parallel
(Shard(heads)), context parallel (Shard(seq), offsets derived or head-tail
position ids), Shard(batch), the module inside a parallelised attention
block, no communication inside the op, and the refused placements.

Each world size (2 and 4 ranks) is one start of separate processes with a
hard deadline, running every scenario and writing one result per scenario;
the tests below read them (test_dtensor_*.py spawn their own scenarios the
same way, through _results). The ranks come from a forkserver that imported
torch, DTensor and rotary once (a fresh process, not a fork of pytest), so a
rank starts without paying those imports again. Every sharded result is
compared three ways: to the unsharded call (bit for bit: same kernel, same
positions), to the float64 reference, and for gradients to the reference
inverse rotation."""

import importlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rotary_testing import dist_scenarios

DEADLINE_S = 120.0  # per spawn, process start-up included
COLLECTIVE_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _worker(rank, world, init_method, out_dir, source):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    results = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for name, fn in importlib.import_module(source).scenarios(world):
            try:
                fn(mesh)
                results[name] = "ok"
            except (Exception, pytest.fail.Exception):  # recorded per scenario (a pytest.raises miss too)
                results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        dist.barrier()
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _spawn(world, out_dir, source):
    init_method = f"file://{out_dir}/init"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor", "rotary", "rotary_testing.dist_scenarios"])
    ctx = mp.start_processes(
        _worker, args=(world, init_method, str(out_dir), source), nprocs=world, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=0.2):  # raises if a rank died
            if time.monotonic() > deadline:
                pytest.fail(f"{world} ranks did not finish within {DEADLINE_S} s (hung collective?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    merged = {}
    for r in range(world):
        with open(out_dir / f"rank{r}.json") as f:
            for name, res in json.load(f).items():
                merged.setdefault(name, []).append(res)
    return merged


_RESULTS = {}


def _results(world, tmp_path_factory, source="rotary_testing.dist_scenarios"):
    """{scenario: [result per rank]} of one spawn of ``world`` ranks running
    ``source``'s scenarios(world) (a module name the ranks import)."""
    key = (source, world)
    if key not in _RESULTS:
        env = pytest.MonkeyPatch()
        env.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback: no dependence on the host name
        env.setenv("OMP_NUM_THREADS", "1")
        try:
            _RESULTS[key] = _spawn(world, tmp_path_factory.mktemp(f"world{world}"), source)
        except (Exception, pytest.fail.Exception) as e:  # every scenario of it fails, without a respawn each
            _RESULTS[key] = e
        finally:
            env.undo()
    if isinstance(_RESULTS[key], BaseException):
        pytest.fail(f"the {world} ranks failed: {_RESULTS[key]}")
    return _RESULTS[key]


@pytest.mark.parametrize(
    "world,name", [(w, n) for w in (2, 4) for n, _ in dist_scenarios.scenarios(w)], ids=lambda v: str(v)
)
def test_dtensor_rotary(world, name, tmp_path_factory):
    assert_scenario(world, name, tmp_path_factory)


def assert_scenario(world, name, tmp_path_factory, source="rotary_testing.dist_scenarios"):
    """Scenario ``name`` passed on every rank."""
    results = _results(world, tmp_path_factory, source)
    assert name in results, f"scenario {name} did not run ({world} ranks)"
    failed = [r for r in results[name] if r != "ok"]
    assert len(results[name]) == world and not failed, "\n".join(failed)


def test_rules_install_when_dtensor_is_imported():
    """``import rotary`` does not import DTensor; importing it later installs
    the rules (the forkserver above covers the other order)."""
    code = (
        "import sys, rotary, torch\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'import rotary imported DTensor'\n"
        "from torch.distributed.tensor import DTensor\n"
        "h = DTensor._op_dispatcher._custom_op_handlers\n"
        "names = ('apply_rope', 'apply_rope_qk', 'apply_rope_', 'apply_rope_qk_')\n"
        "missing = [n for n in names if getattr(torch.ops.rotary, n).default not in h]\n"
        "assert not missing, missing\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=DEADLINE_S)
