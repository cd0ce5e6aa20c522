"""Reading a Hugging Face ``transformers`` config into ``RotaryEmbedding``
arguments. Only the parsing lives here: every frequency rule is computed by
the C++ code (``rotary._C``), and ``transformers`` itself is never imported.

Accepted: a ``PretrainedConfig`` (transformers 4.x with ``rope_theta`` /
``rope_scaling``, or 5.x with ``rope_parameters``) or its plain-dict form
(``config.to_dict()``, a ``config.json`` loaded with ``json.load``).
"""

import math
from typing import Any, Dict, Mapping, Optional

from . import _C

__all__ = ["rope_kwargs_from_hf_config"]

# Keys of rope_parameters that describe the model rather than the rule.
_MODEL_KEYS = ("rope_theta", "partial_rotary_factor")
_DEFAULT_THETA = 10000.0
_MROPE_DEFAULTS = {"qwen2_vl": [16, 24, 24], "qwen2_5_vl": [16, 24, 24], "qwen3_vl": [24, 20, 20]}


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def _first(*values: Any) -> Any:
    """The first value that is not None (0 and 0.0 count: they are errors, not absent)."""
    return next(v for v in values if v is not None)


def rope_kwargs_from_hf_config(config: Any, max_seq_len: Optional[int] = None) -> Dict[str, Any]:
    """Keyword arguments of ``rotary.RotaryEmbedding`` (and
    ``rotary.CppRotaryEmbedding``) for the rotary embedding ``config`` describes:

    - ``dim``: ``int(head_dim * partial_rotary_factor)``, with ``head_dim``
      from the config or ``hidden_size // num_attention_heads``;
    - ``theta``: ``rope_parameters["rope_theta"]`` or ``rope_theta``
      (``rotary_emb_base`` for old GPT-NeoX dicts), else 10000;
    - ``scaling``: ``rope_scaling`` (legacy) or ``rope_parameters``, with
      ``max_position_embeddings`` and, for yarn / llama3 / longrope, an
      ``original_max_position_embeddings`` filled in as transformers does (a
      top-level ``original_max_position_embeddings`` wins, else the one in the
      dict, else ``max_position_embeddings``);
    - ``interleaved=False``: transformers pairs dims ``(j, j + dim/2)``
      (``rotate_half``);
    - ``max_seq_len``: the argument, else ``max_position_embeddings``.

    - ``mrope_section`` / ``mrope_interleaved`` for multimodal RoPE
      (``rope_parameters["mrope_section"]``; Qwen2-VL / Qwen2.5-VL sections
      are contiguous, Qwen3-VL's interleaved), only when the config has them;
    - ``axes_dim`` / ``axes_shared_spectrum`` for Pixtral's ``"axial"`` rule.

    Raises ``ValueError`` for what it cannot represent (per-layer-type rope
    parameters, an odd rotary dim, an unknown ``rope_type``, sections that do
    not sum to ``dim / 2``) and for missing or invalid fields, naming them.
    """
    head_dim = _get(config, "head_dim")
    if not head_dim:
        hidden = _get(config, "hidden_size")
        heads = _get(config, "num_attention_heads")
        if hidden is None or not heads:
            raise ValueError(
                "from_hf_config: the config has no head_dim, and no hidden_size and num_attention_heads "
                "to derive it from"
            )
        head_dim = hidden // heads

    # A dict (config.json) may be legacy and carry both; transformers lets
    # rope_scaling win there. A 5.x config object has the standardized
    # rope_parameters (rope_scaling is a deprecated alias of it).
    if isinstance(config, Mapping):
        params = _get(config, "rope_scaling") or _get(config, "rope_parameters") or {}
    else:
        params = _get(config, "rope_parameters") or _get(config, "rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"from_hf_config: rope_parameters must be a dict, got {params!r}")
    params = dict(params)
    nested = [key for key, value in params.items() if isinstance(value, Mapping)]
    if nested:
        raise ValueError(
            f"from_hf_config: rope_parameters is nested by layer type ({', '.join(nested)}); build one "
            "RotaryEmbedding per layer type from that type's dict instead"
        )
    # Multimodal RoPE: the sections go to the module (the frequencies are the
    # plain rule's); the vision-language text models default them as
    # transformers' rotary classes do, and Qwen3-VL always interleaves.
    model_type = str(_get(config, "model_type", ""))
    mrope = params.pop("mrope_section", None)
    interleaved = bool(params.pop("mrope_interleaved", False)) or model_type.startswith("qwen3_vl")
    if mrope is None:
        mrope = _MROPE_DEFAULTS.get(model_type.replace("_text", ""))
    if params.get("rope_type", params.get("type")) == "mrope":
        params["rope_type"] = "default"
        params.pop("type", None)
    # Pixtral's 2-D "axial" rule: one spectrum dealt to the h and w axes.
    axial = params.get("rope_type", params.get("type")) == "axial"
    if axial:
        params["rope_type"] = "default"
        params.pop("type", None)

    theta = _first(
        params.get("rope_theta"), _get(config, "rope_theta"), _get(config, "rotary_emb_base"),
        _get(config, "default_theta", _DEFAULT_THETA),
    )
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < theta < math.inf:
        raise ValueError(f"from_hf_config: rope_theta must be a finite number > 0, got {theta!r}")
    partial = _first(
        params.get("partial_rotary_factor"), _get(config, "partial_rotary_factor"), _get(config, "rotary_pct"), 1.0
    )
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ValueError(
            f"from_hf_config: partial_rotary_factor must be a number in (0, 1] (the rotated share of each head), "
            f"got {partial!r}"
        )
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"from_hf_config: head_dim {head_dim} * partial_rotary_factor {partial} gives rotary dim "
            f"{rotary_dim}; it must be even and > 0"
        )

    max_pos = _get(config, "max_position_embeddings")
    if max_pos is not None and (isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos <= 0):
        raise ValueError(f"from_hf_config: max_position_embeddings must be an int > 0, got {max_pos!r}")
    scaling = {key: value for key, value in params.items() if key not in _MODEL_KEYS}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type in ("llama3", "yarn", "longrope"):
        top = _get(config, "original_max_position_embeddings")
        if top is not None:
            scaling["original_max_position_embeddings"] = top
        elif scaling.get("original_max_position_embeddings") is None and max_pos is not None:
            scaling["original_max_position_embeddings"] = max_pos
    if max_pos is not None:
        scaling["max_position_embeddings"] = max_pos
    # strict=False: configs carry keys of other rules and of the model.
    spec = _C.RopeScaling.from_dict(scaling, strict=False)
    spec.validate(rotary_dim)

    rows = _first(max_seq_len, max_pos, 4096)
    kwargs = {
        "dim": rotary_dim,
        "max_seq_len": int(rows),
        "theta": float(theta),
        "interleaved": False,
        "scaling": spec.to_dict(),
    }
    if axial:
        kwargs.update(axes_dim=[rotary_dim // 2, rotary_dim // 2], axes_shared_spectrum=True)
    if mrope is not None:
        if isinstance(mrope, (str, bytes)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in mrope):
            raise ValueError(f"from_hf_config: mrope_section must be a list of ints, got {mrope!r}")
        _C.mrope_pair_axes(list(mrope), rotary_dim, interleaved)  # the C++ check: sections sum to dim / 2
        kwargs["mrope_section"] = list(mrope)
        kwargs["mrope_interleaved"] = interleaved
    return kwargs
