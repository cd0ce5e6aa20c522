"""Shared pytest setup for the rotary Python suite.

Run from the repository root after ``make build``:

    PYTHONPATH=python .venv/bin/python -m pytest -q tests/python
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG = os.path.normpath(os.path.join(_HERE, "..", "..", "python"))
# The in-tree package (python/rotary with the built _C*.so), even without
# PYTHONPATH -- unless PYTHONPATH names another build of it (a separate build
# directory's package), which then wins.
_ENV_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if _PKG not in sys.path and not any(os.path.isdir(os.path.join(p, "rotary")) for p in _ENV_PATHS):
    sys.path.insert(0, _PKG)

import torch  # noqa: E402
from rotary_testing.devices import DEVICES  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    # A test skipped for want of a CUDA device carries the cuda mark, so that
    # -k cuda (the GPU run's selection) finds it whatever its name.
    for item in items:
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _seed_everything():
    # Every test also builds its inputs from explicit generators; this only
    # pins anything else that draws from the global RNG.
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="module")
def tables():
    """tables(rotary_dim, max_seq_len=32): rotary.freqs_table, cached per module."""
    import rotary  # here, not at import: some modules never load the extension

    cache = {}

    def get(rotary_dim, max_seq_len=32):
        key = (rotary_dim, max_seq_len)
        if key not in cache:
            cache[key] = rotary.freqs_table(rotary_dim, max_seq_len)
        return cache[key]

    return get


@pytest.fixture
def reset_dynamo():
    """torch._dynamo.reset() after the test (the variants modules use it for
    every test: pytestmark = pytest.mark.usefixtures("reset_dynamo"))."""
    yield
    torch._dynamo.reset()


@pytest.fixture(params=DEVICES)
def device(request):
    """The backend under test: every test that takes it runs on the CPU and,
    with a GPU, on CUDA (rotary_testing.devices)."""
    return request.param
