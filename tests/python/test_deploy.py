"""Deployment: rotary.library_path() for processes that load a saved program
without importing rotary, the C++ module under pickle / deepcopy / repr, and
the TorchScript refusal."""

import copy
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference, rope_reference_nd
from rotary_testing.rope_testing import assert_close_ref, make_heads
from rotary_testing.scaling_reference import ref_frequencies


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.rope = rotary.RotaryEmbedding(16, 32, interleaved=False)

    def forward(self, x, position_ids):
        q, k = self.rope(self.proj(x), x, position_ids=position_ids)
        return q @ k.transpose(-1, -2)


def test_library_path_is_librotary():
    path = rotary.library_path()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert os.path.basename(path).startswith("librotary")


def test_the_shipped_libraries_search_only_their_own_folder_and_torchs():
    """The wheel ships the build tree's libraries, whose RUNPATH held the
    link directories CMake gathered: MKL's /lib/intel64 (and two Windows
    folders) that torch's config names, and an empty entry, which the loader
    reads as the working directory: a library dropped there would be loaded."""
    import re

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    folder = os.path.dirname(rotary.library_path())
    libs = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".so")]
    assert len(libs) == 2, libs  # librotary and the extension
    for lib in libs:
        dynamic = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
        found = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dynamic)
        assert len(found) == 1, dynamic
        entries = found[0].split(":")
        assert entries[0] == "$ORIGIN" and all(entries), (lib, entries)
        for entry in entries[1:]:
            assert os.path.samefile(entry, torch_lib) or entry == _torch_cudart_dir(), (lib, entries)


def _torch_cudart_dir():
    """The folder of the CUDA runtime torch's wheel ships, where torch's own
    libraries look first (their RPATH), or None."""
    import glob

    found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so.*"))
    return os.path.realpath(os.path.dirname(found[0])) if found else None


def test_librotary_loaded_alone_finds_the_cuda_runtime_torch_loads():
    """A C++ program loads librotary before torch: its libcudart came from
    ldconfig (a toolkit's, whatever its version) or was not found, where
    torch's libraries load the copy its wheel ships."""
    lib = rotary.library_path()
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
    if "libcudart" not in needed or _torch_cudart_dir() is None:
        pytest.skip("a build without the CUDA kernels, or a torch without the wheel's CUDA runtime")
    script = ("import ctypes, sys; ctypes.CDLL(sys.argv[1]); "
              "print(*sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudart.so' in l}))")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run([sys.executable, "-c", script, lib], capture_output=True, text=True, env=env, check=True)
    loaded = out.stdout.split()
    assert len(loaded) == 1 and os.path.dirname(os.path.realpath(loaded[0])) == _torch_cudart_dir(), out.stdout


_LOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    lib, program, data = sys.argv[1:4]
    torch.ops.load_library(lib)
    ep = torch.export.load(program)
    x, ids, want = torch.load(data)
    got = ep.module()(x, ids)
    assert "rotary" not in sys.modules, "the package was imported"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("loaded and ran without importing rotary")
    """
)


def test_exported_program_runs_in_a_process_without_rotary(tmp_path):
    torch.manual_seed(0)
    block = _Block().eval()
    x = make_heads(2, 2, 6, 16, seed=11)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 20, 21, 22]], dtype=torch.int32)
    with torch.no_grad():
        want = block(x, ids)
        ep = torch.export.export(block, (x, ids))
    torch.export.save(ep, str(tmp_path / "block.pt2"))
    torch.save((x, ids, want), str(tmp_path / "data.pt"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # rotary is not importable there
    run = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, rotary.library_path(), str(tmp_path / "block.pt2"), str(tmp_path / "data.pt")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "without importing rotary" in run.stdout
    # Without the library the same program does not load: the path is what matters.
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.export.load(sys.argv[1]).module()", str(tmp_path / "block.pt2")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300,
    )
    assert bare.returncode != 0 and "rotary" in bare.stderr


@pytest.mark.parametrize("scaling", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["default", "dynamic"])
def test_cpp_module_pickle_and_deepcopy(scaling):
    m = rotary.CppRotaryEmbedding(16, 32, 500.0, False, scaling=scaling)
    x = make_heads(2, 2, 5, 16, seed=12)
    m.eval()
    for make in (lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy):
        if scaling:  # grow the dynamic table: the copy must keep that state
            m(x, 40)
            assert m.rope_state == 45 and m.freqs.shape[0] == 1  # float64 angles: row 0 alone, the rest on the fly
        twin = make(m)
        assert twin.rope_state == m.rope_state
        assert type(twin) is rotary.CppRotaryEmbedding and twin is not m
        assert (twin.dim, twin.max_seq_len, twin.theta, twin.interleaved, twin.scaling) == (
            m.dim, m.max_seq_len, m.theta, m.interleaved, m.scaling)
        assert twin.training is False
        assert torch.equal(twin.freqs, m.freqs) and torch.equal(twin.inv_freq, m.inv_freq)
        assert twin.freqs.data_ptr() != m.freqs.data_ptr()
        assert torch.equal(twin(x, 3), m(x, 3))
    assert_close_ref(pickle.loads(pickle.dumps(rotary.CppRotaryEmbedding(16, 32)))(x, 3), rope_reference(x, 3),
                     torch.float32)


def test_cpp_module_names_and_repr():
    m = rotary.CppRotaryEmbedding(16, 32, 500.0, False, scaling={"rope_type": "linear", "factor": 2.0})
    assert type(m).__module__ == "rotary" and type(m).__name__ == "CppRotaryEmbedding"
    assert repr(m) == "rotary::RotaryEmbedding(dim=16, max_seq_len=32, theta=500, interleaved=false, scaling=linear(factor=2))"
    holder = torch.nn.Sequential(m)
    assert "theta=500" in repr(holder)


def test_torchscript_is_refused_with_a_clear_error():
    with pytest.raises(RuntimeError, match=r"does not support TorchScript .*deprecated.*torch\.compile, torch\.export"):
        torch.jit.script(_Block())
    # The bound C++ modules, alone or held by a model, name themselves too.
    for m, instead in [(rotary.CppRotaryEmbedding(16, 32), r"rotary.RotaryEmbedding, the same module in Python"),
                       (rotary.KVCache(1, 2, 8, 16), r"rotary.apply_rope_with_kv_cache_ on cache tensors you hold")]:
        for target in (m, torch.nn.Sequential(m)):
            with pytest.raises(RuntimeError, match=rf"rotary.{type(m).__name__} does not support TorchScript "
                                                   rf"\(torch.jit.script is deprecated since torch 2.11\).*{instead}"):
                torch.jit.script(target)


def test_export_of_a_host_driven_rule_is_refused_by_name_where_it_cannot_trace():
    """dynamic / longrope rebuild their tables on the host from each call's
    positions: torch.export failed deep inside torch ("Cannot call numel() on
    tensor with symbolic sizes"). Refused by name with position tensors or a
    dynamic sequence; static shapes with an int start_pos export, the tables
    baked in, and match eager."""
    rope = rotary.RotaryEmbedding(16, 128, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                    "max_position_embeddings": 16})

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = rope

        def forward(self, x, ids):
            return self.rope(x, position_ids=ids)

    x = torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"its rule rebuilds the tables on the host from each call's positions, "
                                         r"which torch.export cannot trace"):
        torch.export.export(Block(), (x, torch.arange(24)[None]))

    class Static(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = rotary.RotaryEmbedding(16, 128, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                                 "max_position_embeddings": 16})

        def forward(self, x):
            return self.rope(x, 8)

    program = torch.export.export(Static(), (x,))
    eager = rotary.RotaryEmbedding(16, 128, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                     "max_position_embeddings": 16})
    got = program.module()(x)
    assert torch.equal(got, eager(x, 8))  # the baked tables are the eager module's, bit for bit
    # ... and those of the rule at the call's reach (8 + 24 = 32), re-derived in float64.
    inv = np.array(ref_frequencies(16, 10000.0, {"rope_type": "dynamic", "factor": 2.0,
                                                  "max_position_embeddings": 16}, 32)[0])
    want = rope_reference_nd(x, np.arange(8, 32)[None, None], [0] * 8, 16, inv=inv)
    assert_close_ref(got, want, torch.float32)


@pytest.mark.parametrize("angle_dtype", ["float64", "float32"])
@pytest.mark.parametrize("rule", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "factor": 4.0,
                                   "long_factor": [2.0 + j for j in range(8)], "original_max_position_embeddings": 16}],
                         ids=["dynamic", "longrope"])
def test_export_leaves_the_eager_host_driven_module_as_it_was(rule, angle_dtype):
    """export puts the buffers it traced with back: a state switched in the
    trace outlived them, and the same eager call then rotated with the old
    tables (1.4 rad off) or refused. The trace bakes its tables in and
    leaves the module's state and buffers alone."""
    class Static(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rope = rotary.RotaryEmbedding(16, 32, scaling=rule, angle_dtype=angle_dtype)

        def forward(self, x):
            return self.rope(x, 8)

    x = torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(4))
    block = Static()
    before = dict(block.rope.named_buffers())
    program = torch.export.export(block, (x,))
    assert block.rope.rope_state == 0 and all(b is before[n] for n, b in block.rope.named_buffers())
    full = dict(rule, max_position_embeddings=32) if rule["rope_type"] == "dynamic" else rule
    want = rope_reference_nd(x, np.arange(8, 32)[None, None], [0] * 8, 16,
                             inv=np.array(ref_frequencies(16, 10000.0, full, 32)[0]))
    scale = ref_frequencies(16, 10000.0, full, 32)[1]
    for got in (program.module()(x), block(x)):  # the program, then the eager module at the same reach
        assert_close_ref(got, want * scale, torch.float32)
