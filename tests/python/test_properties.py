"""Property-based tests (hypothesis): random valid calls of every op against
the independent float64 reference (reference.py).

Each example draws: an entry point (apply_rope, apply_rope_qk, their in-place
forms, or the Python / C++ module), dtype, layout (BHSD / BSHD / SBHD, or
packed varlen THD with random cu_seqlens, int32 or int64, empty sequences
allowed), sizes (B, H, S small; head_dim even up to 256; q and k head counts
independent), storage (contiguous, a random dim order, padding so the input
is a slice of a larger buffer, last-dim stride 2, q and k as head slices of
one packed qkv buffer), pairing, positions (none, 0-d offset, [B] / [1]
offsets, [B, S] / [1, S] / [B, 1] ids; with cu_seqlens none, 0-d or [T]),
start_pos, rotary_dim <= head_dim, inverse, theta, and a table that covers
every position or a short one plus inv_freq (positions past it computed on
the fly).

Properties checked for every example:
* values: the reference on the first rotary_dim dims (per sequence when
  packed), at the dtype's tolerance (rope_testing.TOL);
* the tail past rotary_dim is the input, bit for bit;
* out of place: every input buffer is bitwise unchanged, the output has the
  input's shape and dtype;
* in place: the result is in the input tensors, and every element of the
  underlying buffer that is not part of q / k (padding, v, the other half of
  a step-2 view) is bitwise unchanged.

CI runs 500 examples, derandomized (the same examples every run). Soak with
ROTARY_HYPOTHESIS_EXAMPLES=20000. A failure prints the shrunk example and,
through note(), the call it made.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import TOL, op_positions

EXAMPLES = int(os.environ.get("ROTARY_HYPOTHESIS_EXAMPLES", "500"))

PROFILE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ENTRIES = ["apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_", "module", "cpp_module"]
HEAD_AXIS = {"BHSD": 1, "BSHD": 2, "SBHD": 2, "THD": 1}


def layout_shape(layout, B, H, S, D):
    return {"BHSD": (B, H, S, D), "BSHD": (B, S, H, D), "SBHD": (S, B, H, D), "THD": (S, H, D)}[layout]


def to_bhsd(x, layout):
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(1, 2, 0, 3)}[layout]()


def from_bhsd(x, layout):
    return {"BHSD": lambda: x, "BSHD": lambda: x.transpose(1, 2), "SBHD": lambda: x.permute(2, 0, 1, 3)}[layout]()


# ---------------------------------------------------------------------------
# References (float64; never call rotary)
# ---------------------------------------------------------------------------
def ref4(x, r, start, interleaved, positions, inverse, theta, layout):
    xb = to_bhsd(x, layout)
    rot = rope_reference(xb[..., :r], start, interleaved, positions, inverse, theta)
    return from_bhsd(torch.cat([rot, xb[..., r:].detach().to("cpu", torch.float64)], -1), layout)


def ref_varlen(x, cu, r, start, interleaved, positions, inverse, theta):
    bounds = [int(v) for v in cu]
    out = torch.empty(x.shape, dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        seg = x[a:b].permute(1, 0, 2).unsqueeze(0)  # [1, H, len, D]
        if positions is None:
            st_, pos = start, None
        elif positions.dim() == 0:
            st_, pos = start + int(positions), None
        else:
            st_, pos = start, positions[a:b].unsqueeze(0)
        out[a:b] = ref4(seg, r, st_, interleaved, pos, inverse, theta, "BHSD")[0].permute(1, 0, 2)
    return out


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------
@st.composite
def storages(draw, ndim):
    """How a buffer is laid out: a dim order, padding per dim, last-dim step."""
    kind = draw(st.sampled_from(["contiguous", "permuted", "padded", "step2", "all"]))
    perm = list(range(ndim))
    pad = [0] * ndim
    step = 1
    if kind in ("permuted", "all"):
        perm = draw(st.permutations(list(range(ndim))))
    if kind in ("padded", "all"):
        pad = draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim))
    if kind in ("step2", "all"):
        step = 2
    return {"kind": kind, "perm": list(perm), "pad": pad, "step": step}


def make_buffer(shape, storage, dtype, g):
    """(base, view): `view` has `shape` and lives inside `base` as `storage` says."""
    n = len(shape)
    mult = [storage["step"] if d == n - 1 else 1 for d in range(n)]
    sizes = [(shape[d] + storage["pad"][d]) * mult[d] for d in range(n)]
    perm = storage["perm"]
    base = torch.randn([sizes[d] for d in perm], generator=g).to(dtype)
    v = base.permute([perm.index(d) for d in range(n)])
    for d in range(n):
        v = v.narrow(d, storage["pad"][d] * mult[d], shape[d] * mult[d])
    if storage["step"] == 2:
        v = v[..., ::2]
    assert tuple(v.shape) == tuple(shape)
    return base, v


@st.composite
def cases(draw):
    entry = draw(st.sampled_from(ENTRIES))
    module = entry in ("module", "cpp_module")
    qk = entry in ("apply_rope_qk", "apply_rope_qk_") or (module and draw(st.booleans()))
    in_place = entry.endswith("_")
    dtype = draw(st.sampled_from(DTYPES))
    layout = "BHSD" if module else draw(st.sampled_from(["BHSD", "BSHD", "SBHD", "THD"]))
    varlen = layout == "THD"
    half = draw(st.one_of(st.integers(1, 8), st.integers(1, 128)))
    D = 2 * half
    r = 2 * draw(st.integers(1, half))
    Hq = draw(st.integers(1, 3))
    Hk = draw(st.integers(1, 3))
    interleaved = draw(st.booleans())
    inverse = False if module else draw(st.booleans())
    theta = draw(st.sampled_from([10000.0, 500000.0, 100.0]))
    start = draw(st.integers(0, 20))
    if varlen:
        lens = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        B, S = 1, sum(lens)
        cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        pos_kind = draw(st.sampled_from(["none", "offset", "ids"]))
    else:
        lens, cu_dtype = None, None
        B, S = draw(st.integers(1, 3)), draw(st.integers(0, 6))
        pos_kind = draw(st.sampled_from(["none", "offset", "batch", "batch1", "ids", "ids_b1", "ids_s1"]))
    packed = qk and draw(st.booleans())
    ndim = 3 if varlen else 4
    storage_q = draw(storages(ndim))
    storage_k = storage_q if packed else draw(storages(ndim))
    # Table: covers every position, or is short and inv_freq computes the rest
    # (the modules always pass their inv_freq).
    past_table = module or draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(
        entry=entry, qk=qk, in_place=in_place, dtype=dtype, layout=layout, varlen=varlen, lens=lens,
        cu_dtype=cu_dtype, B=B, S=S, Hq=Hq, Hk=Hk, D=D, r=r, interleaved=interleaved, inverse=inverse,
        theta=theta, start=start, pos_kind=pos_kind, packed=packed, storage_q=storage_q,
        storage_k=storage_k, past_table=past_table, seed=seed,
    )


def make_positions(c, g):
    B, S, kind = c["B"], c["S"], c["pos_kind"]
    hi = 40  # offsets / ids in [0, hi)
    if kind == "none":
        return None
    if kind == "offset":
        return torch.randint(0, hi, (), generator=g)
    if kind == "batch":
        return torch.randint(0, hi, (B,), generator=g)
    if kind == "batch1":
        return torch.randint(0, hi, (1,), generator=g)
    if kind == "ids":
        return torch.randint(0, hi, (S,) if c["varlen"] else (B, S), generator=g)
    if kind == "ids_b1":
        return torch.randint(0, hi, (1, S), generator=g)
    if kind == "ids_s1":
        return torch.randint(0, hi, (B, 1), generator=g)
    raise ValueError(kind)


def max_position(c, positions):
    longest = max(c["lens"], default=0) if c["varlen"] else c["S"]
    top = c["start"] + max(longest - 1, 0)
    if positions is not None and positions.numel() > 0:
        ids = c["pos_kind"].startswith("ids")
        top = c["start"] + int(positions.max()) + (0 if ids else max(longest - 1, 0))
    return top


# ---------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------
@PROFILE
@given(cases())
def test_random_calls_match_reference(c):
    note(f"case: {c}")
    g = torch.Generator().manual_seed(c["seed"])
    dtype, layout, r = c["dtype"], c["layout"], c["r"]
    shape_q = layout_shape(layout, c["B"], c["Hq"], c["S"], c["D"])
    shape_k = layout_shape(layout, c["B"], c["Hk"], c["S"], c["D"])
    if c["packed"]:
        axis = HEAD_AXIS[layout]
        full = list(shape_q)
        full[axis] = c["Hq"] + c["Hk"] + 1  # q, k, v heads in one buffer
        base, buf = make_buffer(full, c["storage_q"], dtype, g)
        q = buf.narrow(axis, 0, c["Hq"])
        k = buf.narrow(axis, c["Hq"], c["Hk"])
        bases = [base]
    else:
        base_q, q = make_buffer(shape_q, c["storage_q"], dtype, g)
        bases = [base_q]
        k = None
        if c["qk"]:
            base_k, k = make_buffer(shape_k, c["storage_k"], dtype, g)
            bases.append(base_k)
    positions = make_positions(c, g)
    cu = None
    if c["varlen"]:
        cu = torch.tensor([0] + np.cumsum(c["lens"]).tolist(), dtype=c["cu_dtype"])
    top = max_position(c, positions)
    if c["past_table"]:
        rows = int(torch.randint(1, 8, (), generator=g))
        inv_freq = rotary.inv_frequencies(r, c["theta"])[0]
    else:
        rows, inv_freq = top + 1 + int(torch.randint(0, 4, (), generator=g)), None
    note(f"q {tuple(q.shape)} strides {q.stride()}, k {None if k is None else (tuple(k.shape), k.stride())}, "
         f"positions {positions}, cu_seqlens {cu}, table rows {rows}, inv_freq {inv_freq is not None}, top {top}")

    # The expected values, from the untouched inputs.
    def ref(t):
        if c["varlen"]:
            return ref_varlen(t, cu, r, c["start"], c["interleaved"], positions, c["inverse"], c["theta"])
        return ref4(t, r, c["start"], c["interleaved"], positions, c["inverse"], c["theta"], layout)

    want_q = ref(q)
    want_k = ref(k) if k is not None else None
    saved_q, saved_k = q.clone(), (k.clone() if k is not None else None)
    saved_bases = [b.clone() for b in bases]

    pos_kw = op_positions(c["start"], positions, packed=c["varlen"])
    kw = dict(inverse=c["inverse"], cu_seqlens=cu, inv_freq=inv_freq, layout=layout, **pos_kw)
    entry = c["entry"]
    if entry in ("module", "cpp_module"):
        make = rotary.RotaryEmbedding if entry == "module" else rotary.CppRotaryEmbedding
        rope = make(r, rows, c["theta"], c["interleaved"])
        outs = rope(q, k, **pos_kw) if k is not None else (rope(q, **pos_kw),)
    else:
        freqs = rotary.freqs_table(r, rows, c["theta"])
        fn = getattr(rotary, entry)
        if k is not None:
            outs = fn(q, k, freqs, interleaved=c["interleaved"], **kw)
        else:
            outs = (fn(q, freqs, interleaved=c["interleaved"], **kw),)
    outs = tuple(outs)
    inputs = (q, k) if k is not None else (q,)
    wants = (want_q, want_k) if k is not None else (want_q,)
    saved = (saved_q, saved_k) if k is not None else (saved_q,)

    rtol, atol = TOL[dtype]
    for out, x, want, x0 in zip(outs, inputs, wants, saved):
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.to(torch.float64), want, rtol=rtol, atol=atol)
        assert torch.equal(out[..., r:], x0[..., r:])  # tail passed through bit for bit
        if c["in_place"]:
            assert out is x
    if c["in_place"]:
        # Everything in the buffers that is not q or k is bitwise unchanged.
        for b, b0 in zip(bases, saved_bases):
            assert b.is_contiguous() and b.storage_offset() == 0
            touched = torch.zeros_like(b, dtype=torch.bool)  # same element offsets as b
            for x in inputs:
                if x.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                    touched.as_strided(x.shape, x.stride(), x.storage_offset()).fill_(True)
            assert torch.equal(b[~touched], b0[~touched])
    else:
        for b, b0 in zip(bases, saved_bases):
            assert torch.equal(b, b0)


def test_example_count_is_at_least_500_in_ci():
    assert EXAMPLES >= 500 or "ROTARY_HYPOTHESIS_EXAMPLES" in os.environ
