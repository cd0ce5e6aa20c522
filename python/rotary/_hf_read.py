"""Reading a config's parts for ``rotary.hf``: the text config a composite
rotates by, its own fields, and its rope_parameters dict (a layer type's own),
every key checked. Computes nothing."""

from typing import Any, Dict, Mapping, Optional

from ._hf_parts import get as _get, given_params as _given_params, layer_keys as _layer_keys
from ._hf_parts import own_mscale as _own_mscale, rule_of as _rule_of
from .hf_families import CLASS_TEXT_CONFIG, FAMILIES, Family

# Keys of rope_parameters we know (max_position_embeddings: to refuse it where
# no top-level one replaces it); any other is refused by name.
RULE_KEYS = frozenset({
    "rope_type", "type", "factor", "original_max_position_embeddings", "max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "low_freq_factor", "high_freq_factor",
    "short_factor", "long_factor",
})
PARAM_KEYS = RULE_KEYS | {"rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
# The rules whose original_max_position_embeddings transformers fills in.
FILLS_ORIGINAL = ("llama3", "yarn", "longrope")

def fields(config: Any) -> Dict[str, Any]:
    """The config's own top-level fields (sub-configs left out)."""
    items = config.items() if isinstance(config, Mapping) else getattr(config, "__dict__", {}).items()
    return {k: v for k, v in items if isinstance(k, str) and not k.startswith("_") and not k.endswith("_config")}


def text_config(config: Any, who: str = "from_hf_config") -> Any:
    if isinstance(config, (str, bytes)) or not (isinstance(config, Mapping) or hasattr(config, "__dict__")):
        hint = "; for a model id, pass transformers.AutoConfig.from_pretrained(id)" if isinstance(config, str) else ""
        raise TypeError(f"{who}: config must be a transformers config or a config.json dict, got "
                        f"{type(config).__name__} {config!r}"[:300] + hint)
    text = _get(config, "text_config")
    if text is None:
        top = _get(config, "model_type")
        if isinstance(config, Mapping) and top in CLASS_TEXT_CONFIG:
            raise ValueError(f"from_hf_config: the {top} dict has no text_config; its config class builds one from "
                             "its own defaults, not from top-level fields: pass the config object, or the dict "
                             "with text_config")
        return config
    if not isinstance(text, Mapping) and not hasattr(text, "__dict__"):
        raise ValueError(f"from_hf_config: text_config must be a config or a dict, got {text!r}; "
                         "pass config.text_config")
    top = _get(config, "model_type")
    if _get(text, "model_type") is None and top is not None:
        # The composite's class picks the text model; only a composite the
        # table knows says what that model rotates.
        if top not in FAMILIES:
            raise ValueError(f"from_hf_config: text_config has no model_type, and {top!r} does not say which text "
                             "model transformers builds for it; add text_config['model_type'] or pass the config "
                             "object")
        text = {**fields(text), "model_type": top}
    return text


def rope_params(config: Any, layer_type: Optional[str] = None, fam: Family = Family()) -> Dict[str, Any]:
    """The rope_parameters / rope_scaling dict (a layer type's own, when it is
    keyed by layer type), every key checked, rule names as the family's
    config class rewrites them."""
    params = _given_params(config)
    if not isinstance(params, Mapping):
        raise ValueError(f"from_hf_config: rope_parameters must be a dict, got {params!r}")
    params = dict(params)
    nested = _layer_keys(config, params)
    if not nested and layer_type is not None:
        raise ValueError(f"from_hf_config: layer_type={layer_type!r}, but rope_parameters is not keyed by layer "
                         "type: one rule for every layer (drop layer_type)")
    if nested and layer_type is None:
        raise ValueError(
            f"from_hf_config: rope_parameters is nested by layer type ({', '.join(nested)}); pass layer_type= one "
            f"of them (from_hf_config(config, layer_type={nested[0]!r})): one RotaryEmbedding per layer type"
        )
    if nested:
        if layer_type not in nested:
            raise ValueError(f"from_hf_config: layer_type={layer_type!r} is not a layer type rope_parameters is "
                             f"keyed by ({', '.join(nested)})")
        # None: no RoPE; a rule under a label no layer has is never read (transformers neither)
        others = [key for key, value in params.items()
                  if key not in nested and value is not None and not isinstance(value, Mapping)]
        if others:
            raise ValueError(f"from_hf_config: rope_parameters mixes layer types ({', '.join(nested)}) with "
                             f"rule keys ({', '.join(others)})")
        params = dict(params[layer_type])
    for key in fam.attention_keys:  # the attention's, read there: not the rotation's
        params.pop(key, None)
    # transformers setdefaults rope_type from type: a None kept there names no rule.
    given = params["rope_type"] if "rope_type" in params else params.get("type", "default")
    if given is None:
        raise ValueError("from_hf_config: rope_type None: transformers keeps it (no rule is named None); name the "
                         "rule, or drop the key for the default rule")
    if given in dict(fam.rule_aliases) and given not in FILLS_ORIGINAL and \
            params.get("original_max_position_embeddings") is None:
        # Its class renames the rule after filling original_max_position_embeddings in, for the rules it knows.
        raise ValueError(f"from_hf_config: rope_type {given!r} without original_max_position_embeddings in the "
                         "rule: transformers fills it in only for llama3 / yarn / longrope, before the rename, "
                         "and fails without it")
    for key in ("rope_type", "type"):
        if key in params:
            params[key] = dict(fam.rule_aliases).get(params[key], params[key])
    if fam.rules and _rule_of(params) not in fam.rules:
        raise ValueError(f"from_hf_config: rope_type {_rule_of(params)!r}: transformers' "
                         f"{_get(config, 'model_type', '')} accepts only {' / '.join(fam.rules)} (its config or "
                         "rotary class refuses the others)")
    if fam.mscale_keys:
        _own_mscale(params, fam, str(_get(config, "model_type", "")))
    for key in ("rope_theta", "partial_rotary_factor"):  # kept by transformers' setdefault, then read
        if key in params and params[key] is None and not (key == "rope_theta" and fam.theta is not None):
            raise ValueError(f"from_hf_config: rope_parameters[{key!r}] is None: transformers keeps it and fails "
                             "on it; give a number, or drop the key")
    for key, value in params.items():
        if key not in PARAM_KEYS:
            raise ValueError(f"from_hf_config: rope_parameters[{key!r}]={value!r} is a field no rule of rotary "
                             "has (a family's own rotary class may read it); rotary cannot represent it")
    return params
