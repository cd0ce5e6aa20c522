"""Outcomes, bitwise snapshots and tolerances shared by the case families."""

from __future__ import annotations

import math
import os

import torch
import torch.autograd.forward_ad as fwAD
from rotary_testing.rope_testing import TOL  # noqa: F401 - (rtol, atol) per dtype, from tests/tolerances.txt (both suites)

# Where the op cases put q, k and the tables ("cuda" on a GPU machine).
DEVICE = os.environ.get("ROTARY_FUZZ_DEVICE", "cpu")

# The exception types rotary documents for bad input (TORCH_CHECK_VALUE /
# _TYPE / _INDEX in C++). Anything else escaping a call is a finding.
DOCUMENTED = (ValueError, TypeError, IndexError)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# The category of the case running now, so a Finding can be counted under it.
current = {"kind": "?"}


def set_kind(kind: str) -> str:
    current["kind"] = kind
    return kind


class Finding(Exception):
    """A wrong result, an undocumented exception, garbage accepted, a valid
    input refused, or state changed by a refused call."""


class Refused(Exception):
    """A documented refusal (the expected outcome of a bad input)."""


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bitwise copy (NaN-safe: compared as integers)."""
    t = t.detach()
    if t.device.type == "meta":
        return t
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.clone().view(_BITS[t.element_size()])


def same_bits(a: torch.Tensor, saved: torch.Tensor) -> bool:
    now = bits(a)
    return now.shape == saved.shape and now.dtype == saved.dtype and bool(torch.equal(now, saved))


def expect_refusal(call, allowed=DOCUMENTED, what="call"):
    """Run call; a documented refusal raises Refused, anything else Finding."""
    try:
        call()
    except allowed as e:
        raise Refused(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    except Finding:
        raise
    except Exception as e:  # noqa: BLE001 - every other type is the finding
        raise Finding(f"{what}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None


def check_close(actual: torch.Tensor, expected: torch.Tensor, dtype, what: str, scale: float = 1.0, atol_extra=0.0):
    rtol, atol = TOL[dtype]
    a = actual.detach().to("cpu", torch.float64)
    if a.shape != expected.shape:
        raise Finding(f"{what}: shape {tuple(a.shape)}, reference {tuple(expected.shape)}")
    if a.numel() == 0:
        return
    if not bool(torch.isfinite(a).all()):
        raise Finding(f"{what}: {int((~torch.isfinite(a)).sum())} non-finite outputs from finite inputs")
    err = (a - expected).abs()
    bound = atol * max(scale, 1.0) + atol_extra + rtol * expected.abs()
    if bool((err > bound).any()):
        raise Finding(f"{what}: off the float64 reference by up to {float(err.max()):.3g}")


def finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def judge_refusal(label, e, buffers, saved, reasons, either=False, mention=None) -> str:
    """A documented refusal: every input byte-identical, the call really bad
    (unless either outcome is allowed), and the message naming `mention`.
    Returns the refusal's one-line summary."""
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for buf, s in zip(buffers, saved):
        if not same_bits(buf, s):
            raise Finding(f"{label}: refused ({msg}) but changed the bytes of an input") from None
    if not reasons and not either:
        raise Finding(f"{label}: refused a valid call with {msg}") from None
    if mention and mention not in str(e):
        raise Finding(f"{label}: refusal does not name {mention}: {msg}") from None
    return msg


def check_vmap(rng, gen, fn, inputs, rest, kw, in_place, reference, check):
    """torch.func.vmap of fn(q[, k], *rest, **kw) over two slices: the drawn
    inputs and fresh ones stacked at a random dim (out of place, k may be
    shared). Every slice's outputs against reference(name, its input)."""
    dim = rng.randrange(inputs[0].dim() + 1)
    shared_k = len(inputs) == 2 and not in_place and rng.random() < 0.3
    stacked = [torch.stack([t.detach(), torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)], dim)
               for t in (inputs[:1] if shared_k else inputs)]
    before = [t.clone() for t in stacked]

    def one(*ts):
        return fn(*ts, *((inputs[1].detach(),) if shared_k else ()), *rest, **kw)

    got = torch.func.vmap(one, in_dims=dim)(*stacked)
    got = got if isinstance(got, tuple) else (got,)
    for i in range(2):
        sources = [t.select(dim, i) for t in before] + ([inputs[1].detach()] if shared_k else [])
        for name, src, o in zip(("q", "k"), sources, got):
            check(o[i], reference(name, src), f"{name} slice {i} (stacked at dim {dim})")


def check_tangents(gen, fn, inputs, rest, kw, in_place, reference, check):
    """Forward mode of fn(q[, k], *rest, **kw): each input made dual with a
    random tangent (in place: copies of the inputs), each output's tangent
    against reference(name, primal, tangent) of the input's values before
    the call (float64, on the CPU). The references run outside the dual
    level, so one may use torch.func.jvp."""
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t.detach().clone() if in_place else t.detach(),
                                torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)) for t in inputs]
        was = [tuple(x.to("cpu", torch.float64, copy=True) for x in fwAD.unpack_dual(d)) for d in duals]
        out = fn(*duals, *rest, **kw)
        got = [fwAD.unpack_dual(o).tangent for o in (out if isinstance(out, tuple) else (out,))]
        got = [None if g is None else g.clone() for g in got]
    for name, g, (x, t) in zip(("q", "k"), got, was):
        if g is None:
            raise Finding(f"forward mode gave {name}'s output no tangent")
        check(g, reference(name, x, t), f"tangent {name}")
