"""``torch.func.vmap`` of the ops: a batching rule for each, on the
FuncTorchBatched key (installed at import).

Where only q, k or x carry the vmapped dim (positions, tables and weights
shared by every slice), the rule folds that dim into their heads and makes
one call: a rotation never depends on the head. Elsewhere (a batched table,
position, weight, cache or fp8 scale, or the norm over all heads) it makes
one call per slice. Should the folded call fail, the calls per slice run
instead, so that an error names the shapes the caller passed.

In place, the fold must be a view of every tensor it writes (else the op's
own overlap checks would see copies): otherwise the calls per slice run.
Those first check the op's aliasing rule over the whole batch (a slice
would otherwise write what another reads or writes: an expanded vmapped
dim, slice i of k as slice j of v), then every slice on copies, before they
write any, so that a refusal (say, one slice's positions past the table)
leaves every tensor untouched.
An in-place op whose written tensor is not batched while another input is
is refused: every slice would write the same tensor.
"""

import torch
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

from . import _C

_DATA = ("x", "q", "k")  # the tensors whose vmapped dim folds into their heads
_UNFOLDED = object()  # _fold's answer where the calls per slice must run
_LIB = None


def _lower():
    """Calls below the current vmap level (the rule's own batching off)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched))


class _Rule:
    def __init__(self, name: str):
        self.name = name
        self.op = getattr(torch.ops.rotary, name).default
        args = self.op._schema.arguments
        self.names = [a.name for a in args]
        self.written = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
        self.data = [n for n in self.names if n in _DATA]  # in the order of the outputs
        self.foldable = "k_cache" not in self.names  # the cache ops run per slice

    def _call(self, values):
        return self.op(**values)  # every argument by name, as the caller's were

    def __call__(self, keyset, *args, **kwargs):
        interpreter = retrieve_current_functorch_interpreter()
        level, size = interpreter.level(), interpreter.batch_size()
        values = dict(zip(self.names, args), **kwargs)
        dims = {}
        for n, v in values.items():
            if isinstance(v, torch.Tensor):
                values[n], d = _unwrap_batched(v, level)
                if d is not None:
                    dims[n] = d
        if not dims:
            with _lower():
                return self._call(values)
        for n in self.written:
            if n not in dims:
                raise RuntimeError(
                    f"vmap: rotary::{self.name} writes {n} in place, but {n} is not batched while "
                    f"{', '.join(dims)} {'is' if len(dims) == 1 else 'are'}: every slice would write the same "
                    f"{n}. Batch {n} too" + ("" if "cache" in self.name else ", or call the out-of-place op"))
        if self.foldable and set(dims) <= set(self.data) and values.get("norm", "head") == "head":
            try:
                out = self._fold(values, dims, size, level)
            except Exception:  # noqa: BLE001 (the calls per slice raise it with the caller's shapes)
                out = _UNFOLDED
            if out is not _UNFOLDED:
                return out
        return self._per_slice(values, dims, size, level)

    def _fold(self, values, dims, size, level):
        """One call, the vmapped dim folded into the heads (outer to them)."""
        axis = _C.heads_axis(values.get("layout", "BHSD"), values.get("cu_seqlens") is not None)
        folded, moved = dict(values), {}
        for n, d in dims.items():
            moved[n] = values[n].movedim(d, axis)  # [..., V, heads, ...]
            folded[n] = moved[n].flatten(axis, axis + 1)
        if any(not folded[n]._is_view() for n in self.written):  # a copy: its writes would be lost
            return _UNFOLDED
        scale = values.get("q_fp8_scale")
        if "q" in dims and scale is not None and scale.dim() == 1 and scale.numel() > 1:
            folded["q_fp8_scale"] = scale.repeat(size)  # per q head, each slice's heads alike
        with _lower():
            out = self._call(folded)
        if out is None:
            return None
        outs = out if isinstance(out, tuple) else (out,)
        wrapped = tuple(
            _add_batch_dim(o.unflatten(axis, moved[n].shape[axis:axis + 2]), axis, level) if n in dims else o
            for n, o in zip(self.data, outs))
        return wrapped if isinstance(out, tuple) else wrapped[0]

    def _per_slice(self, values, dims, size, level):
        """One call per slice, each input's slice a view (in place: written
        where it lies); the outputs stacked on a new dim 0."""
        slices = [dict(values, **{n: values[n].select(d, i) for n, d in dims.items()}) for i in range(size)]
        if self.written:
            self._check_aliasing(values)
        if self.written and size > 1:  # every slice checked (on copies) before any is written
            for sliced in slices:
                with _lower():
                    self._call(dict(sliced, **{n: sliced[n].clone() for n in self.written}))
        outs = []
        for sliced in slices:
            with _lower():
                outs.append(self._call(sliced))
        if not self.op._schema.returns:
            return None
        if size == 0:  # one call on zeros of a slice's shape checks it and gives the outputs' shapes
            with _lower():
                out = self._call(dict(values, **{n: values[n].new_zeros(_without(values[n].shape, d))
                                                 for n, d in dims.items()}))

            def empty(o):
                return _add_batch_dim(o.new_empty((0,) + tuple(o.shape)), 0, level)
            return tuple(map(empty, out)) if isinstance(out, tuple) else empty(out)
        if isinstance(outs[0], tuple):
            return tuple(_add_batch_dim(torch.stack(col), 0, level) for col in zip(*outs))
        return _add_batch_dim(torch.stack(outs), 0, level)

    def _check_aliasing(self, values):
        """The op's rule (csrc/checks: a written tensor shares no memory with
        itself or any other argument) on the whole tensors, every slice at once."""
        op = f"vmap of rotary::{self.name}"
        # Under an outer transform (nested vmap, jvp, grad) the tensors are
        # still wrappers with no storage: checked as the tensors under every
        # level, which hold every outer slice too.
        tensors = {n: _innermost(v) for n, v in values.items() if isinstance(v, torch.Tensor)}
        written = [n for n in self.written if n in tensors]
        for i, n in enumerate(written):
            _C.check_distinct(op, n, tensors[n])
            for other, t in tensors.items():
                if other != n and other not in written[:i]:  # each written pair once
                    _C.check_disjoint(op, n, tensors[n], other, t,
                                      "a slice would write what it or another slice reads or writes")


def _innermost(t):
    f = torch._C._functorch
    while f.is_batchedtensor(t) or f.is_gradtrackingtensor(t) or f.is_functionaltensor(t):
        t = f.get_unwrapped(t)
    return t


def _without(shape, d):
    return tuple(shape[:d]) + tuple(shape[d + 1:])


def _install():
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("rotary", "IMPL")
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("rotary::"):
            name = qualified.split("::", 1)[1]
            _LIB.impl(name, _Rule(name), "FuncTorchBatched", with_keyset=True)
