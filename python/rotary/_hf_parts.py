"""Pieces of reading a Hugging Face config (rotary.hf) that belong to one
rule or one kind of family: the rule's name and its checked RopeScaling,
multimodal sections, the rotated span of a head as the family lays it out,
the per-layer bases of GraniteSWA's layer_rope_theta, and a dict
(config.json) read as its config class reads it."""

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import _C
from .hf_families import (CLASS_HEAD_DIM, CLASS_LAYER_TYPES, CLASS_ORIGINAL_MAX, CLASS_PARTIAL, CLASS_TOP_PARTIAL,
                          CLASS_PLAIN_ROPE_SCALING, CLASS_ROPE_LABELS, CLASS_RULE, CLASS_THETA,
                          DEFAULT_RULE_READS_PARTIAL, FAMILIES, Family)

# Keys of rope_parameters that describe the model rather than the rule.
MODEL_KEYS = ("rope_theta", "partial_rotary_factor")


def get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def given_params(config: Any) -> Any:
    """rope_parameters / rope_scaling as given: in a (legacy) dict rope_scaling
    wins, as in transformers, unless its class keeps rope_scaling as a plain
    field (CLASS_PLAIN_ROPE_SCALING: never read); a 5.x config object's
    rope_parameters is standard."""
    if isinstance(config, Mapping):
        legacy = None if get(config, "model_type") in CLASS_PLAIN_ROPE_SCALING else get(config, "rope_scaling")
        return legacy or get(config, "rope_parameters") or {}
    return get(config, "rope_parameters") or get(config, "rope_scaling") or {}


def refuse_dict(model_type: str, name: str, why: str) -> None:
    raise ValueError(f"from_hf_config: the {model_type} dict has no {name}; its config class fills in {why}: "
                     f"pass the config object, or the dict with {name}")


def layer_keys(config: Any, params: Mapping) -> List[str]:
    """The layer types ``params`` is keyed by. A dict of a family whose class
    keys them (CLASS_LAYER_TYPES) that is not keyed so is refused
    (DeepSeek-V4's rope types have their own check, Family.folded_fields)."""
    keys = [key for key, value in params.items() if isinstance(value, Mapping)]
    model_type = get(config, "model_type")
    # transformers nests a rule only under labels the config declares (its
    # layer types, or its rope type labels): elsewhere a dict is a flat
    # rule's unknown field, refused as such (transformers ignores it).
    labels = (get(config, "_rope_type_labels") or CLASS_ROPE_LABELS.get(model_type)
              or get(config, "layer_types"))
    if labels:
        keys = [key for key in keys if key in labels]
    elif model_type not in CLASS_LAYER_TYPES:
        keys = []
    if (not keys and isinstance(config, Mapping) and model_type in CLASS_LAYER_TYPES
            and not getattr(FAMILIES.get(model_type), "folded_fields", ())):
        refuse_dict(model_type, "rope_parameters keyed by layer type", "one rule per layer type, not one for "
                    "every layer (from a flat rope_scaling and rope_theta, or its own per-type defaults)")
    return keys


def read_as_its_class(config: Mapping, params: Dict[str, Any], fam: Family, model_type: str, field: Any,
                      rule: str, nested: bool) -> None:
    """A dict (config.json) read as its transformers config class reads it:
    fields the class moves are moved (into ``params``), and a dict without a
    field the class fills in otherwise than the dict would be read
    (hf_families.CLASS_*) is refused where the family reads the field."""
    if fam.neox_fields:  # the NeoX classes read only their own names
        for name in ("rope_theta", "partial_rotary_factor"):
            if get(config, name) is not None:
                raise ValueError(f"from_hf_config: {name}={get(config, name)!r}: transformers' {model_type} config "
                                 "ignores it at the top level (it reads rotary_emb_base and rotary_pct, or "
                                 "rope_parameters); rename it, or drop it")
    elif not nested and "partial_rotary_factor" not in params:
        # The config class moves it into the rule (proportional reads it there),
        # or writes its own over it (CLASS_TOP_PARTIAL).
        top = CLASS_TOP_PARTIAL.get(model_type, get(config, "partial_rotary_factor"))
        if top is not None:
            params["partial_rotary_factor"] = top
    if not model_type:
        return
    if model_type in CLASS_RULE and not given_params(config):
        refuse_dict(model_type, "rope_parameters", "a scaled rule")
    if model_type in CLASS_THETA and params.get("rope_theta") is None and get(config, "rope_theta") is None:
        refuse_dict(model_type, "rope_theta", "a base other than 10000")
    reads_head_dim = fam.span in ("leading", "trailing") or fam.table_dim_field == "head_dim"
    if model_type in CLASS_HEAD_DIM and reads_head_dim and field("head_dim") is None:
        refuse_dict(model_type, "head_dim", "one that is not hidden_size // num_attention_heads")
    given = (params.get("partial_rotary_factor"), get(config, "partial_rotary_factor"),
             get(config, "rotary_pct") if fam.neox_fields else None)
    default = CLASS_PARTIAL.get(model_type)
    if default is not None and default != fam.partial_default and all(v is None for v in given):
        refuse_dict(model_type, "partial_rotary_factor", f"{default!r}")
    # Its class always has one, written over the rule's own: a rule's value is not read.
    if (model_type in CLASS_ORIGINAL_MAX and rule in ("yarn", "llama3", "longrope")
            and get(config, "original_max_position_embeddings") is None):
        refuse_dict(model_type, "original_max_position_embeddings", "its own, not max_position_embeddings nor "
                    "the one in rope_scaling")


