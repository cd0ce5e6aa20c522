"""What the benchmark scripts share: the cases, the eager references (the
peers ours is checked against before it is timed), the device sync, and the
kernel peers that are imported or loaded when present (Liger, FlashInfer)."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Tuple

import torch


DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_shape: Tuple[int, int, int, int]
    k_shape: Tuple[int, int, int, int]
    decode: bool = False


CPU_CASES = [
    Case("prefill", (1, 32, 4096, 128), (1, 8, 4096, 128)),
    Case("training", (4, 32, 1024, 128), (4, 32, 1024, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
]
# GPU: the large cases run in both layouts, both pairings, out of place and in
# place (see run_cuda); decode is timed against one torch.add launch.
CUDA_CASES = [
    Case("prefill", (1, 32, 8192, 128), (1, 8, 8192, 128)),
    Case("training", (8, 32, 2048, 128), (8, 32, 2048, 128)),
    Case("long", (1, 64, 32768, 128), (1, 8, 32768, 128)),
    Case("decode", (64, 32, 1, 128), (64, 8, 1, 128), decode=True),
]
QUICK_CASE = Case("quick", (1, 4, 64, 64), (1, 2, 64, 64))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# References (the peers). They take the complex64 table `freqs` [max_seq, D/2].


def reference_rope(x: torch.Tensor, freqs: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """The reference formula: complex multiply via view_as_complex, fp32 math."""
    batch, n_head, seq_len, head_dim = x.shape
    seq_freqs = freqs[start_pos : start_pos + seq_len]
    x_complex = torch.view_as_complex(x.float().reshape(batch, n_head, seq_len, -1, 2))
    x_rotated = x_complex * seq_freqs.unsqueeze(0).unsqueeze(0)
    return torch.view_as_real(x_rotated).reshape(batch, n_head, seq_len, head_dim).type_as(x)


def reference_rope_qk(q, k, freqs, start_pos: int = 0):
    return reference_rope(q, freqs, start_pos), reference_rope(k, freqs, start_pos)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope_qk(q, k, cos, sin):
    """Hugging Face apply_rotary_pos_emb with cos/sin [S, D] in x's dtype."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_tables(freqs: torch.Tensor, seq: int, dtype: torch.dtype, start_pos: int = 0):
    f = freqs[start_pos : start_pos + seq]
    cos = torch.cat((f.real, f.real), dim=-1).to(dtype).contiguous()
    sin = torch.cat((f.imag, f.imag), dim=-1).to(dtype).contiguous()
    return cos, sin


# --------------------------------------------------------------------------
# Timing


class Timer:
    """The device's sync, for the protocol's wall-clock samples."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()



def case_bytes(case: Case, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in case.q_shape:
        n *= s
    m = 1
    for s in case.k_shape:
        m *= s
    return 2 * (n + m) * elem


def fmt_time(s: float) -> str:
    if s >= 1e-1:
        return f"{s * 1e3:.1f} ms"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# --------------------------------------------------------------------------
# Kernel peers, when present


def liger_fn():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:
        return None
    return liger_rotary_pos_emb



# benchmarks/peers/build_flashinfer.py builds it on a machine with network.
FLASHINFER_LIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers", "lib",
                              "rotary_flashinfer_peer.so")


@functools.lru_cache(maxsize=None)  # loaded once per process, not once per row
def flashinfer_ops():
    """torch.ops.rotary_peers (FlashInfer's RoPE kernels: flashinfer_peer.cu),
    or None with the reason when it is not built or does not load."""
    if not os.path.exists(FLASHINFER_LIB):
        return None, "not built (benchmarks/peers/build_flashinfer.py)"
    try:
        torch.ops.load_library(FLASHINFER_LIB)
    except Exception as e:  # noqa: BLE001 (a peer that does not load is named, not fatal)
        return None, f"does not load: {type(e).__name__}: {str(e)[:120]}"
    return torch.ops.rotary_peers, ""


def flashinfer_table(freqs: torch.Tensor) -> torch.Tensor:
    """FlashInfer's cos_sin_cache [positions, rotary_dim] float32 (cos, then
    sin) from a complex64 table [positions, rotary_dim / 2]."""
    return torch.cat((freqs.real, freqs.imag), dim=-1).float().contiguous()
