"""Reading a Hugging Face ``transformers`` config into ``RotaryEmbedding``
arguments. Only the parsing lives here: every frequency rule is computed by
the C++ code (``rotary._C``), and ``transformers`` itself is never imported.

Accepted: a ``PretrainedConfig`` (4.x ``rope_theta`` / ``rope_scaling``, 5.x
``rope_parameters``) or its dict form (``config.to_dict()``, a ``config.json``),
read through its ``text_config`` if it has one. Pairing and rotated span per
``model_type`` come from ``rotary.hf_families.FAMILIES``.
"""

import math
import re
from typing import Any, Dict, List, Mapping, Optional

from . import _C
from ._arg_checks import _bool_arg
from ._hf_parts import get as _get, given_params as _given_params, hw_pair_axes as _hw_pair_axes
from ._hf_parts import layer_keys as _layer_keys
from ._hf_read import fields as _fields, rope_params as _rope_params, text_config as _text_config
from ._hf_parts import layer_theta as _layer_theta, layer_thetas as _layer_thetas
from ._hf_parts import read_as_its_class as _read_as_its_class
from ._hf_parts import rule_of as _rule_of, scaling as _scaling, sections as _sections, span as _span
from ._hf_refusals import refuse_axial as _refuse_axial, refuse_per_layer_rotation as _refuse_per_layer_rotation
from ._hf_refusals import refuse_tower_width as _refuse_tower_width, refuse_unserved as _refuse_unserved
from ._hf_refusals import refuse_unverified as _refuse_unverified
from .hf_families import (CLASS_KEEPS_TOP_PARTIAL, CLASS_ROPE_LABELS, DEFAULT_RULE_READS_PARTIAL,
                          AXIAL_OWN, CLASS_AXIAL, GENERIC_FIELDS, WHOLE_HEAD_ATTENTION, Family, family_of)

__all__ = ["layer_thetas_of", "layer_types_of", "rope_kwargs_from_hf_config"]

_DEFAULT_THETA = 10000.0
# transformers' rule names (its ROPE_INIT_FUNCTIONS and "default"); rotary's
# own others ("ntk") describe no transformers model.
_HF_RULES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"})
_ROPE_NAME = re.compile(r"rope|rotary", re.IGNORECASE)
# Family-specific fields whose names do not say rope / rotary.
_SPECIFIC = frozenset({"qk_nope_head_dim", "qk_head_dim"})


def _first(*values: Any) -> Any:
    """The first value that is not None (0 and 0.0 count: they are errors, not absent)."""
    return next(v for v in values if v is not None)


def _check_fields(config: Any, model_type: str, family: Optional[Family]) -> None:
    """Rule 1: a rope-related top-level field is read, or refused by name."""
    known = GENERIC_FIELDS | set(family.fields if family else ())
    for name, value in _fields(config).items():
        if value is None or name in known or not (_ROPE_NAME.search(name) or name in _SPECIFIC):
            continue
        who = f"model_type {model_type!r}" if model_type else "a config without model_type"
        raise ValueError(
            f"from_hf_config: {name}={value!r} is not read for {who} (its meaning for the pairing or the rotated "
            f"span is family-specific; known families: rotary.hf_families.FAMILIES)"
        )


def layer_types_of(config: Any) -> Optional[List[str]]:
    """The layer types a config's rope_parameters is keyed by (Gemma 3,
    OLMo 3, ModernBERT, ...), sorted; None for one rule for every layer. A
    flat dict of a family whose class keys them is refused (ValueError)."""
    config = _text_config(config, "layer_types_of")
    params = _given_params(config)
    if not isinstance(params, Mapping):
        return None
    return sorted(_layer_keys(config, params)) or None


def layer_thetas_of(config: Any) -> Optional[List[float]]:
    """The bases of a config whose layers each have their own (GraniteSWA's
    ``layer_rope_theta``; 0: no RoPE), distinct and sorted; None otherwise."""
    config = _text_config(config, "layer_thetas_of")
    model_type = str(_get(config, "model_type", ""))
    field = getattr(family_of(model_type), "layer_theta_field", None)
    values = _get(config, field) if field else None
    return None if values is None else _layer_thetas(values, field, model_type)