def rule_of(params: Mapping) -> str:  # 'type' is rope_type's alias; None counts as absent
    return params.get("rope_type") or params.get("type") or "default"


def own_mscale(params: Dict[str, Any], fam: Family, model_type: str) -> None:
    """A class that scales cos/sin by its own short / long mscale (PhiMoE):
    under longrope its table is the short factors' at every length, so it is
    served as longrope with the short factors twice and that scale, where the
    two scales agree (they switch at original_max_position_embeddings)."""
    values = [params.pop(key, None) for key in fam.mscale_keys]
    rule = rule_of(params)
    if rule == "default":  # read only under a scaled rule
        return
    for key, value in zip(fam.mscale_keys, values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"from_hf_config: rope_parameters[{key!r}]={value!r}: {model_type}'s class scales "
                             f"cos/sin by it under the {rule} rule (a finite number > 0; its config class "
                             "requires a number)")
    if rule != "longrope":
        raise ValueError(f"from_hf_config: rope_type {rule!r} for {model_type}: its class builds that rule's table "
                         f"without a sequence length and scales cos/sin by {' / '.join(fam.mscale_keys)}; rotary "
                         "serves that for longrope only")
    if values[0] != values[1]:
        raise ValueError(f"from_hf_config: {fam.mscale_keys[0]}={values[0]!r} and {fam.mscale_keys[1]}="
                         f"{values[1]!r}: {model_type}'s scale switches between them at "
                         "original_max_position_embeddings, which rotary has no rule for (it serves them equal)")
    if "long_factor" in params:  # without it, the longrope rule's own refusal
        params["long_factor"] = params.get("short_factor")
    params["attention_factor"] = float(values[0])


def sections(params: Dict[str, Any], fam: Family, model_type: str):
    """(mrope_section, mrope_interleaved, axial) popped from params, defaulted
    as the family's rotary class does; the rule left is the plain one."""
    # Multimodal RoPE: the sections go to the module (the frequencies are the
    # plain rule's).
    given_none = "mrope_section" in params and params["mrope_section"] is None
    mrope = params.pop("mrope_section", None)
    mrope_inter = params.pop("mrope_interleaved", None)
    if fam.mrope_section is not None:
        if given_none:  # its class reads the key, not its default, and fails on None
            raise ValueError(f"from_hf_config: rope_parameters['mrope_section'] is None: transformers' {model_type} "
                             f"fails on it; drop the key for its default sections {list(fam.mrope_section)}")
        if mrope_inter is not None and fam.mrope_hw_pairs:
            raise ValueError(f"from_hf_config: rope_parameters['mrope_interleaved']={mrope_inter!r} is not read by "
                             f"transformers' {model_type}, which always alternates h and w, then t")
        if mrope_inter is not None and bool(mrope_inter) != fam.mrope_interleaved:
            raise ValueError(f"from_hf_config: mrope_interleaved={mrope_inter!r}, but transformers' {model_type} "
                             f"always lays sections out {'interleaved' if fam.mrope_interleaved else 'contiguous'}")
        mrope_inter = fam.mrope_interleaved
        if mrope is None:
            mrope = list(fam.mrope_section)
    elif (mrope is not None or mrope_inter is not None) and model_type:
        name, value = ("mrope_section", mrope) if mrope is not None else ("mrope_interleaved", mrope_inter)
        raise ValueError(f"from_hf_config: rope_parameters['{name}']={value!r} is not read for model_type "
                         f"{model_type!r} (its layout is family-specific)")
    mrope_inter = bool(mrope_inter)
    # mrope, and Pixtral's 2-D "axial" (one spectrum dealt to the h and w
    # axes): the plain rule's frequencies, the axes in the module's options.
    # Either name may hold it: a shipped Qwen2-VL config.json says type
    # "mrope", which transformers keeps beside the rope_type "default" it adds.
    names = [params.get(key) for key in ("rope_type", "type") if params.get(key) is not None]
    special = next((n for n in names if n in ("mrope", "axial")), None)
    axial = special == "axial"
    if special is not None and all(n in (special, "default") for n in names):
        params["rope_type"] = "default"
        params.pop("type", None)
    return mrope, mrope_inter, axial


