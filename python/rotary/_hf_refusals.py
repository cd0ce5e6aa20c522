"""Configs rotary.hf refuses for what transformers builds from them, not for
their family's table entry: no RoPE at all, RoPE that is not 1-D over token
positions, or a vision tower's axial layout rotary has not verified."""

import functools
import importlib
import importlib.util
import pkgutil
import re
from collections.abc import Mapping
from typing import Any, Dict, List

from ._hf_parts import get, given_params
from .hf_families import AXIAL_OWN, FAMILIES, VERIFIED_BY_TESTS

# model_type -> why its transformers code is not a 1-D RoPE over token positions.
_PATCH_2D = "2-D RoPE over continuous patch coordinates, not token positions"
NOT_1D: Dict[str, str] = {
    "qwen2_5_omni_dit": "its DiT attention rotates only head 0, after de-interleaving its dims",
    "dinov3_vit": _PATCH_2D, "eomt_dinov3": _PATCH_2D, "sapiens2": _PATCH_2D,
    "llama4_vision_model": "2-D RoPE over the patch grid (a complex freqs_cis built without position ids)",
    "vjepa2": "3-D RoPE over a video's frame, row and column, each a third of the head with its own spectrum",
    **{name: "ALiBi attention biases: no RoPE" for name in ("mpt", "bloom")},
    # Sub-models of packages that rotate elsewhere (their text model): the
    # model transformers builds from these configs has no rotary embedding.
    **{name: "the model transformers builds from it has no rotary embedding (its package rotates in another "
             "sub-model)" for name in (
        "clvp_decoder", "cosmos3_edge_vision", "deepseek_ocr2_sam_vision_model", "edgetam_video_mask_decoder",
        "emu3_vqgan", "gemma4_audio", "granite_docling_vision", "hunyuan_vl_vision", "hy_v4_vl_vision",
        "idefics_vision", "mllama_vision_model", "molmo2_adapter", "molmo2_vision", "moshi_depth", "phi4_multimodal_audio",
        "phi4_multimodal_vision", "qwen2_5_omni_audio_encoder", "qwen3_omni_moe_audio_encoder",
        "sam2_video_mask_decoder", "sam3_detr_decoder", "sam3_detr_encoder", "sam3_geometry_encoder",
        "sam3_mask_decoder", "sam3_tracker_video_mask_decoder", "unlimited_ocr_sam_vision_model",
        "unlimited_ocr_vision_encoder")},
    # Well-known models without RoPE (learned, sinusoidal or relative positions);
    # by name, as a dict and its object must read alike.
    **{name: "no RoPE (learned, sinusoidal or relative position embeddings)" for name in (
        "bert", "biogpt", "ctrl", "detr", "gpt2", "gpt_bigcode", "gpt_neo", "openai-gpt", "opt", "roberta", "vit",
        "whisper", "xglm")},
}
# Families whose attention rotates only under this position_embedding_type.
ROTARY_POSITION_TYPE = {"granitemoehybrid": "rope", "esm": "rotary"}
# Config classes without rope_parameters: their rotary class reads the
# top-level rope_theta alone, and a rule given anyway is never read.
READS_TOP_THETA_ONLY = frozenset({"esm"})
# Vision towers whose "axial" rule rotary reproduces: Pixtral deals one
# spectrum alternately to the h and w axes (axes_shared_spectrum); Qwen2-VL,
# Qwen2.5-VL, GLM-4V, ... give each axis its own (hf_families.AXIAL_OWN).
AXIAL_SERVED = frozenset({"pixtral"}) | AXIAL_OWN


def refuse_unserved(config: Any, model_type: str) -> None:
    """A ValueError naming model_type and the field, for a config whose model
    transformers builds no 1-D RoPE for."""
    who = f"model_type {model_type!r}" if model_type else "a config without model_type"
    if model_type in NOT_1D:
        raise ValueError(f"from_hf_config: {who} is not supported: {NOT_1D[model_type]}")
    refuse_without_rope(model_type)
    if model_type == "falcon" and get(config, "alibi") is True:
        raise ValueError("from_hf_config: falcon with alibi=True uses ALiBi attention biases, no RoPE; rotary "
                         "serves falcon with alibi=False")
    heads = (get(config, "encoder_num_attention_heads"), get(config, "decoder_num_attention_heads"))
    if model_type == "moonshine" and None not in heads and heads[0] != heads[1]:
        # Its attention sets config.num_attention_heads while building each stack: the
        # tables' head_dim follows whichever was built last, not the heads they rotate.
        raise ValueError(f"from_hf_config: moonshine with encoder_num_attention_heads={heads[0]} and "
                         f"decoder_num_attention_heads={heads[1]}: transformers sizes both stacks' tables by one "
                         "head count as it builds them; rotary serves equal head counts")
    wanted = ROTARY_POSITION_TYPE.get(model_type)
    if wanted is not None and get(config, "position_embedding_type") != wanted:
        raise ValueError(f"from_hf_config: {model_type} with position_embedding_type="
                         f"{get(config, 'position_embedding_type')!r} builds no rotary embedding; rotary serves "
                         f"position_embedding_type={wanted!r}")
    if model_type in READS_TOP_THETA_ONLY and given_params(config):
        raise ValueError(f"from_hf_config: {model_type}'s rotary class reads only the top-level rope_theta (the "
                         f"default rule); its config class never reads rope_parameters / rope_scaling, got "
                         f"{given_params(config)!r}: drop it")