def _served_family(config: Any, model_type: str, allow_inverse: bool) -> Family:
    """The family's entry (a blank one outside the table), or a refusal by
    name of what the config asks that no rotary option represents."""
    family = family_of(model_type)
    if family is not None and family.refuse:
        raise ValueError(f"from_hf_config: model_type {model_type!r} is not supported: {family.refuse}")
    _refuse_unserved(config, model_type)
    if family is not None and family.inverse and not allow_inverse:
        raise ValueError(f"from_hf_config: model_type {model_type!r} rotates by the negative angle, which "
                         "RotaryEmbedding has no option for (the ops take inverse=True)")
    _check_fields(config, model_type, family)
    fam = family or Family()
    labels = sorted(CLASS_ROPE_LABELS.get(model_type, ()))
    if fam.folded_fields and layer_types_of(config) != labels:
        raise ValueError(f"from_hf_config: {model_type}'s config class builds rope_parameters keyed by "
                         f"{', '.join(map(repr, labels))} from its top-level fields "
                         f"({', '.join(('rope_theta',) + fam.folded_fields)}); got rope_parameters "
                         f"{_given_params(config)!r}: pass the config object")
    return fam


def _theta(config: Any, params: Dict[str, Any], fam: Family, model_type: str, layer_theta: Optional[float]) -> float:
    """The base: the family's fixed one, the layer's own, or the config's."""
    if fam.theta is not None:  # the family's code ignores these: refuse rather than ignore
        given = {k: v for k, v in params.items() if not (k in ("rope_type", "type") and v == "default")}
        given.update((n, _get(config, n)) for n in ("rope_theta", "partial_rotary_factor", "rotary_pct",
                                                   "rotary_emb_base") if _get(config, n) is not None)
        for name, value in given.items():
            if name in ("rope_theta", "rotary_emb_base") and value == fam.theta and not isinstance(value, bool):
                continue  # the base the family runs anyway: nothing is ignored
            raise ValueError(f"from_hf_config: {name}={value!r}: transformers' {model_type} ignores it "
                             f"(base {fam.theta:g}, no scaling, rotary_dim sets the span)")
    if (fam.theta is None and not fam.neox_fields and isinstance(config, Mapping) and "rope_theta" in config
            and config["rope_theta"] is None and params.get("rope_theta") is None):
        raise ValueError("from_hf_config: rope_theta is None: transformers' config class puts it into the rule "
                         "and fails on it; give the base, or drop the key")
    theta = fam.theta if fam.theta is not None else _first(
        params.get("rope_theta"), _get(config, "rope_theta"),
        _get(config, "rotary_emb_base") if fam.neox_fields else None,
        _get(config, "default_theta", _DEFAULT_THETA),
    )
    per_layer = _get(config, fam.layer_theta_field) if fam.layer_theta_field else None
    if per_layer is not None:  # the layers' own bases: rope_theta only filled them in
        theta = _layer_theta(per_layer, fam.layer_theta_field, layer_theta, model_type)
    elif layer_theta is not None:
        raise ValueError(f"from_hf_config: layer_theta={layer_theta!r}, but {model_type or 'the config'} has no "
                         "per-layer bases (rotary.hf.layer_thetas_of)")
    # An int past a float's range is named by C++ (convert.cpp), as the modules name it.
    if (isinstance(theta, bool) or not isinstance(theta, (int, float))
            or not 0 < _C._float_arg(theta, "from_hf_config", "rope_theta") < math.inf):
        raise ValueError(f"from_hf_config: rope_theta must be a finite number > 0, got {theta!r}")
    mask = _get(config, fam.nope_mask_field) if fam.nope_mask_field else None
    other = [b for b in (_layer_thetas(mask, fam.nope_mask_field, model_type) if mask is not None else ())
             if b != float(theta)]
    if other:
        raise ValueError(f"from_hf_config: {fam.nope_mask_field} has bases {other} besides 0 and rope_theta "
                         f"{float(theta):g}: transformers' {model_type} rotates every such layer at rope_theta "
                         "(the entry only says whether it rotates); give 0 or the base")
    return float(theta)


