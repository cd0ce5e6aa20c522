"""What the argument fuzz cases (arg_cases.py) and the KV-cache cases share:
the random part of one op call (Draw), exact integer tensors and negative
views, the float64 reference, why positions must be refused, and the call
that checks the outcome (accepted: the reference; refused: every input byte
unchanged). Split from arg_cases.py, which keeps the case families.

Positions are modelled as exact Python ints (object arrays), so a value that
would wrap in a narrow dtype, or read as int64, is known to be out of range."""

from __future__ import annotations

import numpy as np
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq
from rotary_testing.reference import exact_angle, rotate_pairs_nd

from .common import DOCUMENTED, FLOATS, Finding, bits, check_close, judge_refusal, same_bits, set_kind
from .op_inputs import MODES, OPS, Builder, canonical, logical_shape, self_overlaps, share_elements

INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.int64, torch.uint32, torch.uint64]
MAX_POS = 2**60
INT64_EDGES = [2**63 - 1, 2**63 - 8, -(2**63), 2**62, -(2**62), 2**63, -(2**63) - 1]


def int_range(dt):
    i = torch.iinfo(dt)
    return i.min, i.max


def int_tensor(values, dtype, shape=None):
    """An integer tensor holding exactly `values` (Python ints in range)."""
    t = torch.tensor([int(v) for v in np.asarray(values, dtype=object).reshape(-1)], dtype=dtype)
    return t.reshape(shape if shape is not None else np.asarray(values, dtype=object).shape)


def neg_view(t, rng):
    """A view with the negative bit whose logical values are those of t: a
    conjugate's .imag (floats) or torch._neg_view of the negated storage."""
    if t.is_floating_point() and t.dtype in (torch.float32, torch.float64) and rng.random() < 0.5:
        base = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype, device=t.device)
        base[..., 1] = -t
        return torch.view_as_complex(base).conj().imag, base
    if t.dtype == torch.bool or (not t.is_floating_point() and not t.is_complex() and t.dtype != torch.int64
                                 and t.dtype != torch.int32 and t.dtype != torch.int16 and t.dtype != torch.int8):
        return None, None  # unsigned / bool: no negation to hide the values behind
    stored = -t
    return torch._neg_view(stored), stored


def logical(t):
    return None if t is None else t.detach().resolve_neg().resolve_conj().to("cpu", torch.float64).clone()


def reference(X, angle, offset, rd, interleaved, scale=1.0):
    """X float64 [B, H, S, D] (canonical, logical values); angle [B, S, rd/2]."""
    out = X.numpy().copy()
    span = out[..., offset : offset + rd]
    out[..., offset : offset + rd] = scale * rotate_pairs_nd(span, angle[:, None, :, :], interleaved)
    return torch.from_numpy(out)


class Draw:
    """The random part of one op call: shapes, dtype, layout, table."""

    def __init__(self, rng, gen, op=None, varlen=None, small_table=False):
        r = self.rng = rng
        self.gen = gen
        self.op = op or r.choice(OPS)
        self.qk, self.in_place = "qk" in self.op, self.op.endswith("_")
        self.dtype = r.choice(FLOATS)
        self.varlen = (r.random() < 0.2) if varlen is None else varlen
        self.layout = "THD" if self.varlen else r.choice(["BHSD", "BSHD", "SBHD"])
        self.B = 1 if self.varlen else r.randrange(1, 4)
        self.Hq, self.Hk = r.randrange(1, 4), r.randrange(1, 3)
        if r.random() < 0.08:  # no heads on one side: a rank of an uneven head split
            self.Hq, self.Hk = (0, self.Hk) if r.random() < 0.5 else (self.Hq, 0)
        self.S = r.choice([1, 2, 3, 5, 7]) if r.random() < 0.9 else r.choice([0, 12])
        self.D = r.choice([4, 8, 12, 16, 24])
        self.rd = r.choice([self.D, self.D] + list(range(2, self.D, 2)))
        self.offset = 0
        self.L = r.randrange(4, 12) if small_table else r.randrange(8, 40)
        self.theta = r.choice([10000.0, 500.0])
        self.interleaved, self.inverse = r.random() < 0.5, r.random() < 0.3
        self.inv = ref_inv_freq(self.rd, self.theta)
        self.table = rotary.freqs_table(self.rd, self.L, self.theta)
        self.b = Builder(rng, gen)
        self.cu, self.lens = None, None
        if self.varlen:
            cuts = sorted(r.randrange(0, self.S + 1) for _ in range(r.randrange(0, 3)))
            bounds = [0] + cuts + [self.S]
            self.lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
            self.cu = torch.tensor(bounds, dtype=r.choice([torch.int32, torch.int64]))

    def heads(self, H, mode=None):
        shape = logical_shape(self.layout, self.B, H, self.S, self.D)
        return self.b.tensor(shape, self.dtype, mode or self.rng.choice(MODES[:4]))

    def local(self):
        """int [B, S]: the index of each token within its sequence."""
        if not self.varlen:
            return np.broadcast_to(np.arange(self.S, dtype=object)[None, :], (self.B, self.S)).copy()
        loc = np.zeros((1, self.S), dtype=object)
        at = 0
        for n in self.lens:
            loc[0, at : at + n] = np.arange(n)
            at += n
        return loc

    def grid(self, start_pos, offsets=None, ids=None):
        """Exact int positions [B, S] (object array)."""
        if ids is not None:
            p = np.asarray(ids, dtype=object)
            return np.broadcast_to(p if p.ndim == 2 else p[None, :], (self.B, self.S)).copy()
        base = self.local() + start_pos
        if offsets is not None:
            o = np.asarray(offsets, dtype=object)
            base = base + (o if o.ndim == 0 else o[:, None])
        return base


