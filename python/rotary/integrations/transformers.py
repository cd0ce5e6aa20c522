"""Run the q/k rotation of a Hugging Face ``transformers`` Llama-family model
through ``torch.ops.rotary``.

::

    from rotary.integrations.transformers import apply_rotary_to_model, unpatch

    model = AutoModelForCausalLM.from_pretrained(...)
    apply_rotary_to_model(model)        # or patch_llama(model)
    out = model.generate(...)           # prefill and decode rotate with our kernel
    unpatch(model)                      # back to transformers' own code

    with rotary_patched(model):         # the same, undone on exit
        ...

How the patch hooks in, what it verifies and its limits: docs/transformers.md.
"""

import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._arg_checks import _bool_arg, _shown
from ..hf import layer_types_of, rope_kwargs_from_hf_config
from ..hf_families import Family, family_of
from ..module import RotaryEmbedding
from . import _hf_functions, _qk_norm, hf_support
from ._hf_embeddings import layer_config, rotary_embeddings
from ._hf_functions import FUNC_NAME as _FUNC_NAME
from ._hf_functions import lock as _lock
from ._hf_functions import module_patches as _module_patches  # noqa: F401  (tests read it)
from ._positions import RotaryPositions
from ._rope_state import _RopeState, give_dynamic_state, take_dynamic_state

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "RotaryPositions",
    "apply_rotary_to_model",
    "patch_llama",
    "unpatch",
    "unpatch_llama",
    "rotary_patched",
    "is_patched",
    "rotary_embedding_of",
]

# The families the HF sweep (tests/rotary_testing/hf_sweep.py) found equal to
# the unpatched model: logits and greedy decode with a KV cache, fp32.
SUPPORTED_MODEL_TYPES = hf_support.SUPPORTED
# Refusals the sweep could not test: allow_unverified lets these through.
_UNTESTED = "the sweep builds no tiny model"

_STATE_ATTR = "_rotary_integration_state"

# ----------------------------------------------------------------------------
# Per-model patch
# ----------------------------------------------------------------------------
class _ModelPatch:
    def __init__(self, max_seq_len: Optional[int], fuse_qk_norm: bool) -> None:
        # (rotary_emb module, previous instance-level forward or None, state)
        self.rotary: List[Tuple[nn.Module, Optional[Callable], Dict[Optional[str], _RopeState]]] = []
        self.modules: List[str] = []
        self.norms: List[tuple] = []  # the deferred q/k norms (_qk_norm.install)
        self.options = {"max_seq_len": max_seq_len, "fuse_qk_norm": fuse_qk_norm}

    def __deepcopy__(self, memo: dict) -> "_ModelPatch":
        # copy.deepcopy of a patched model: its own tables and rule state (the
        # forwards are objects, copied with the model), and one more user of
        # each patched attention module, so unpatching either keeps the other.
        new = _qk_norm.copy_fields(self, memo)
        with _lock:
            for name in new.modules:
                _hf_functions.retain(name)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(_qk_norm.PICKLE_REFUSED)

    def __del__(self) -> None:
        # A patched model collected without unpatch: each patched function
        # loses this user, and is restored once it has none.
        # At interpreter exit the module's globals may already be None: nothing left to restore.
        if getattr(self, "modules", None) and _hf_functions is not None:
            _hf_functions.release_later(self.modules)


def _attention_modules(model: nn.Module, layout: Optional[str]) -> List[str]:
    names = []
    for m in model.modules():
        cls = type(m)
        if not cls.__name__.endswith(("Attention", "MLA")):  # LongCat-Flash's attention is LongcatFlashMLA
            continue
        py = sys.modules.get(cls.__module__)
        wraps = py is not None and any(_hf_functions.wraps_function(py, f, layout) for f in _hf_functions.FUNC_NAMES)
        if wraps and cls.__module__ not in names:
            names.append(cls.__module__)
    return names


