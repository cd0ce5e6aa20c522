"""Module-level function replacement, shared by every patched model
(rotary.integrations.transformers): each modeling module's
``apply_rotary_pos_emb`` (and ``apply_rotary_pos_emb_interleave``) is wrapped
once and restored when no patched model uses it. A wrapper rotates through
the handle a patched rotary embedding returned, and calls the original for
real cos/sin tensors, so unpatched models of the family are unaffected."""

import functools
import inspect
import sys
import threading
from typing import Any, Callable, Dict, List

FUNC_NAME = "apply_rotary_pos_emb"
# Also replaced where a modeling module has it: DeepSeek-V3-style MLA calls it
# on q_rot / k_rot when rope_interleave (pairs (2j, 2j+1); q . k is the same
# with the pairs kept in place, and the cache holds that layout).
FUNC_NAMES = (FUNC_NAME, "apply_rotary_pos_emb_interleave")

lock = threading.Lock()
# modeling module name -> [{function name: original}, number of patched models using it]
module_patches: Dict[str, List[Any]] = {}


def _params(fn: Callable) -> List[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _make_wrapper(original: Callable, handle: type) -> Callable:
    names = _params(original)
    if names[:3] == ["tensor", "sin", "cos"]:  # GPT-J / CodeGen: one tensor, sin before cos

        @functools.wraps(original)
        def apply_one(tensor, sin, cos, *args, **kwargs):
            if isinstance(sin, handle):
                return sin.apply_one(tensor)
            return original(tensor, sin, cos, *args, **kwargs)

        apply_one._rotary_original = original
        return apply_one
    # Position of unsqueeze_dim among the positional parameters after (q, k, cos, sin).
    index = names.index("unsqueeze_dim") - 4 if "unsqueeze_dim" in names else None

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if isinstance(cos, handle):
            unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
            if index is not None and 0 <= index < len(args):
                unsqueeze_dim = args[index]
            return cos.apply(q, k, unsqueeze_dim)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._rotary_original = original
    return apply_rotary_pos_emb


def acquire(name: str, handle: type) -> None:
    module = sys.modules[name]
    entry = module_patches.get(name)
    if entry is None:
        originals = {f: getattr(module, f) for f in FUNC_NAMES if callable(getattr(module, f, None))}
        for f, original in originals.items():
            setattr(module, f, _make_wrapper(original, handle))
        module_patches[name] = [originals, 1]
    else:
        entry[1] += 1


def release(name: str) -> None:
    entry = module_patches.get(name)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        for f, original in entry[0].items():
            setattr(sys.modules[name], f, original)
        del module_patches[name]