def position_problem(pos, use_inv, L):
    """Why exact positions (object array, any shape) must be refused, or None."""
    flat = [int(v) for v in np.asarray(pos, dtype=object).reshape(-1)]
    if not flat:
        return None
    if min(flat) < 0:
        return "negative position"
    if max(flat) >= MAX_POS:
        return "position >= 2^60"
    if not use_inv and max(flat) >= L:
        return "position past the table"
    return None


def run_call(d: Draw, q, k, freqs, start_pos, kw, *, reasons, either=False, mention=None, angle=None,
             scale=1.0, allowed=DOCUMENTED, what="", kind="?"):
    """Calls d.op and checks the outcome. reasons: why it must be refused;
    either: a refusal or the right result both pass; mention: a refusal must
    name this argument; angle: float64 [B, S, rd/2] for an accepted call."""
    fn = getattr(rotary, d.op)
    set_kind(kind)
    label = f"{d.op}{' ' + what if what else ''}"
    saved = [bits(t) for t in d.b.buffers]
    before = [logical(t) for t in (q, k) if t is not None]
    args = (q, k, freqs) if d.qk else (q, freqs)
    try:
        out = fn(*args, start_pos, d.interleaved, **kw)
    except Finding:
        raise
    except allowed as e:
        return kind, "refused: " + judge_refusal(label, e, d.b.buffers, saved, reasons, either, mention)
    except Exception as e:  # noqa: BLE001
        raise Finding(f"{label}: undocumented {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
    if reasons:
        raise Finding(f"{label}: accepted bad input ({', '.join(reasons)})")
    outs = (out if d.qk else (out,)) if not d.in_place else ((q, k) if d.qk else (q,))
    for name, src, o, x0 in zip(("q", "k"), (q, k), outs, before):
        expected = reference(canonical(x0, d.layout), angle, d.offset, d.rd, d.interleaved, scale)
        if o.shape != src.shape or o.dtype != src.dtype:
            raise Finding(f"{label}: output {name} is {o.dtype} {tuple(o.shape)}, input {src.dtype} {tuple(src.shape)}")
        check_close(canonical(o, d.layout), expected, d.dtype, f"{label} {name}", abs(scale))
    if not d.in_place:
        for buf, s in zip(d.b.buffers, saved):
            if not same_bits(buf, s):
                raise Finding(f"{label}: out of place, but an input changed")
    else:
        for buf, s in zip(d.b.buffers, saved):
            after, restored = buf.detach().clone(), s.view(buf.dtype).clone()
            for t in (q, k):
                if t is not None and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() \
                        and t.dtype == buf.dtype:
                    o = t.storage_offset() - buf.storage_offset()
                    restored.as_strided(t.shape, t.stride(), o).copy_(after.as_strided(t.shape, t.stride(), o))
            if not torch.equal(bits(after), bits(restored)):
                raise Finding(f"{label}: in place, bytes outside q/k were written")
    return kind, "accepted"


def angles(d: Draw, pos, axes=None, sign=1.0, inv=None):
    """float64 [B, S, rd/2] from exact positions: [B, S], or [n, B, S] with axes."""
    inv = d.inv if inv is None else inv
    P = np.asarray(pos, dtype=object).astype(np.int64)
    if axes is None:
        return sign * exact_angle(P, inv)
    return sign * np.stack([exact_angle(P[a], inv[j : j + 1])[..., 0] for j, a in enumerate(axes)], axis=-1)


def _sign(d):
    return -1.0 if d.inverse else 1.0


def _overlap_reasons(d, q, k):
    out = []
    if d.in_place:
        if self_overlaps(q) or (d.qk and self_overlaps(k)):
            out.append("a written tensor overlaps itself")
        if d.qk and share_elements(q, k):
            out.append("q and k share elements")
    return out