def _module_device(module: nn.Module, fallback: nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    for t in fallback.parameters():
        return t.device
    return torch.device("cpu")


class _PatchedForward:
    """The patched rotary embedding's forward; states maps each layer type (None
    when the config has one rule for every layer) to its table; single: it
    returns one handle, in place of a complex freqs_cis. An object, so that
    copy.deepcopy of a patched model copies the tables with it."""

    def __init__(self, states: Dict[Optional[str], _RopeState], single: bool = False) -> None:
        self.states, self.single = states, single

    def __call__(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None, layer_type: Any = None):
        state = self.states.get(layer_type)
        if state is None:
            raise ValueError(f"rotary: the patched rotary embedding has no table for layer_type {layer_type!r} "
                             f"(it has {sorted(map(str, self.states))})")
        if position_ids is None:
            raise ValueError("rotary: the patched rotary embedding needs position_ids")
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        axes = state.rope.pair_axes
        if position_ids.dim() == 3 and axes is not None:
            # Multimodal [n_axes, batch, seq] (transformers expands a [1, ...] one too).
            position_ids = position_ids.expand(max(axes) + 1, -1, -1)
        elif position_ids.dim() != 2:
            raise ValueError(
                f"rotary: position_ids must be [batch, seq]{' or [n_axes, batch, seq]' if axes else ''}, got shape "
                f"{tuple(position_ids.shape)}"
                + ("" if axes else " (3-D multimodal ids need a config with mrope_section, or ERNIE-4.5-VL's sections)")
            )
        state.prepare(position_ids)
        handle = RotaryPositions(position_ids, state, held=state.held())
        return handle if self.single else (handle, handle)

    def __deepcopy__(self, memo: dict) -> "_PatchedForward":
        return _qk_norm.copy_fields(self, memo)

    def __reduce_ex__(self, protocol):
        raise TypeError(_qk_norm.PICKLE_REFUSED)


def is_patched(model: nn.Module) -> bool:
    """Whether ``apply_rotary_to_model`` is in effect on ``model``."""
    return getattr(model, _STATE_ATTR, None) is not None


def _check_model(who: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"rotary: {who} takes a transformers model (an nn.Module), got {_shown(model, True)}")


def apply_rotary_to_model(
    model: nn.Module,
    *,
    max_seq_len: Optional[int] = None,
    allow_unverified: bool = False,
    fuse_qk_norm: Optional[bool] = None,
) -> nn.Module:
    """Make ``model`` (a transformers model of a family in
    ``SUPPORTED_MODEL_TYPES``, the HF sweep's) rotate q and k with
    ``torch.ops.rotary``; returns ``model``. Idempotent.

    Each rotary embedding of the text model (a ``rotary_emb``, or one by what
    it is: docs/transformers.md) gets ``RotaryEmbedding.from_hf_config`` of
    its config (one per layer type where the rule differs), on the rotary
    embedding's device; ``max_seq_len``: table rows (default
    ``max_position_embeddings``; later positions are computed exactly). A
    family the sweep refused is refused by name; ``allow_unverified=True``
    lets through only the ones it could not test (docs/transformers.md).
    Raises ``ValueError`` for a model without a ``rotary_emb`` or attention
    using ``apply_rotary_pos_emb``, and for configs ``from_hf_config`` cannot
    represent, leaving the model unchanged. Undo with :func:`unpatch`.

    ``fuse_qk_norm``: run the attention's q/k RMSNorm (``q_norm`` /
    ``k_norm``) inside the rotation, ``rotary.apply_qk_norm_rope``. Default:
    for the families the sweep verified that way (``hf_support.QK_NORM_FUSED``).
    """
    _check_model("apply_rotary_to_model", model)
    _bool_arg("apply_rotary_to_model", "allow_unverified", allow_unverified)
    if fuse_qk_norm is not None:
        _bool_arg("apply_rotary_to_model", "fuse_qk_norm", fuse_qk_norm)
    if is_patched(model):
        have = getattr(model, _STATE_ATTR).options
        asked = {"max_seq_len": max_seq_len, "fuse_qk_norm": fuse_qk_norm}
        for key, value in asked.items():
            if value is not None and value != have[key]:
                was = f"{key}={have[key]!r}" + (" (the config's max_position_embeddings)" if have[key] is None else "")
                raise ValueError(f"rotary: the model is already patched with {was}, not {value!r}; unpatch it "
                                 "first (rotary.integrations.transformers.unpatch)")
        return model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = hf_support.REFUSED.get(model_type)
        swept = f"the HF sweep of transformers {hf_support.TRANSFORMERS_VERSION}"
        if why is not None and not why.startswith(_UNTESTED):
            raise ValueError(f"rotary: model_type {model_type!r} is not supported: {why} ({swept})")
        if not allow_unverified:
            raise ValueError(
                f"rotary: model_type {model_type!r} is not verified: "
                f"{why or 'it is not in ' + swept}; the supported families are in docs/transformers.md. "
                "pass allow_unverified=True if its attention uses rotate_half RoPE through "
                "apply_rotary_pos_emb(q, k, cos, sin) with the pair from model.rotary_emb"
            )
    if fuse_qk_norm is None:
        fuse_qk_norm = model_type in hf_support.QK_NORM_FUSED
    return _patch(model, max_seq_len, fuse_qk_norm)


def _patch(model: nn.Module, max_seq_len: Optional[int] = None, fuse_qk_norm: bool = False) -> nn.Module:
    """apply_rotary_to_model without the support check (the sweep's entry)."""
    if is_patched(model):
        return model
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = family_of(model_type) or Family()
    if family.refuse:  # before the checks below: the family's own reason
        raise ValueError(f"rotary: model_type {model_type!r} is not supported: {family.refuse}")
    embeddings = rotary_embeddings(model)
    if not embeddings:
        raise ValueError(f"rotary: {type(model).__name__} has no rotary embedding module (rotary_emb) to patch")
    modules = _attention_modules(model, family.freqs_cis_layout)
    if not modules:
        raise ValueError(f"rotary: {type(model).__name__} has no attention calling {_FUNC_NAME}")

    # Build everything first so that a config error leaves the model untouched.
    built = []
    # Equal tables on one device are built once: DeepSeek-V4's compressors and
    # indexers each own a rotary_emb (over 60 at 1M positions). A host-driven
    # rule's table follows its own embedding's calls, so it is never shared.
    shared: Dict[str, _RopeState] = {}
    for emb, rope_config, theta in embeddings:
        states = {}
        device = _module_device(emb, model)
        for layer_type in _used_layer_types(rope_config):  # one table per layer type (Gemma 3, ...)
            # allow_inverse: the family's negative angle goes to the ops (_RopeState.inverse).
            # allow_unverified: apply_rotary_to_model's own gate (the sweep's families) has passed.
            kwargs = rope_kwargs_from_hf_config(layer_config(rope_config, layer_type), max_seq_len, layer_type, theta,
                                                allow_inverse=True, allow_unverified=True)
            key = repr((sorted(kwargs.items()), device))
            state = shared.get(key)
            if state is None:
                rope = RotaryEmbedding(**kwargs).to(device)
                state = _RopeState(rope, family.inverse, family.span == "trailing")
                if not rope.host_driven:
                    shared[key] = state
            states[layer_type] = state
        take_dynamic_state(emb, states)
        built.append((emb, states))

    patch = _ModelPatch(max_seq_len, fuse_qk_norm)
    with _lock:
        if is_patched(model):  # by another thread since the check above: its patch stands
            return model
        # Under the lock: another thread patching this same model has finished (is_patched above).
        _refuse_patched_through_another(model, embeddings)
        try:
            for emb, states in built:
                previous = emb.__dict__.get("forward")
                emb.forward = _PatchedForward(states, single=family.freqs_cis_layout is not None)
                patch.rotary.append((emb, previous, states))
            for name in modules:
                pairing = {f: p == "interleaved" for f, p in family.function_pairing}
                _hf_functions.acquire(name, RotaryPositions, pairing, family.freqs_cis_layout)
                patch.modules.append(name)
            if fuse_qk_norm:
                patch.norms = _qk_norm.install(model)
        except BaseException:
            _undo(patch, give_state=False)  # the model as it was: it never ran patched
            raise
        object.__setattr__(model, _STATE_ATTR, patch)
    return model


def _refuse_patched_through_another(model: nn.Module, embeddings) -> None:
    """A rotary embedding shared with a patched model object (a causal LM and
    its base model, a wrapper): a second patch would save the first one's
    forward as the one to restore, and an unpatch in the order applied would
    put it back with the functions it needs restored."""
    for emb, _, _ in embeddings:
        if isinstance(emb.__dict__.get("forward"), _PatchedForward):
            raise ValueError(f"rotary: {type(model).__name__}'s rotary embedding ({type(emb).__name__}) is already "
                             "patched through another model object that holds it (the causal LM and its base "
                             "model, or a wrapper); patch and unpatch one of them")


def _undo(patch: _ModelPatch, give_state: bool) -> None:
    """What a patch changed, put back (under _lock)."""
    for emb, previous, states in patch.rotary:
        if previous is None:
            emb.__dict__.pop("forward", None)
        else:
            emb.forward = previous
        if give_state:
            give_dynamic_state(emb, states)
    for name in patch.modules:
        _hf_functions.release(name)
    patch.modules = []  # released: its __del__ has none left
    _qk_norm.remove(patch.norms)


def _used_layer_types(rope_config: Any) -> List[Optional[str]]:
    """The keys of a rope_parameters keyed by layer type that some layer has
    (transformers builds only those), or [None] for one rule."""
    keyed = layer_types_of(rope_config)
    if keyed is None:
        return [None]
    used = set(getattr(rope_config, "layer_types", None) or ())
    return [t for t in keyed if t in used] if used & set(keyed) else keyed


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_rotary_to_model`: the rotary embeddings get their own
    forward back, and each ``apply_rotary_pos_emb`` is restored once no other
    patched model uses it (a patched model that is collected counts as
    unpatched). No-op on a model that is not patched."""
    _check_model("unpatch", model)
    with _lock:  # read under it: two threads must not undo one patch twice
        patch = getattr(model, _STATE_ATTR, None)
        if patch is None:
            return model
        _undo(patch, give_state=True)
        object.__delattr__(model, _STATE_ATTR)
    return model


@contextmanager
def rotary_patched(model: nn.Module, **kwargs: Any):
    """``with rotary_patched(model): ...`` patches on entry and unpatches on
    exit (a model that was already patched stays patched)."""
    was_patched = is_patched(model)
    apply_rotary_to_model(model, **kwargs)
    try:
        yield model
    finally:
        if not was_patched:
            unpatch(model)


def rotary_embedding_of(model: nn.Module) -> Optional[RotaryEmbedding]:
    """The ``rotary.RotaryEmbedding`` a patched model uses (the first, if it
    has several), or None."""
    patch = getattr(model, _STATE_ATTR, None)
    return next(iter(patch.rotary[0][2].values())).rope if patch is not None and patch.rotary else None


# Liger-style names.
patch_llama = apply_rotary_to_model
unpatch_llama = unpatch
