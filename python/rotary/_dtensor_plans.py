"""The DTensor rules' fast path. A call whose rule came out trivial (each
rank runs the plain op on the local tensors, every option as given, and no
whole-call value check) is remembered by everything the rule read: the
specs, local shapes, strides and types, the options' shapes and values. The
next call alike skips the rule (binding, placement checks, the Meta call on
the global shapes) and runs the local call, as the rule would have.

start_pos is the one value a plan leaves open, so a decode loop hits: on a
trivial plan no dim along tokens is cut, so the local call sees the whole
sequence and refuses a bad start_pos as the global check would, on every
rank alike. Tensors' values (positions, slots) are the op's own to check in
both paths."""

import torch

from ._dtensor_shards import out_spec

_PLANS = {}  # key -> output specs ((spec, local stride, dtype), ...); () for in-place ops
_START_POS = {}  # op -> index of start_pos in its schema (None: none)
_PLANS_MAX = 1024
_OPEN = object()  # start_pos in a key


def _start_pos_index(op):
    i = _START_POS.get(op, -1)
    if i == -1:
        names = [a.name for a in op._schema.arguments]
        i = _START_POS[op] = names.index("start_pos") if "start_pos" in names else None
    return i


_DT = []  # [DTensor], imported on first use (DTensor called us: already loaded)


def _dtensor():
    if not _DT:
        from torch.distributed.tensor import DTensor

        _DT.append(DTensor)
    return _DT[0]


def _part(v, DTensor):
    """What the rule reads of one argument; None where a plan cannot say."""
    if isinstance(v, DTensor):
        t = v._local_tensor
        if type(t) is not torch.Tensor:  # fake / functional tensors under tracing: the rule runs
            return None
        return (v._spec, t.shape, t.stride(), v.requires_grad)
    if isinstance(v, torch.Tensor):
        if type(v) is not torch.Tensor:
            return None
        return (v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
    if v is None or type(v) in (bool, int, float, str):
        return (type(v), v)
    if type(v) in (list, tuple) and all(type(e) in (bool, int, float, str) for e in v):
        return (type(v), tuple(v))
    return None


def plan_key(op, args, kwargs):
    """The call's key, or None when it cannot have a plan."""
    DTensor = _dtensor()
    start = _start_pos_index(op)
    key = [op]
    for i, v in enumerate(args):
        if i == start and type(v) is int:
            key.append(_OPEN)
            continue
        p = _part(v, DTensor)
        if p is None:
            return None
        key.append(p)
    for n, v in kwargs.items():
        if n == "start_pos" and type(v) is int:
            key.append((n, _OPEN))
            continue
        p = _part(v, DTensor)
        if p is None:
            return None
        key.append((n, p))
    return tuple(key)


def is_trivial(bound, local):
    """Whether the rule's local call is the plain op on the local tensors,
    every other argument as given."""
    DTensor = _dtensor()
    for n, v in bound.items():
        want = v._local_tensor if isinstance(v, DTensor) else v
        if local.get(n) is not want and not (n == "start_pos" and local.get(n) == v):
            return False
    return len(local) == len(bound)


def remember(key, outs):
    """outs: the wrapped outputs (a DTensor, a tuple of them, or None)."""
    if key is None:
        return
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    outs = () if outs is None else (outs,) if isinstance(outs, torch.Tensor) else outs
    _PLANS[key] = tuple((o._spec, o._local_tensor.stride(), o.dtype) for o in outs)


def run(op, args, kwargs, key):
    """The remembered call's outputs, or MISS when there is no plan."""
    specs = _PLANS.get(key) if key is not None else None
    if specs is None:
        return MISS
    DTensor = _dtensor()
    out = op(*[a._local_tensor if isinstance(a, DTensor) else a for a in args],
             **{n: v._local_tensor if isinstance(v, DTensor) else v for n, v in kwargs.items()})
    if not specs:
        return out
    outs = (out,) if isinstance(out, torch.Tensor) else out
    wrapped = []
    for t, (spec, stride, dtype) in zip(outs, specs):
        if t.stride() != stride or t.dtype != dtype:  # not as remembered: a spec of its own, the plan forgotten
            _PLANS.pop(key, None)
            spec = out_spec(spec, t)
        wrapped.append(DTensor(t, spec, requires_grad=False))
    return wrapped[0] if isinstance(out, torch.Tensor) else tuple(wrapped)


MISS = object()