def _partial(config: Any, params: Dict[str, Any], fam: Family, model_type: str, rule: str) -> float:
    """The rotated share of each head, refused where the family's default rule
    would rotate the whole head whatever the field says."""
    top = _get(config, "partial_rotary_factor")
    if model_type in CLASS_KEEPS_TOP_PARTIAL and top is not None and "partial_rotary_factor" not in params:
        raise ValueError(f"from_hf_config: partial_rotary_factor={top!r} at the top level: transformers' "
                         f"{model_type} config class never moves it into rope_parameters, where its rules read it "
                         "(a scaled rule may still copy it in); put it in rope_parameters[layer_type], or drop it")
    default = fam.default_rule_partial if rule == "default" and fam.default_rule_partial else fam.partial_default
    partial = _first(
        params.get("partial_rotary_factor"), top, _get(config, "rotary_pct") if fam.neox_fields else None, default,
    )
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ValueError(
            f"from_hf_config: partial_rotary_factor must be a number in (0, 1] (the rotated share of each head), "
            f"got {partial!r}"
        )
    if model_type in AXIAL_OWN:  # these towers' axial rule never reads it: the whole head turns
        return 1.0
    # proportional keeps the whole head's width (zeros past the share): any attention takes it.
    if partial != 1.0 and rule != "proportional" and model_type in WHOLE_HEAD_ATTENTION:
        raise ValueError(f"from_hf_config: partial_rotary_factor={partial!r}: transformers' {model_type} rotary "
                         "class builds a table int(head_dim * partial_rotary_factor) wide, but its attention "
                         "rotates the whole head with it (transformers fails there). Drop the field")
    if (partial != 1.0 and rule != "proportional" and fam.span in ("leading", "trailing") and model_type
            and model_type not in DEFAULT_RULE_READS_PARTIAL):
        why = ("rotary class is not known to read it in its default rule (those that do: "
               "rotary.hf_families.DEFAULT_RULE_READS_PARTIAL); it rotates the whole head there" if rule == "default"
               else f"attention is not known to slice a narrower table (the {rule} rule builds one "
                    "int(head_dim * partial_rotary_factor) wide, and the head's rotation fails on it; those that "
                    "slice: rotary.hf_families.DEFAULT_RULE_READS_PARTIAL)")
        raise ValueError(f"from_hf_config: partial_rotary_factor={partial!r}: transformers' {model_type} {why}. "
                         "Drop the field to rotate the whole head")
    return partial


def _interleaved(config: Any, fam: Family) -> bool:
    if not fam.interleave_field:
        return fam.pairing == "interleaved"
    interleaved = _get(config, fam.interleave_field, fam.interleave_default)
    if not isinstance(interleaved, bool):
        raise ValueError(f"from_hf_config: {fam.interleave_field} must be a bool, got {interleaved!r}")
    return interleaved


