"""Which rotary embeddings of a transformers model the patch replaces, and the
config each layer type's table is read from (rotary.integrations.transformers)."""

import inspect
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .._hf_refusals import per_layer_rotation


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _for_text(config: Any, text: Any) -> bool:
    """Whether config is the text model's (None: GPT-J's embedding has none);
    a vision tower's rotary embedding (Qwen2-VL's, Gemma 4's) is left alone."""
    if config is None or text is None or config is text:
        return True
    get = getattr(config, "get_text_config", None)
    return (callable(get) and get() is text) or getattr(config, "model_type", None) == getattr(text, "model_type", 0)


def _is_rotary(m: nn.Module) -> bool:
    """A rotary embedding by what it is, whatever its attribute name (LFM2-MoE's
    pos_emb): forward(x, position_ids, ...) of a *RotaryEmbedding or an inv_freq owner."""
    if not (type(m).__name__.endswith("RotaryEmbedding") or isinstance(getattr(m, "inv_freq", None), torch.Tensor)):
        return False
    try:
        return list(inspect.signature(m.forward).parameters)[:2] == ["x", "position_ids"]
    except (TypeError, ValueError):
        return False


def _of_owner(owner: nn.Module) -> List[Tuple[nn.Module, Optional[float]]]:
    """(rotary embedding, its base or None) of an owner: GraniteSWA's layers
    take rotary_embs, one per base of layer_rope_theta (rotary_emb is unused)."""
    embs = getattr(owner, "rotary_embs", None)
    if isinstance(embs, nn.ModuleList) and len(embs):
        return [(e, (getattr(getattr(e, "config", None), "rope_parameters", None) or {}).get("rope_theta"))
                for e in embs]
    return [(owner.rotary_emb, None)]


def rotary_embeddings(model: nn.Module) -> List[Tuple[nn.Module, Any, Optional[float]]]:
    """(rotary embedding, the config of its tables, its base or None) of each
    rotary embedding of the text model: each owner's rotary_emb, then the
    modules that are one by what they are, with the text config."""
    text, out, seen = _text_config(model), [], set()
    for owner in model.modules():
        emb = getattr(owner, "rotary_emb", None)
        if not isinstance(emb, nn.Module) or id(emb) in seen:
            continue
        config = getattr(owner, "config", None) or getattr(emb, "config", None)
        seen.update(map(id, [emb, *(e for e, _ in _of_owner(owner))]))
        if _for_text(getattr(emb, "config", None), text) and _for_text(config, text):
            out += [(e, config or model.config, theta) for e, theta in _of_owner(owner)]
    for m in model.modules():
        config = getattr(m, "config", None)
        if id(m) not in seen and config is not None and _for_text(config, text) and _is_rotary(m):
            out.append((m, config, None))
    return out


def layer_config(config: Any, layer_type: Optional[str]) -> Any:
    """The config of the layers of layer_type: a heterogeneous config (Gemma 4's
    per_layer_config) that sets head_dim per layer has each layer type's
    attention read its own (transformers raises if a type's layers differ);
    one whose layers override nothing the rotation reads (Step-3.5's head
    counts) is read whole."""
    text = getattr(config, "text_config", None) or config
    if layer_type is None or not getattr(text, "is_heterogeneous", False) or not per_layer_rotation(text):
        return config
    return text.per_layer_config[layer_type]
