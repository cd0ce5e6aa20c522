"""The device axis of the tests: the ``device`` fixture (conftest.py) runs a
test on the CPU and, where one is present, on CUDA, so both backends pass the
same assertions. Tests of CUDA itself (graphs, streams) take ``needs_cuda``."""

import pytest
import torch

from .rope_testing import TOL

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def assert_matches_cpu(out, out_cpu, dtype):
    """A device result next to the CPU kernel's: one rounding apart (FMA);
    float64 shares the complex64 table and double arithmetic. On the CPU the
    two are one kernel, so only the reference checks of the caller count."""
    if out.device.type == "cpu":
        return
    rtol, atol = TOL[dtype]
    if dtype == torch.float64:
        rtol, atol = 1e-12, 1e-12
    torch.testing.assert_close(out.cpu().double(), out_cpu.double(), rtol=rtol, atol=atol)
