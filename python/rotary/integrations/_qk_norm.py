"""A patched model's q/k RMSNorm fused into the rotation (apply_qk_norm_rope).

Attention modules with ``q_norm`` and ``k_norm`` (Qwen3, Gemma 3, OLMo2, ...)
normalize q and k right before ``apply_rotary_pos_emb``. Fused, those norms'
forwards only record their input and return it; the patched
``apply_rotary_pos_emb`` then runs ``rotary.apply_qk_norm_rope`` on q and k
with the norms' weights, in one pass. Never silently wrong:

- at patch time each norm is probed against the RMSNorm formulas the op runs
  (``w`` or Gemma's ``1 + w``); a norm that is neither is left alone;
- the q and k that reach the rotation must be the recorded inputs (the same
  memory: only views in between; under torch.compile, views of the same
  root tensor), else it raises;
- the attention module's forward hook raises if a recorded norm never
  reached the rotation (its layer has no RoPE, or the model uses it
  otherwise);
- a norm called outside its attention module's forward (a hook, an analysis
  script, another module sharing it) runs its own forward: it defers only
  while its attention module runs, and neither of a module's norms defers
  while a forward hook would see one (a deferred norm returns its input);
- eps is read from the norm at each call, as its own forward would.
"""

import copy
import threading
from typing import List, Optional, Tuple

import torch
from torch import nn


class _Local(threading.local):
    """Per thread: the deferred norms, and the attention modules whose
    forward is running (innermost last). Made in __init__ (at import for the
    main thread): created inside a compiled call, they would cost a recompile."""

    def __init__(self) -> None:
        self.pending: list = []
        self.running: list = []


_local = _Local()


def _pending() -> list:
    return _local.pending


def _running() -> list:
    return _local.running


_EPS_NAMES = ("variance_epsilon", "eps")


class NormSpec:
    """One probed norm: its module (whose weight and eps the op reads), the
    name of its eps attribute, and its offset."""

    __slots__ = ("module", "eps_name", "offset")

    def __init__(self, module: nn.Module, eps_name: str, offset: float) -> None:
        self.module, self.eps_name, self.offset = module, eps_name, offset

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def eps(self) -> float:
        return getattr(self.module, self.eps_name)


def probe(norm: nn.Module) -> Optional[NormSpec]:
    """The spec of ``norm`` if its forward is x * rsqrt(mean(x^2) + eps) times
    ``w`` or ``1 + w`` over its weight's length, else None."""
    w = getattr(norm, "weight", None)
    eps_name = next((a for a in _EPS_NAMES if isinstance(getattr(norm, a, None), float)), None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps_name is None or not w.is_floating_point():
        return None
    eps = getattr(norm, eps_name)
    subject = norm
    if w.is_meta:  # a meta-initialised model: the formula is probed with a stand-in weight on the CPU
        subject = copy.copy(norm)
        w = torch.rand(w.shape, generator=torch.Generator().manual_seed(1)).to(w.dtype) + 0.5
        subject._parameters = {**norm._parameters, "weight": nn.Parameter(w, requires_grad=False)}
    x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        got = type(norm).forward(subject, x).float()
        xf = x.float()
        base = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        tol = 1e-5 if w.dtype == torch.float32 else 2e-2
        for offset in (0.0, 1.0):
            if got.shape == base.shape and torch.allclose(got, base * (w.float() + offset), rtol=tol, atol=tol):
                return NormSpec(norm, eps_name, offset)
    return None


# Pickling any part of a patched model: an unpickled patch would not hold the
# attention functions it replaced, and an unpickled deferred norm would be skipped.
PICKLE_REFUSED = ("rotary: a patched model and its modules cannot be pickled; unpatch the model first, or save its "
                  "state_dict (save_pretrained) and patch the loaded model")


def copy_fields(obj, memo: dict):
    """copy.deepcopy of obj field by field (its __reduce_ex__ refuses pickling)."""
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new


def _hooked(owner: nn.Module) -> bool:
    """Whether a forward hook would see either norm of owner's (its own, or
    a global one): a deferred norm returns its input, so neither defers."""
    from torch.nn.modules import module as torch_module

    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_forward_hooks_always_called):
        return True
    return any(n._forward_hooks or n._forward_pre_hooks for n in (owner.q_norm, owner.k_norm))


