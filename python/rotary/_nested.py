"""Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) refused
by name. Such a tensor is a Python subclass: its ``__torch_dispatch__`` runs
before the nested-tensor keys where layouts.cpp refuses the strided kind, and
answered ``NotImplementedError`` naming only the op. A rule per op (installed
at import) refuses it in the words of that check, naming the argument."""

import torch
from torch._library import simple_registry
from torch.nested._internal.nested_tensor import NestedTensor

from . import _C


def _refuse(cls, func, types, args, kwargs):
    values = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    _C.refuse_not_dense(func._schema.name.split("::")[1],
                        [(name, value) for name, value in values.items() if isinstance(value, torch.Tensor)])


def _install() -> None:
    for name in _C.TABLE_OPS:
        rules = simple_registry.singleton.find(f"rotary::{name}").torch_dispatch_rules
        if rules.find(NestedTensor) is None:  # once per process (the package may be reloaded)
            torch.library.register_torch_dispatch(f"rotary::{name}", NestedTensor, _refuse)
