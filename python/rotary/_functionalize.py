"""In-place ops with a complex table under torch.compile.

The inductor cannot lower an ``auto_functionalized_v2`` node with a complex
input: it skips the node, then asserts that it was removed. Every op also
takes ``torch.view_as_real`` of the table, so functionalization is given that
view instead, for calls from the wrappers and raw ``torch.ops.rotary`` calls
alike. A lazily conjugated table keeps its meaning: its memory is the plain
table read with ``inverse`` flipped.
"""

import torch
from torch._library import simple_registry
from torch._subclasses.functional_tensor import FunctionalTensorMode

_OPS = ("apply_rope_", "apply_rope_qk_", "apply_rope_with_kv_cache_", "apply_qk_norm_rope_",
        "apply_qk_norm_rope_with_kv_cache_")


def _real_table(mode, func, types, args, kwargs):
    names = [a.name for a in func._schema.arguments]
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
                        f"{func._schema.name.split('::')[1]}: a conjugated table (freqs.conj()) with inv_freq cannot "
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
