"""Helpers shared by the test modules: inputs, layouts, tolerances, snapshots.
(The references themselves live in reference.py and never call rotary.)"""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp64", "fp16", "bf16"]
PAIRINGS = [True, False]
PAIRING_IDS = ["interleaved", "half"]

# (rtol, atol) against the exact float64 reference computed from the *same*
# (already rounded) input values.
#   fp32: table is complex64 (~6e-8) plus a few fp32 roundings.
#   fp64: the complex64 table limits it to ~1e-7 relative.
#   fp16/bf16: one rounding of the exact result (half an ulp = 2**-11 / 2**-8
#   relative); the bounds below allow one full ulp.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-6, 1e-6),
    torch.float16: (2.0**-10, 1e-5),
    torch.bfloat16: (2.0**-7, 1e-5),
}

LAYOUTS = ["contiguous", "transposed", "stride2", "qkv_slice", "permuted"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype=torch.float32, seed=0, device="cpu") -> torch.Tensor:
    """Standard normal values (never all zeros), drawn in float32 on the CPU
    with a fixed seed, then cast and moved."""
    t = torch.randn(tuple(shape), generator=gen(seed), dtype=torch.float32)
    return t.to(dtype).to(device)


def make_heads(B, H, S, D, dtype=torch.float32, layout="contiguous", seed=0, device="cpu"):
    """A [B, H, S, D] tensor with the requested memory layout."""
    if layout == "contiguous":
        x = randn((B, H, S, D), dtype, seed, device)
    elif layout == "transposed":  # [B, S, H, D] storage, as after a projection
        x = randn((B, S, H, D), dtype, seed, device).transpose(1, 2)
    elif layout == "stride2":  # last-dim stride 2
        x = randn((B, H, S, 2 * D), dtype, seed, device)[..., ::2]
    elif layout == "qkv_slice":  # the middle third of a packed [B, S, 3H, D]
        x = randn((B, S, 3 * H, D), dtype, seed, device)[:, :, H : 2 * H].transpose(1, 2)
    elif layout == "permuted":  # [H, S, B, D] storage
        x = randn((H, S, B, D), dtype, seed, device).permute(2, 0, 1, 3)
    else:
        raise ValueError(layout)
    assert x.shape == (B, H, S, D)
    if layout != "contiguous" and x.numel() > 1 and H > 1 and S > 1:
        assert not x.is_contiguous()
    return x


def make_packed_qkv(B, S, H, D, dtype=torch.float32, seed=0, device="cpu"):
    """q, k, v as [B, H, S, D] views of one packed [B, S, 3H, D] tensor."""
    packed = randn((B, S, 3 * H, D), dtype, seed, device)
    q, k, v = packed.transpose(1, 2).split(H, dim=1)
    return packed, q, k, v


def positions_tensor(kind: str, B: int, S: int, room: int, seed: int = 0, device="cpu"):
    """int64 positions of the given kind. ``room`` bounds every resulting
    offset / id so that start_pos + position stays inside the table."""
    g = gen(seed)
    if kind == "none":
        return None
    if kind == "scalar":
        p = torch.tensor(min(3, room - S))
    elif kind == "batch":
        p = torch.randint(0, room - S + 1, (B,), generator=g)
    elif kind == "batch1":
        p = torch.tensor([room - S])
    elif kind == "ids":
        p = torch.randint(0, room, (B, S), generator=g)
    elif kind == "ids_b1":
        p = torch.randint(0, room, (1, S), generator=g)
    elif kind == "ids_s1":
        p = torch.randint(0, room, (B, 1), generator=g)
    elif kind == "ids_noncontig":
        p = torch.randint(0, room, (S, B), generator=g).t()
    else:
        raise ValueError(kind)
    return p.to(torch.int64).to(device)


class Snapshot:
    """Clones tensors now; ``check()`` asserts they are bit-for-bit unchanged."""

    def __init__(self, *tensors):
        # meta tensors hold no values to compare
        self.items = [
            (t, t.detach().clone()) for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"
        ]

    def check(self):
        for i, (t, saved) in enumerate(self.items):
            assert t.dtype == saved.dtype and t.shape == saved.shape, f"input {i} changed shape/dtype"
            assert torch.equal(t.detach(), saved), f"input {i} was modified in place"


def assert_close_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = ""):
    """``out`` (any device) against the float64 reference, at the dtype's tolerance."""
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.detach().to("cpu", torch.float64), ref, rtol=rtol, atol=atol, msg=msg or None)


def poison_allocator(numel: int, dtype: torch.dtype, device="cpu", count: int = 4):
    """Leave NaN-filled blocks of the output's size in the allocator, so an
    output element the kernel forgets to write is likely NaN, not a stale
    plausible value. Best effort on the CPU; reliable with CUDA's caching
    allocator."""
    blocks = [torch.full((max(numel, 1),), float("nan"), dtype=dtype, device=device) for _ in range(count)]
    del blocks
