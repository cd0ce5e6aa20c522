"""Helpers shared by the test modules: inputs, layouts, tolerances, snapshots.
(The references themselves live in reference.py and never call rotary.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rotary_testing.reference import inv_freq, rope_reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp64", "fp16", "bf16"]
PAIRINGS = [True, False]
PAIRING_IDS = ["interleaved", "half"]

_DTYPE_NAMES = {"float32": torch.float32, "float64": torch.float64,
                "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_tolerances(path: Path) -> dict:
    """{dtype: (rtol, atol)} from tests/tolerances.txt, the one table both the
    C++ and the Python tests read (the file says why each value)."""
    table = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 3 or fields[0] not in _DTYPE_NAMES or _DTYPE_NAMES[fields[0]] in table:
            raise ValueError(f"{path}:{n}: expected a new 'dtype rtol atol' line, got {raw!r}")
        table[_DTYPE_NAMES[fields[0]]] = (float(fields[1]), float(fields[2]))
    missing = sorted(name for name, t in _DTYPE_NAMES.items() if t not in table)
    if missing:
        raise ValueError(f"{path}: no tolerance for {', '.join(missing)}")
    return table


# (rtol, atol) against the exact float64 reference computed from the *same*
# (already rounded) input values.
TOL = read_tolerances(Path(__file__).resolve().parents[1] / "tolerances.txt")

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


def op_positions(start_pos, positions, packed: bool = False):
    """A positions case written in the reference's convention
    (:func:`reference.positions_grid`: ``[]`` / ``[B]`` offsets added to
    ``start_pos + s``, ``[B, S]`` ids -- ``[T]`` when packed -- added to
    ``start_pos``) as the ops' keyword arguments ``start_pos``, ``offsets``,
    ``position_ids``."""
    if positions is None:
        return dict(start_pos=start_pos)
    is_ids = positions.dim() == 1 if packed else positions.dim() >= 2
    if not is_ids:
        return dict(start_pos=start_pos, offsets=positions)
    return dict(start_pos=0, position_ids=positions + start_pos)


# ---------------------------------------------------------------------------
# Variants: layouts, strided inputs, packed batches and their float64
# references. The references never call rotary: partial rotary is the
# reference on x[..., :r] (d = r) plus the untouched tail; a packed batch is
# the reference run on each sequence separately.
# ---------------------------------------------------------------------------
LAYOUT_NAMES = ["BHSD", "BSHD", "SBHD"]
VARLEN_LENS = [3, 0, 5, 1, 0, 4]  # empty sequences inside the batch


def layout_shape(layout, B, H, S, D):
    return {"BHSD": (B, H, S, D), "BSHD": (B, S, H, D), "SBHD": (S, B, H, D)}[layout]


def to_bhsd(x, layout):
    """The [B, H, S, D] view of a tensor in `layout` (no copy)."""
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(1, 2, 0, 3)}[layout]()


def from_bhsd(x, layout):
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(2, 0, 1, 3)}[layout]()


def random_strided(shape, dtype=torch.float32, seed=0):
    """Values of `shape` stored with a random dim order, a random padding per
    dim (so it is a slice of a larger buffer) and maybe last-dim stride 2."""
    g = gen(seed + 7919)
    n = len(shape)
    perm = torch.randperm(n, generator=g).tolist()
    pad = torch.randint(0, 2, (n,), generator=g).tolist()
    step = int(torch.randint(1, 3, (1,), generator=g))
    mult = [step if d == n - 1 else 1 for d in range(n)]
    sizes = [(shape[d] + pad[d]) * mult[d] for d in range(n)]
    buf = randn([sizes[d] for d in perm], dtype, seed)
    v = buf.permute([perm.index(d) for d in range(n)])
    for d in range(n):
        v = v.narrow(d, pad[d] * mult[d], shape[d] * mult[d])
    if step == 2:
        v = v[..., ::2]
    assert tuple(v.shape) == tuple(shape)
    return v


def ref_rope4(x, r=None, start=0, interleaved=True, positions=None, inverse=False, layout="BHSD"):
    """float64 reference of a 4-D input in `layout`: the seed rotation of dims
    [0, r) (as a head of size r) and dims [r, D) copied."""
    xb = to_bhsd(x, layout)
    r = xb.shape[-1] if r is None else r
    rot = rope_reference(xb[..., :r], start, interleaved, positions, inverse)
    out = torch.cat([rot, xb[..., r:].detach().to("cpu", torch.float64)], dim=-1)
    return from_bhsd(out, layout)


def ref_varlen(x, cu, r=None, start=0, interleaved=True, positions=None, inverse=False, seq_offsets=None):
    """float64 reference of a packed [T, H, D] batch: each sequence alone,
    token s of sequence n at local index s - cu[n] (plus seq_offsets[n]: one
    start per sequence, [num_seqs] or [1])."""
    bounds = [int(v) for v in cu]
    parts = [torch.empty((0,) + tuple(x.shape[1:]), dtype=torch.float64)]
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg = x[a:b].permute(1, 0, 2).unsqueeze(0)  # [1, H, len, D]
        if seq_offsets is not None:
            st, pos = start + int(seq_offsets[n if seq_offsets.numel() > 1 else 0]), None
        elif positions is None:
            st, pos = start, None
        elif positions.dim() == 0:  # an offset
            st, pos = start + int(positions), None
        else:  # absolute ids
            st, pos = start, positions[a:b].unsqueeze(0)
        parts.append(ref_rope4(seg, r, st, interleaved, pos, inverse)[0].permute(1, 0, 2))
    return torch.cat(parts, dim=0)


def cu_from_lens(lens, dtype=torch.int64):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=dtype)


def bits(t):
    """The raw bits of t (so NaN compares equal to itself)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_tail_is_input(out, x, r):
    """Dims past rotary_dim hold exactly the input values."""
    assert torch.equal(out[..., r:], x[..., r:])


def _inv(r):
    return torch.from_numpy(inv_freq(r))