class _Deferred:
    """A q/k norm's forward that defers it to the rotation while its attention
    module (owner) runs, and is the norm's own forward otherwise. An object,
    not a closure: copy.deepcopy of a patched model then gives the copy a
    forward over its own modules (a closure would keep the original's)."""

    def __init__(self, spec: NormSpec, owner: nn.Module) -> None:
        self.spec, self.owner = spec, owner

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        running = _running()
        if not running or running[-1] is not self.owner or _hooked(self.owner):
            return type(self.spec.module).forward(self.spec.module, x, *args, **kwargs)
        _pending().append((x, self.spec))
        return x

    def __deepcopy__(self, memo: dict) -> "_Deferred":
        return copy_fields(self, memo)

    def __reduce_ex__(self, protocol):
        raise TypeError(PICKLE_REFUSED)


def _view_root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _same_memory(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``t`` views ``x``'s elements. Eager: the same storage, offset
    and count. Under torch.compile dynamo cannot read a storage pointer or
    offset, but it tracks view bases: a view of the same root tensor with the
    same count (the model's code is what makes q a view of x, and that code
    is the same compiled or not)."""
    if torch.compiler.is_compiling():
        return _view_root(t) is _view_root(x) and t.numel() == x.numel()
    return (t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            and t.storage_offset() == x.storage_offset() and t.numel() == x.numel())


def take(q: torch.Tensor, k: torch.Tensor) -> Optional[Tuple[NormSpec, NormSpec]]:
    """The fused norms of this q and k, or None when no norm was deferred."""
    pending = _pending()
    if not pending:
        return None
    records = list(pending)
    pending.clear()
    if len(records) != 2:
        raise RuntimeError(f"rotary: {len(records)} q/k norms were deferred before apply_rotary_pos_emb, expected 2 "
                           "(q's, then k's); patch with fuse_qk_norm=False")
    for name, t, (x, _) in (("q", q, records[0]), ("k", k, records[1])):
        if not _same_memory(t, x):
            raise RuntimeError(f"rotary: the {name} reaching apply_rotary_pos_emb is not the {name}_norm input viewed "
                               "(the model transforms it in between); patch with fuse_qk_norm=False")
    return records[0][1], records[1][1]


def refuse_pending() -> None:
    """Raises if a norm was deferred before a one-tensor rotation, which cannot fuse it."""
    if _pending():
        _pending().clear()
        raise RuntimeError("rotary: a q/k norm was deferred before a one-tensor apply_rotary_pos_emb, which "
                           "cannot fuse it; patch with fuse_qk_norm=False")


def norm_kind(spec: NormSpec, x: torch.Tensor, layout: str) -> str:
    """"head" or "heads" for a weight over head_dim or over all heads."""
    heads = x.shape[1] if layout == "BHSD" else x.shape[2]
    n = spec.weight.numel()
    if n == x.shape[-1]:
        return "head"
    if n == heads * x.shape[-1]:
        return "heads"
    raise RuntimeError(f"rotary: a q/k norm over {n} values fits neither head_dim {x.shape[-1]} nor heads * "
                       f"head_dim {heads * x.shape[-1]}; patch with fuse_qk_norm=False")


def _check_consumed(module, args, output):
    pending = _pending()
    if pending:
        pending.clear()
        raise RuntimeError(f"rotary: {type(module).__name__}'s q/k norm ran but its output never reached "
                           "apply_rotary_pos_emb (a layer without RoPE?); patch with fuse_qk_norm=False")


def _enter(module, args):
    _pending().clear()
    _running().append(module)


def _leave(module, args, output):
    running = _running()
    if running and running[-1] is module:
        running.pop()


def install(model: nn.Module) -> List[tuple]:
    """Defers the q/k norms of every attention module whose two norms probe
    as the op's RMSNorm with one eps; returns what ``remove`` undoes."""
    probed = []  # every norm probed before any is changed: a probe that raises leaves the model as it was
    for m in model.modules():
        qn, kn = getattr(m, "q_norm", None), getattr(m, "k_norm", None)
        if not (isinstance(qn, nn.Module) and isinstance(kn, nn.Module)):
            continue
        sq, sk = probe(qn), probe(kn)
        if sq is None or sk is None or sq.eps != sk.eps or sq.offset != sk.offset:
            continue
        probed.append((m, qn, kn, sq, sk))
    done = []
    for m, qn, kn, sq, sk in probed:
        # always_call: a forward that raised (or a norm left unconsumed) still leaves the running list.
        hooks = (m.register_forward_pre_hook(_enter), m.register_forward_hook(_check_consumed),
                 m.register_forward_hook(_leave, always_call=True))
        for norm, spec in ((qn, sq), (kn, sk)):
            norm.forward = _Deferred(spec, m)
        done.append((qn, kn, hooks))
    return done


def remove(done: List[tuple]) -> None:
    for qn, kn, hooks in done:
        for norm in (qn, kn):
            norm.__dict__.pop("forward", None)
        for h in hooks:
            h.remove()