def rope_kwargs_from_hf_config(
    config: Any, max_seq_len: Optional[int] = None, layer_type: Optional[str] = None,
    layer_theta: Optional[float] = None, *, allow_inverse: bool = False, allow_unverified: bool = False,
) -> Dict[str, Any]:
    """Keyword arguments of ``rotary.RotaryEmbedding`` (and
    ``rotary.CppRotaryEmbedding``) for the rotary embedding ``config`` describes.

    A config with a ``text_config`` is read through it. The ``model_type``
    picks an entry of ``rotary.hf_families.FAMILIES`` (each checked against
    transformers' rotary code by tests/python/test_hf_config.py):

    - ``interleaved``: ``False`` for ``rotate_half`` families, ``True`` for
      ``(2j, 2j+1)`` pairs (GPT-J, Cohere, GLM, ...; MLA families by
      ``rope_interleave``), as the family's entry says;
    - ``dim`` and ``rotary_offset``: the first ``int(head_dim *
      partial_rotary_factor)`` dims; GPT-J / CodeGen the first ``rotary_dim``;
      MLA the trailing ``qk_rope_head_dim`` dims of a ``[nope | rope]`` head
      (``rotary_offset = qk_nope_head_dim``); DeepSeek-V4 the trailing
      ``int(head_dim * partial_rotary_factor)``;
    - ``theta``: ``rope_parameters["rope_theta"]`` or ``rope_theta``
      (``rotary_emb_base`` for old GPT-NeoX dicts), else the config
      object's class default, else 10000 (a dict of a family whose class
      default is not: refused; GPT-J / CodeGen: always 10000);
    - ``scaling``: ``rope_scaling`` (legacy) or ``rope_parameters``, with
      the top-level ``max_position_embeddings`` (never one in the rule) and,
      for yarn / llama3 / longrope, an ``original_max_position_embeddings``
      filled in as transformers does (a top-level one wins, else the one in
      the dict, else ``max_position_embeddings``);
    - ``max_seq_len``: the argument, else ``max_position_embeddings``;
    - ``mrope_section`` / ``mrope_interleaved`` for Qwen2-VL / Qwen2.5-VL
      (contiguous sections) and Qwen3-VL (interleaved), defaulted as their
      rotary classes do; ``pair_axes`` for ERNIE-4.5-VL (h and w pairs
      alternating, then t); ``axes_dim`` / ``axes_shared_spectrum`` for
      Pixtral's ``"axial"`` rule; ``axes_dim`` alone for the vision towers
      of ``hf_families.AXIAL_OWN`` (Qwen2-VL's and its kin; other towers'
      axial rules: refused).

    A ``model_type`` neither in the table nor found by the HF sweep
    (``rotary.integrations.SUPPORTED_MODEL_TYPES``) is refused as not
    verified unless ``allow_unverified=True``. Such a type, or none (a
    hand-written dict), is read as ``rotate_half`` over the first
    ``int(head_dim * partial_rotary_factor)`` dims, and is refused if it has
    a rope-related field whose meaning is family-specific (``rotary_dim``,
    ``rope_interleave``, ``qk_rope_head_dim``, ``no_rope_layers``, ...), or
    ``mrope_section`` unless it has no ``model_type`` at all.

    MLA with ``rope_interleave`` keeps each pair in place where DeepSeek-V3
    writes evens then odds: q . k is the same. YaRN's softmax mscale is the
    attention's, not returned here. ``rope_parameters`` keyed by layer type
    (Gemma 3, OLMo 3: :func:`layer_types_of`) is read for ``layer_type``;
    per-layer bases (GraniteSWA: :func:`layer_thetas_of`) for ``layer_theta``.

    Raises ``ValueError``, naming the field and its value, for what it cannot
    represent: a rope-related field it does not read, a key of
    ``rope_parameters`` no rule reads, a rule transformers does not have
    (``ntk``), a refused family, per-layer-type rope parameters without
    ``layer_type`` (``layer_type`` without them; several per-layer bases
    without ``layer_theta``), a dict lacking what its config class fills in
    (``hf_families.CLASS_*``), a family rotating by the negative angle (NanoChat;
    ``allow_inverse=True``: the caller passes ``inverse=True`` to the ops, as
    the transformers patch does), an odd rotary dim, an unknown ``rope_type``, sections that do
    not sum to ``dim / 2``; and for missing or invalid fields. A refusal made
    while reading for a ``layer_type`` names it.
    """
    for name, flag in (("allow_inverse", allow_inverse), ("allow_unverified", allow_unverified)):
        _bool_arg("from_hf_config", name, flag)  # "no" read as True would let a refused rotation through
    try:
        return _kwargs(config, max_seq_len, layer_type, layer_theta, allow_inverse, allow_unverified)
    except ValueError as e:
        # A layer type's own rule: say which, where the refusal does not.
        text = str(e)
        if layer_type is None or f"layer_type={layer_type!r}" in text:
            raise
        where = f"from_hf_config (layer_type={layer_type!r}): "  # a rule's own words (RopeScaling's) too
        raise ValueError(where + text.removeprefix("from_hf_config: ")) from None


