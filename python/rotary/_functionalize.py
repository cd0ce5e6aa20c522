"""In-place ops under functionalization (torch.compile, torch.export).

The inductor cannot lower an ``auto_functionalized_v2`` node with a complex
input: it skips the node, then asserts that it was removed. Every op also
takes ``torch.view_as_real`` of the table, so functionalization is given that
view instead, for calls from the wrappers and raw ``torch.ops.rotary`` calls
alike. A lazily conjugated table keeps its meaning: its memory is the plain
table read with ``inverse`` flipped.

A mutated view whose storage offset is symbolic (k = qkv[..., H:2H] with H
dynamic) loses that offset in torch 2.11's inductor, which then rotates the
wrong elements. ``apply_rope_`` is traced as ``apply_rope`` and ``copy_``
there, with an input in x's storage refused (the op's overlap checks are
lost with the rewrite); the ops that write several tensors are refused.
Every written tensor is checked for elements sharing memory while tracing,
as the op cannot read symbolic strides.

torch 2.11 regenerates a written slice of a tensor from that tensor's base
with a start computed from the slice's whole storage offset: where the base
itself starts past 0 (a compiled function's input that is a view, such as
cache[layer]), the write lands on other elements or on none. A call whose
regenerated slice would not start where it does is handled as a symbolic
offset is.
"""

import torch
from torch._higher_order_ops.auto_functionalize import get_base, is_alias, try_use_slice
from torch._library import simple_registry
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from . import _C

_OPS = ("apply_rope_", "apply_rope_qk_", "apply_rope_with_kv_cache_", "apply_qk_norm_rope_",
        "apply_qk_norm_rope_with_kv_cache_")


def _misplaced_write(func, args, kwargs):
    """The first written argument whose write torch's functionalization would
    put elsewhere, as (name, why, way out): a symbolic storage offset, or a
    slice regenerated from a base that starts past 0 (the module's docstring)."""
    for n, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            t = args[n] if n < len(args) else kwargs.get(a.name)
            if not isinstance(t, torch.Tensor):
                continue
            if not isinstance(t.storage_offset(), int):
                return (a.name, f"a view whose storage offset is symbolic under torch.compile / export "
                        f"({t.storage_offset()})",
                        "mark the dim that sets the offset static (torch._dynamo.mark_static)")
            base = get_base(t)
            cut = None if base is None or is_alias(base, t) else try_use_slice(base, t)  # (dim, start, end)
            if cut is not None and base.storage_offset() + cut[1] * t.stride(cut[0]) != t.storage_offset():
                return (a.name, f"a slice of a tensor that itself starts at storage offset {base.storage_offset()} "
                        "(a compiled function's input that is a view, such as cache[layer])",
                        "pass the whole tensor and index it inside the compiled function")
    return None


def _check_distinct(op, name, t):
    """The op's self-overlap refusal (check_distinct) for a traced, possibly
    symbolic tensor, which the op's own check cannot read: a stride past the
    reach of the smaller ones proves distinct elements (a guard on symbolic
    sizes); otherwise the exact test runs at the traced sizes, specialised."""
    reach = 0
    for d in sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride):
        if t.stride(d) <= reach:
            _C.check_distinct(op, name, torch.empty_strided([int(n) for n in t.shape],
                                                            [int(n) for n in t.stride()], device="meta"))
            return
        reach = reach + (t.size(d) - 1) * t.stride(d)


def _check_no_shared_storage(op, x, moved, others):
    """The rewrite reads every input before copy_ writes x, which the op's
    overlap checks (lost with it) would have refused: an input in x's storage
    is refused here, as those checks cannot run on a symbolic offset."""
    mine = StorageWeakRef(x.untyped_storage())
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) == mine:
            raise ValueError(
                f"{op}: x and {name} share one storage, and x is {moved[1]}, traced as the out-of-place op and "
                f"copy_, where the op's overlap checks do not run; pass a clone of {name}, or {moved[2]}")


def _real_table(mode, func, types, args, kwargs):
    names = [a.name for a in func._schema.arguments]
    op = func._schema.name.split("::")[1]
    values = dict(zip(names, args), **kwargs)
    for a in func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write and isinstance(values.get(a.name), torch.Tensor):
            _check_distinct(op, a.name, values[a.name])
    moved = _misplaced_write(func, args, kwargs)
    if moved is not None and op == "apply_rope_":
        x = args[0] if args else kwargs["x"]
        _check_no_shared_storage(op, x, moved, {n: v for n, v in values.items() if n != "x"})
        with mode:
            x.copy_(torch.ops.rotary.apply_rope.default(*args, **kwargs))
        return None
    if moved is not None:
        raise ValueError(
            f"{op}: {moved[0]} is {moved[1]}, which torch 2.11 loses for an in-place op while compiling (it "
            f"would write the wrong elements); call the out-of-place op and copy_ its results, or {moved[2]}")
    i = names.index("freqs")
    args, kwargs = list(args), dict(kwargs)
    freqs = args[i] if i < len(args) else kwargs["freqs"]
    if freqs.dtype == torch.complex64:
        with mode:
            if freqs.is_conj() and "inverse" in names:
                real = torch.view_as_real(freqs.conj())  # the memory, not conjugated
                inverse = kwargs.get("inverse", False)
                kwargs["inverse"] = not inverse
            else:
                if freqs.is_conj() and kwargs.get("inv_freq") is not None:
                    raise ValueError(
                        f"{op}: a conjugated table (freqs.conj()) with inv_freq cannot "
                        "be compiled (rows past the table would turn the other way); pass freqs.resolve_conj() "
                        "and conjugated inv_freq positions, or call it eagerly"
                    )
                real = torch.view_as_real(freqs.resolve_conj())
        if i < len(args):
            args[i] = real
        else:
            kwargs["freqs"] = real
    return mode.__torch_dispatch__(func, types, tuple(args), kwargs)


def _install() -> None:
    for name in _OPS:
        rules = simple_registry.singleton.find(f"rotary::{name}").torch_dispatch_rules
        if rules.find(FunctionalTensorMode) is None:  # once per process (the package may be reloaded)
            torch.library.register_torch_dispatch(f"rotary::{name}", FunctionalTensorMode, _real_table)
