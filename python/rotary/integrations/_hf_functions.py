"""Module-level function replacement, shared by every patched model
(rotary.integrations.transformers): each modeling module's
``apply_rotary_pos_emb`` (and ``apply_rotary_pos_emb_interleave``,
``apply_rotary_emb``) is wrapped once and restored when no patched model uses
it. A wrapper rotates through the handle a patched rotary embedding returned,
and calls the original for real cos/sin tensors, so unpatched models of the
family are unaffected."""

import functools
import inspect
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

FUNC_NAME = "apply_rotary_pos_emb"
# Also replaced where a modeling module has it: DeepSeek-V3-style MLA calls it
# on q_rot / k_rot when rope_interleave (pairs (2j, 2j+1); q . k is the same
# with the pairs kept in place, and the cache holds that layout).
# apply_rotary_emb(xq, xk, freqs_cis): complex pairs (DeepSeek-V2, Llama 4),
# replaced only where the family names its layout (Family.freqs_cis_layout).
FUNC_NAMES = (FUNC_NAME, "apply_rotary_pos_emb_interleave", "apply_rotary_emb")
_COMPLEX = ["xq", "xk", "freqs_cis"]
# unsqueeze_dim of transformers' rotation functions: heads at dim 1 or 2 of q.
LAYOUTS = {1: "BHSD", 2: "BSHD"}
_UNSQUEEZE = {layout: dim for dim, layout in LAYOUTS.items()}

lock = threading.Lock()
# modeling module name -> [{function name: original}, number of patched models using it]
module_patches: Dict[str, List[Any]] = {}


def _signature(fn: Callable) -> inspect.Signature:
    """fn's signature. With kernels >= 0.18.2, transformers' hub decorator
    turns the function into a module whose own signature is (*args, **kwargs):
    the function's is its forward's."""
    return inspect.signature(fn.forward if hasattr(fn, "kernel_layer_name") else fn)


def _params(fn: Callable) -> List[str]:
    try:
        return list(_signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _unsqueeze_of(original: Callable, names: List[str], lead: int) -> Callable:
    """unsqueeze_dim of a call: among the positional args after the first
    `lead` parameters, else a keyword, else the function's default."""
    index = names.index("unsqueeze_dim") - lead if "unsqueeze_dim" in names else None
    default = _signature(original).parameters["unsqueeze_dim"].default if index is not None else 1
    default = 1 if default is inspect.Parameter.empty else default

    def unsqueeze_of(args: tuple, kwargs: dict) -> Any:
        return args[index] if index is not None and 0 <= index < len(args) else kwargs.get("unsqueeze_dim", default)

    return unsqueeze_of


def _make_wrapper(original: Callable, handle: type, interleaved: Optional[bool], layout: Optional[str]) -> Callable:
    """interleaved: this function's pairing where it differs from the family's
    (None: the rope's); layout: the complex form's."""
    names = _params(original)
    if names[:3] == _COMPLEX:

        @functools.wraps(original)
        def apply_rotary_emb(xq, xk, freqs_cis, *args, **kwargs):
            if isinstance(freqs_cis, handle):
                return freqs_cis.apply(xq, xk, _UNSQUEEZE[layout], interleaved)
            return original(xq, xk, freqs_cis, *args, **kwargs)

        apply_rotary_emb._rotary_original = original
        return apply_rotary_emb
    if names[:3] == ["tensor", "sin", "cos"]:  # GPT-J / CodeGen: one tensor, sin before cos

        @functools.wraps(original)
        def apply_one(tensor, sin, cos, *args, **kwargs):
            if isinstance(sin, handle):
                return sin.apply_one(tensor, sin=cos)
            return original(tensor, sin, cos, *args, **kwargs)

        apply_one._rotary_original = original
        return apply_one
    # Gemma 3n / 4: q and k apart (q alone on KV-shared layers); DeepSeek-V4 its
    # q, kv and attention output (with -sin: the inverse rotation).
    if names[:3] == ["x", "cos", "sin"]:
        unsqueeze_of = _unsqueeze_of(original, names, 3)

        @functools.wraps(original)
        def apply_rotary_pos_emb_one(x, cos, sin, *args, **kwargs):
            if isinstance(cos, handle):
                return cos.apply_one(x, unsqueeze_of(args, kwargs), interleaved, sin=sin)
            return original(x, cos, sin, *args, **kwargs)

        apply_rotary_pos_emb_one._rotary_original = original
        return apply_rotary_pos_emb_one
    unsqueeze_of = _unsqueeze_of(original, names, 4)

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k=None, cos=None, sin=None, *args, **kwargs):
        if isinstance(cos, handle):
            if k is None:  # Qwen4-Exp's indexer rotates q alone
                return cos.apply_one(q, unsqueeze_of(args, kwargs), interleaved, sin=sin)
            return cos.apply(q, k, unsqueeze_of(args, kwargs), interleaved, sin=sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._rotary_original = original
    return apply_rotary_pos_emb


def wraps_function(module: Any, f: str, layout: Optional[str]) -> bool:
    """Whether acquire replaces module.f (the complex form only with its layout)."""
    fn = getattr(module, f, None)
    return callable(fn) and (f != "apply_rotary_emb" or (_params(fn)[:3] == _COMPLEX and layout in _UNSQUEEZE))


def acquire(name: str, handle: type, pairing: Dict[str, bool], layout: Optional[str]) -> None:
    """pairing: {function: interleaved} where a function pairs unlike the family."""
    _drain()
    module = sys.modules[name]
    entry = module_patches.get(name)
    if entry is None:
        originals = {f: getattr(module, f) for f in FUNC_NAMES if wraps_function(module, f, layout)}
        for f, original in originals.items():
            setattr(module, f, _make_wrapper(original, handle, pairing.get(f), layout))
        module_patches[name] = [originals, 1]
    else:
        entry[1] += 1


def retain(name: str) -> None:
    """One more user of an acquired module (a deep copy of a patched model)."""
    module_patches[name][1] += 1


def release(name: str) -> None:
    _drain()
    _release_one(name)


def _release_one(name: str) -> None:
    entry = module_patches.get(name)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        module = sys.modules.get(name)  # None at interpreter exit
        for f, original in entry[0].items() if module is not None else ():
            setattr(module, f, original)
        del module_patches[name]


# Users of a patched model that was collected without unpatch: released at
# once when the lock is free, else by the next acquire / release under it (a
# collection can run inside a locked section of this thread).
_released_late: List[str] = []


def release_later(names: List[str]) -> None:
    _released_late.extend(names)
    if lock.acquire(blocking=False):
        try:
            _drain()
        finally:
            lock.release()


def _drain() -> None:
    while _released_late:
        _release_one(_released_late.pop())