def _kwargs(config: Any, max_seq_len: Optional[int], layer_type: Optional[str], layer_theta: Optional[float],
            allow_inverse: bool, allow_unverified: bool) -> Dict[str, Any]:
    config = _text_config(config)
    model_type = str(_get(config, "model_type", ""))
    fam = _served_family(config, model_type, allow_inverse)

    def field(name: str) -> Any:
        value = _get(config, name)
        for std, alias in fam.aliases:
            if std != name:
                continue
            other = _get(config, alias)
            if value is None:
                value = other
            elif other is not None and other != value and isinstance(config, Mapping):
                # Its class reads one of the two (an attribute_map makes the alias win): no guess.
                raise ValueError(f"from_hf_config: {name}={value!r} and {alias}={other!r} differ: transformers' "
                                 f"{model_type} config reads {alias} for {name}; give one of them")
        return value

    params = _rope_params(config, layer_type, fam)
    nested = layer_types_of(config) is not None
    rule = _rule_of(params)
    if model_type in CLASS_AXIAL and rule not in ("default", "axial"):
        raise ValueError(f"from_hf_config: rope_type {rule!r} for model_type {model_type!r}: its rotary class runs "
                         "only its axial rule (transformers refuses another)")
    if model_type in CLASS_AXIAL:  # its class makes "default" axial
        params["rope_type"], rule = "axial", "axial"
    if isinstance(config, Mapping):
        _read_as_its_class(config, params, fam, model_type, field, rule, nested)
    _refuse_per_layer_rotation(config, model_type)  # after the fields its class fills in
    theta = _theta(config, params, fam, model_type, layer_theta)
    mrope, mrope_inter, axial = _sections(params, fam, model_type)
    if axial:
        _refuse_axial(model_type)
    if _rule_of(params) not in _HF_RULES:
        raise ValueError(f"from_hf_config: unknown rope_type {_rule_of(params)!r}: transformers has no such rule "
                         f"(its rules: {', '.join(sorted(_HF_RULES))}); rotary's own go to "
                         "RotaryEmbedding(scaling=...)")
    partial = _partial(config, params, fam, model_type, rule)
    if rule == "proportional":  # its rule reads the share where transformers' standardize put it
        params["partial_rotary_factor"] = partial
    # proportional (Gemma 4): the rule turns that share of the whole head's
    # pairs (the others get inv_freq 0), so the span is the whole head.
    rotary_dim, offset = _span(config, fam, 1.0 if rule == "proportional" else partial, model_type, field, rule)
    if model_type in AXIAL_OWN:
        _refuse_tower_width(rotary_dim, field(fam.hidden_field), field("num_attention_heads"), fam.hidden_field,
                            model_type)
    max_pos = field("max_position_embeddings")
    spec = _scaling(config, params, max_pos, rotary_dim, nested)

    # The argument as given (the module refuses a non-int); a config's value as an int.
    rows = max_seq_len if max_seq_len is not None else int(_first(max_pos, 4096))
    kwargs = {
        "dim": rotary_dim,
        "max_seq_len": rows,
        "theta": theta,
        "interleaved": _interleaved(config, fam),
        "scaling": spec.to_dict(),
    }
    if offset:
        kwargs["rotary_offset"] = offset
    if axial:
        kwargs.update(axes_dim=[rotary_dim // 2, rotary_dim // 2], axes_shared_spectrum=model_type not in AXIAL_OWN)
    if mrope is not None:
        if not isinstance(mrope, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in mrope):
            raise ValueError(f"from_hf_config: mrope_section must be a list of ints, got {mrope!r}")
        if fam.mrope_hw_pairs:
            kwargs["pair_axes"] = _hw_pair_axes(list(mrope), rotary_dim, model_type)
        else:
            _C.mrope_pair_axes(list(mrope), rotary_dim, mrope_inter)  # the C++ check: sections sum to dim / 2
            kwargs["mrope_section"] = list(mrope)
            kwargs["mrope_interleaved"] = mrope_inter
    if not allow_unverified:  # last: a refusal naming a field or rule says more
        _refuse_unverified(model_type)
    return kwargs