# What rotary code looks like in a transformers modeling file: a rotary
# module, or a call of an apply_rotary* function (not its def, nor the kernels
# decorator naming it: Jamba and Nemotron-H keep both, and never rotate).
ROTARY_CODE = re.compile(r"rotary_emb|RotaryEmbedding|(?<!def )(?<!use_kernelized_func\()\bapply_rotary\w*\(")


def modeling_modules(model_type: str) -> List[str]:
    """The transformers modeling modules of a model type: its config's
    package's and its causal LM's (Sarvam-MoE runs Glm4MoeForCausalLM).
    KeyError for a type transformers does not know."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    packages = {transformers.CONFIG_MAPPING[model_type].__module__.rsplit(".", 1)[0]}
    lm = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    if lm is not None:
        packages.add(lm.__module__.rsplit(".", 1)[0])
    return [f"{package}.{sub.name}" for package in sorted(packages)
            for sub in pkgutil.iter_modules(importlib.import_module(package).__path__)
            if sub.name.startswith("modeling_")]


@functools.lru_cache(maxsize=None)
def _transformers_rotates(model_type: str) -> bool:
    """False for a model type transformers knows whose modeling code has no
    rotary code at all; True where it has, and where rotary cannot tell (no
    transformers, an unknown type, a file it cannot read)."""
    try:
        names = modeling_modules(model_type)
    except Exception:
        return True
    for name in names:
        try:
            with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
                if ROTARY_CODE.search(f.read()):
                    return True
        except (OSError, AttributeError, TypeError):
            return True
    return False


def refuse_without_rope(model_type: str) -> None:
    """A model type outside rotary's table whose transformers code never rotates."""
    if model_type and model_type not in FAMILIES and model_type not in NOT_1D and not _transformers_rotates(model_type):
        raise ValueError(f"from_hf_config: model_type {model_type!r} is not supported: transformers' modeling code "
                         "for it has no rotary embedding (no RoPE)")


def refuse_unverified(model_type: str) -> None:
    """A model type no test checks against transformers: neither swept
    (integrations.hf_support) nor in rotary's table. Read as Llama's it would
    be a guess (V-JEPA 2's three-axis grid, ChatGLM's interleaved half)."""
    from .integrations import hf_support  # not at import: it imports rotary.hf

    if model_type and not any(model_type in s for s in (hf_support.SUPPORTED, FAMILIES, VERIFIED_BY_TESTS,
                                                         AXIAL_SERVED)):
        raise ValueError(f"from_hf_config: model_type {model_type!r} is not verified: neither the HF sweep of "
                         f"transformers {hf_support.TRANSFORMERS_VERSION} nor a test of rotary's family table "
                         "(rotary.hf_families) checks it against its rotary code (docs/transformers.md); pass "
                         "allow_unverified=True if it rotates rotate_half pairs over int(head_dim * "
                         "partial_rotary_factor) leading dims of each head by token position")


def refuse_tower_width(head_dim: int, width: Any, heads: Any, width_field: str, model_type: str) -> None:
    """An AXIAL_OWN tower's rotary class sizes its table by head_dim, its
    attention cuts heads at width / heads: transformers fails where they differ."""
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width // heads != head_dim:
        raise ValueError(f"from_hf_config: head_dim={head_dim}: transformers' {model_type} rotary class builds its "
                         f"table head_dim wide, but its attention cuts heads {width_field} / num_heads = "
                         f"{width // heads} wide (transformers fails there); drop head_dim")


def refuse_axial(model_type: str) -> None:
    if model_type not in AXIAL_SERVED:
        raise ValueError(f"from_hf_config: rope_type 'axial' of model_type {model_type!r} is not supported: each "
                         "vision tower lays its h / w tables out its own way, and only pixtral's and those of "
                         "rotary.hf_families.AXIAL_OWN are verified against transformers")


# Config fields a rotation can read: its tables come from the top-level config.
_ROTATION_FIELD = re.compile(r"rope|rotary|head_dim|hidden_size|max_position")


def per_layer_rotation(config: Any) -> List[str]:
    """The fields the rotation reads that a heterogeneous config's layers
    (per_layer_config) override: none for Step-3.5's head counts beside its
    head_dim, head_dim for Gemma 4's full-attention layers."""
    if isinstance(config, Mapping):
        layers = config.get("per_layer_config") or {}
        layers = list(layers.values()) if isinstance(layers, Mapping) else list(layers)
        top = config
    elif getattr(config, "is_heterogeneous", False) is True:
        layers, top = [vars(layer) for layer in config.per_layer_config], vars(config)
    else:
        return []
    reads = (lambda key: _ROTATION_FIELD.search(key) or (key == "num_attention_heads" and top.get("head_dim") is None))
    return sorted({key for layer in layers for key, value in dict(layer).items()
                   if isinstance(key, str) and reads(key) and value != top.get(key)})


def refuse_per_layer_rotation(config: Any, model_type: str) -> None:
    """A heterogeneous config is served whole where its layers override
    nothing the rotation reads; else each layer type's own config is."""
    changed = per_layer_rotation(config)
    if changed:
        raise ValueError(f"from_hf_config: per_layer_config: {model_type or 'the config'} sets {', '.join(changed)} "
                         "per layer, so one table does not serve its layers; pass the config object's "
                         "per_layer_config[layer_type] (its text_config's, for a composite)")