def hw_pair_axes(sections: List[int], rotary_dim: int, model_type: str) -> List[int]:
    """The pair -> axis map of ERNIE-4.5-VL's (h, w, t) sections (axes t=0,
    h=1, w=2): pair j < 2h turns by h for even j, by w for odd j; the rest by
    t. Sections its class cannot lay out so are refused (it fails on them)."""
    if len(sections) == 3 and sections[0] == sections[1] == 0 and sections[2] == rotary_dim // 2:
        # transformers runs it (every pair by t); rotary's map would read one axis of its three rows.
        raise ValueError(f"from_hf_config: mrope_section={sections!r}: every pair turns by t, which rotary's "
                         "pair_axes cannot say while transformers passes three position rows; give h = w >= 1")
    if len(sections) != 3 or sections[0] != sections[1] or min(sections) < 1 or sum(sections) != rotary_dim // 2:
        raise ValueError(f"from_hf_config: mrope_section={sections!r}: transformers' {model_type} pairs h with w "
                         f"and needs (h, w, t) with h == w, t >= 1 and h + w + t = head_dim / 2 = "
                         f"{rotary_dim // 2}; it fails on others")
    return [1, 2] * sections[0] + [0] * sections[2]


def layer_thetas(values: Any, field: str, model_type: str) -> List[float]:
    """The distinct non-zero bases of a per-layer base list (0: that layer has no RoPE), sorted."""
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < math.inf for v in values):
        raise ValueError(f"from_hf_config: {model_type} needs {field}, a list of bases >= 0, got {values!r}")
    return sorted({float(v) for v in values if v})


def layer_theta(values: Any, field: str, selected: Optional[float], model_type: str) -> float:
    """The base of the layers that ``selected`` (None: the only one) names."""
    bases = layer_thetas(values, field, model_type)
    if selected is None and len(bases) == 1:
        return bases[0]
    if selected is None:
        why = f"its layers have {len(bases)} bases {bases}" if bases else "no layer has RoPE"
        raise ValueError(f"from_hf_config: {field}={values!r}: {why}; pass layer_theta= one of "
                         f"rotary.hf.layer_thetas_of(config): one RotaryEmbedding per base")
    if selected not in bases:
        raise ValueError(f"from_hf_config: layer_theta={selected!r} is not a base of {field} ({bases})")
    return float(selected)


# Keys transformers' validation requires of each rule (a None counts as given)
# and never fills in itself.
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}
# Keys transformers reads as given once present: a None there fails in its
# validation or rope init (TypeError), where rotary would fill in its default.
_NOT_NONE = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",), "longrope": ("original_max_position_embeddings",),
             "proportional": ("factor",)}


def scaling(config: Any, params: Dict[str, Any], max_pos: Optional[int], rotary_dim: int, nested: bool):
    """The checked RopeScaling of the rule, with the position fields filled in
    as transformers fills them (nested: params is a layer type's own)."""
    if max_pos is not None and (isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos <= 0):
        raise ValueError(f"from_hf_config: max_position_embeddings must be an int > 0, got {max_pos!r}")
    rope_type = rule_of(params)
    missing = [key for key in _REQUIRED.get(rope_type, ()) if key not in params]
    if missing:  # rotary's own defaults for them are not transformers'
        raise ValueError(f"from_hf_config: the {rope_type} rule lacks {', '.join(missing)}: transformers' config "
                         "validation requires it (KeyError)")
    top = None if nested else get(config, "original_max_position_embeddings")  # a layer type's own wins
    nones = [key for key in _NOT_NONE.get(rope_type, ()) if key in params and params[key] is None
             and not (key == "original_max_position_embeddings" and top is not None)]
    original = "original_max_position_embeddings"
    if (not nested and original in _NOT_NONE.get(rope_type, ()) and isinstance(config, Mapping)
            and original in config and config[original] is None):
        nones.append(f"top-level {original}")  # transformers writes it over the rule's
    if nones:
        raise ValueError(f"from_hf_config: the {rope_type} rule's {', '.join(nones)} "
                         f"{'is' if len(nones) == 1 else 'are'} None: transformers reads it as given and fails on "
                         "None (TypeError); give its value")
    model_keys = ("rope_theta",) if rope_type == "proportional" else MODEL_KEYS
    scaling = {key: value for key, value in params.items() if key not in model_keys}
    inner = scaling.pop("max_position_embeddings", None)  # transformers' rules never read it there
    if inner is not None and max_pos is None:
        raise ValueError(f"from_hf_config: rope_parameters['max_position_embeddings']={inner!r} is not read by "
                         "transformers (its rules read the top-level max_position_embeddings, else its config "
                         "class's default); set it at the top level")
    if rope_type == "yarn" and "truncate" in params:
        # transformers reads truncate from the top-level dict, .get("truncate", True):
        # None does not truncate, and a layer type's own value is never read.
        if nested and params["truncate"] is not True:
            raise ValueError(f"from_hf_config: truncate={params['truncate']!r} in a layer type's yarn rule: "
                             "transformers never reads it there (it truncates); rotary cannot tell which the "
                             "model was trained with")
        scaling["truncate"] = params["truncate"]  # None: no truncation (the C++ reader)
    if rope_type == "yarn":
        # transformers reads .get("beta_fast") or 32 and .get("beta_slow") or 1: a 0 is the default there
        for key in ("beta_fast", "beta_slow"):
            value = scaling.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
                scaling[key] = None
    if rope_type in ("llama3", "yarn", "longrope"):
        if top is not None:
            scaling["original_max_position_embeddings"] = top
        elif scaling.get("original_max_position_embeddings") is None and max_pos is not None:
            scaling["original_max_position_embeddings"] = max_pos
    if max_pos is not None:
        scaling["max_position_embeddings"] = max_pos
    # strict=False: keys of other rules are dropped (transformers ignores them too).
    spec = _C.RopeScaling.from_dict(scaling, strict=False)
    spec.validate(rotary_dim)
    return spec


