"""What torch.nn.cpp.ModuleWrapper lacks for rotary's bound C++ modules
(CppRotaryEmbedding, KVCache): nn.Module's own methods, buffers that refuse
replacement by name, and a forward that torch.compile and torch.export meet
with a message instead of an internal error. The C++ binding calls
:func:`adopt` on every new wrapper (csrc/python/convert.h)."""

import torch
from torch.nn.cpp import OrderedDictWrapper

# ModuleWrapper.__init__ copies the bound C++ methods onto each instance.
# torch's to / cpu / cuda / float / double / half / train / eval return None
# (`m = m.to(device)` lost the module) and clone the bare C++ module; the
# named_* and the rest lack nn.Module's arguments (torch.export calls
# named_parameters(remove_duplicate=False)) and yield C++ modules. Dropping
# the copies lets nn.Module's methods apply; they reach C++ through _apply
# (bound by the binding) and the wrapped dicts below. forward is the
# class's, below.
_SHADOWED = ("to", "cpu", "cuda", "float", "double", "half", "train", "eval", "clone", "forward", "buffers",
             "children", "modules", "named_buffers", "named_children", "named_modules", "named_parameters",
             "parameters", "zero_grad")


# What to use instead, in Python, of each bound C++ module.
_INSTEAD = {"CppRotaryEmbedding": "rotary.RotaryEmbedding, the same module in Python (docs/deploy.md)",
            "KVCache": "rotary.apply_rope_with_kv_cache_ on cache tensors you hold (docs/kv_cache.md)"}


def _exporting_here() -> bool:
    """A non-strict torch.export traces this thread's call (under its fake
    mode): torch.compiler.is_exporting() alone is process-wide, true for an
    eager call on another thread. Not under Dynamo (strict export), where
    torch.compile breaks the graph instead."""
    return (torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()
            and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def _advice(cls: str) -> str:
    return (f"rotary.{cls} keeps its tensors in the C++ module, out of reach of torch.export, "
            f"torch.func.functional_call and a single torch.compile graph: use {_INSTEAD[cls]}")


def refuse_fx(cls: str, q) -> None:
    """torch.fx.symbolic_trace hands forward Proxies, which the modules'
    host-side decisions cannot read: refused by name."""
    if isinstance(q, torch.fx.Proxy):
        raise TypeError(f"rotary.{cls} cannot be traced by torch.fx.symbolic_trace (its forward decides on the "
                        f"host from the call's shapes and values): keep it a leaf module (a torch.fx.Tracer whose "
                        f"is_leaf_module is True for it), or call the ops, torch.ops.rotary.*, which trace")


def refuse_script(self):
    """torch.jit.script calls it on every submodule: refused by name."""
    cls = type(self).__name__
    raise RuntimeError(f"rotary.{cls} does not support TorchScript (torch.jit.script is deprecated since torch "
                       "2.11). " + _advice(cls))


class _CppDict(OrderedDictWrapper):
    """A C++ module's buffers, parameters or submodules, read live; an
    assignment (a parameter swap, register_buffer, `m.freqs = t`) is refused
    by name instead of failing inside OrderedDictWrapper."""

    def __init__(self, cpp_module, attr, cls):
        super().__init__(cpp_module, attr)
        self.cls = cls

    def __setitem__(self, key, value, verb="set"):
        replaces = ("load_state_dict replaces its state" if self.cls == "KVCache"
                    else "load_tables or load_state_dict replaces the tables")
        raise TypeError(f"rotary.{self.cls}: cannot {verb} {self.attr[1:-1]} {key!r} from Python. "
                        + _advice(self.cls) + "; " + replaces)

    def __delitem__(self, key):  # del, or torch.nn.utils.parametrize
        if self.cls == "CppRotaryEmbedding" and self.attr == "_buffers":
            self.cpp_module._keep_tables()  # parametrize wrote into the table before deleting it
        self.__setitem__(key, None, verb="delete")


def move_of(fn, device: torch.device):
    """What nn.Module._apply's fn does to a buffer on `device`, read from a
    one-element probe (the modules keep their tables' dtypes): None for an
    in-place step into shared memory (share_memory_), which then applies to
    the buffers themselves; else the device fn moves a tensor to."""
    probe = torch.empty(1, device=device)
    shared = probe.is_shared()
    out = fn(probe)
    return None if out is probe and not shared and probe.is_shared() else out.device


def hand_out_copies(destination, prefix: str, tables: dict) -> None:
    """state_dict's tables as copies: a loader that writes into the tensors
    it is handed (torch.distributed.checkpoint loads in place) wrote the
    module's own tables, past the checked load (load_state_dict)."""
    for name, table in tables.items():
        if prefix + name in destination:
            destination[prefix + name] = table.detach().clone()


def _save_tables_copied(self, destination, prefix, keep_vars):
    torch.nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)
    if not keep_vars:  # keep_vars: the tensors themselves, as asked
        hand_out_copies(destination, prefix, {n: destination[prefix + n] for n in ("freqs", "inv_freq")
                                              if prefix + n in destination})


def _read_through(name: str, doc) -> property:
    def refuse(self, value):
        if "_adopted" not in self.__dict__:  # ModuleWrapper.__init__ copying the value: nothing to keep
            return
        cls = type(self).__name__
        raise AttributeError(f"rotary.{cls}.{name} is read-only, got an assignment of {value!r}: it is read live "
                             f"from the C++ module (options are fixed once built: build a new rotary.{cls})")

    return property(lambda self: getattr(self.cpp_module, name), refuse, doc=doc)


def adopt(wrapper) -> None:
    """Fit a new wrapper instance: nn.Module's methods, options read live
    and refusing dicts."""
    own, cls = wrapper.__dict__, type(wrapper).__name__
    for name in _SHADOWED:
        own.pop(name, None)
    # ModuleWrapper copies the C++ properties' values too: a copy went stale
    # (attention_scaling after a rule's switch, capacity after reset()), and
    # an assignment to it read back but changed nothing. Read-only, read live.
    for name, prop in vars(type(wrapper.cpp_module)).items():
        if isinstance(prop, property) and name in own and not name.startswith("_"):
            del own[name]
            if name not in vars(type(wrapper)):
                setattr(type(wrapper), name, _read_through(name, prop.__doc__))
    own["_adopted"] = True
    if cls == "CppRotaryEmbedding":
        type(wrapper)._save_to_state_dict = _save_tables_copied
    for attr in ("_parameters", "_buffers", "_modules"):
        object.__setattr__(wrapper, attr, _CppDict(wrapper.cpp_module, attr, cls))


def cpp_forward(self, *args, **kwargs):
    """The C++ module's forward (the bound method's arguments). Dynamo
    cannot trace into it: a graph break, with this reason under
    fullgraph=True or strict export; a non-strict export is refused."""
    refuse_fx(type(self).__name__, args[0] if args else kwargs.get("q"))
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=f"rotary.{type(self).__name__} runs its C++ forward eagerly. "
                                  + _advice(type(self).__name__))
    elif _exporting_here():
        raise RuntimeError(_advice(type(self).__name__))
    return self.cpp_module.forward(*args, **kwargs)