def int_field(config: Any, name: str, model_type: str, value: Any = None) -> int:
    """The field ``name`` (or ``value``, read under that name), an int >= 0."""
    value = get(config, name) if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"from_hf_config: {model_type or 'the config'} needs {name}, an int >= 0, got {value!r}")
    return value


def span(config: Any, fam: Family, partial: float, model_type: str, field, rule: str) -> Tuple[int, int]:
    """(rotary_dim, rotary_offset): the rotated dims of a head, as the family
    lays them out."""
    offset = 0
    if fam.span == "mla":
        table = fam.table_dim_field
        if partial != 1.0 and not table:
            raise ValueError(f"from_hf_config: partial_rotary_factor={partial!r}: {model_type} rotates all "
                             "qk_rope_head_dim dims")
        rotary_dim = int_field(config, "qk_rope_head_dim", model_type)
        offset = int_field(config, "qk_nope_head_dim", model_type)
        # The family's own default rule reads the field alone (unless its class
        # reads the factor there too); transformers' scaled rules (yarn,
        # linear, ...) take partial_rotary_factor of it.
        share = 1.0 if rule == "default" and model_type not in DEFAULT_RULE_READS_PARTIAL else partial
        if table and int(int_field(config, table, model_type) * share) != rotary_dim:
            sized = table if rule == "default" else f"{table} x partial_rotary_factor ({partial!r})"
            raise ValueError(f"from_hf_config: {table}={get(config, table)!r}: {model_type}'s rotary class sizes "
                             f"its {rule} table by {sized}, which must equal qk_rope_head_dim={rotary_dim}")
        head_dim = offset + rotary_dim
    else:
        head_dim = field("head_dim") if fam.span in ("leading", "trailing") else None
        if head_dim is not None:
            int_field(config, "head_dim", model_type, head_dim)
        if not head_dim:
            hidden = field(fam.hidden_field)
            heads = field("num_attention_heads")
            if hidden is None or heads is None:
                raise ValueError(
                    f"from_hf_config: the config has no head_dim, and no {fam.hidden_field} and "
                    "num_attention_heads to derive it from"
                )
            if int_field(config, "num_attention_heads", model_type, heads) == 0:
                raise ValueError(f"from_hf_config: {model_type or 'the config'} has no head_dim, and derives it "
                                 f"as {fam.hidden_field} // num_attention_heads: num_attention_heads must be > 0, got 0")
            head_dim = int_field(config, fam.hidden_field, model_type, hidden) // heads
        if fam.span == "rotary_dim":
            rotary_dim = get(config, "rotary_dim")
            if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim:
                raise ValueError(f"from_hf_config: {model_type} needs rotary_dim, an int in (0, head_dim = "
                                 f"{head_dim}], got {rotary_dim!r}")
        else:
            rotary_dim = int(head_dim * partial)
            if fam.span == "trailing":
                offset = head_dim - rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2:
        given = {"mla": "qk_rope_head_dim", "rotary_dim": "rotary_dim"}.get(fam.span)
        raise ValueError(
            f"from_hf_config: {given} = {rotary_dim}, the rotated dims, must be even and > 0" if given else
            f"from_hf_config: head_dim {head_dim} * partial_rotary_factor {partial} gives rotary dim "
            f"{rotary_dim}; it must be even and > 0"
        )
    return rotary_dim, offset
