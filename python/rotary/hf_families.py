"""Per-family RoPE facts of Hugging Face ``transformers`` models, keyed by
``model_type``: how a family pairs dims and which span of the head it rotates.
Read by ``rotary.hf``; every entry is checked against transformers' own
rotary code by tests/python/test_hf_config.py.

- ``pairing``: ``"half"`` pairs ``(j, j + d/2)`` (``rotate_half``);
  ``"interleaved"`` pairs ``(2j, 2j + 1)`` (GPT-J's ``rotate_every_two``,
  ``repeat_interleave``-built cos/sin, complex multiplication).
- ``span``: ``"leading"``: the first ``int(head_dim * partial_rotary_factor)``
  dims; ``"rotary_dim"``: the first ``config.rotary_dim`` dims (GPT-J);
  ``"mla"``: the trailing ``qk_rope_head_dim`` dims of a ``[nope | rope]``
  head (``rotary_offset = qk_nope_head_dim``, DeepSeek MLA).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["Family", "FAMILIES", "GENERIC_FIELDS", "family_of"]


@dataclass(frozen=True)
class Family:
    pairing: str = "half"
    span: str = "leading"
    # A config bool that picks the pairing, and its default (True: interleaved).
    interleave_field: Optional[str] = None
    interleave_default: bool = False
    # A fixed base: the family's code ignores rope_theta / rope_parameters.
    theta: Optional[float] = None
    # Default mrope sections (the rotary class's own) and their layout.
    mrope_section: Optional[Tuple[int, ...]] = None
    mrope_interleaved: bool = False
    # (standard name, this family's config.json name), for the dict form.
    aliases: Tuple[Tuple[str, str], ...] = ()
    # Keys of rope_parameters the family's attention reads, not its rotation
    # (Ministral 3 scales q by position with llama_4_scaling_beta).
    attention_keys: Tuple[str, ...] = ()
    # Set: the family is refused, with this reason.
    refuse: Optional[str] = None

    @property
    def fields(self) -> Tuple[str, ...]:
        """Family-specific config fields this entry reads."""
        out = {"rotary_dim": ("rotary_dim",), "mla": ("qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim")}
        return out.get(self.span, ()) + ((self.interleave_field,) if self.interleave_field else ())


# Rope-named config fields whose meaning is the same in every family.
GENERIC_FIELDS = frozenset({
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "rotary_pct", "rotary_emb_base",  # GPT-NeoX 4.x config.json
    "ignore_keys_at_rope_validation",  # transformers bookkeeping
})

_HALF = Family()
_INTER = Family(pairing="interleaved")
_GPTJ = Family(pairing="interleaved", span="rotary_dim", theta=10000.0,
               aliases=(("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
                        ("max_position_embeddings", "n_positions")))
_QWEN2_VL = Family(mrope_section=(16, 24, 24))
_QWEN3_VL = Family(mrope_section=(24, 20, 20), mrope_interleaved=True)
_QWEN3_5 = Family(mrope_section=(11, 11, 10), mrope_interleaved=True)  # over a partial span
_NOT_VERIFIED = "its rotary code is not rotate_half over one leading span, and rotary does not verify it"

FAMILIES: Dict[str, Family] = {
    # rotate_half over the first int(head_dim * partial_rotary_factor) dims
    **{name: _HALF for name in (
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gpt_neox", "phi", "stablelm",
        "persimmon", "gemma", "olmo", "olmo2", "granite", "starcoder2", "glm4_moe")},
    "ministral3": Family(attention_keys=("llama_4_scaling_beta",)),
    # multimodal RoPE, rotate_half
    "qwen2_vl": _QWEN2_VL, "qwen2_vl_text": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL, "qwen2_5_vl_text": _QWEN2_VL,
    "qwen3_vl": _QWEN3_VL, "qwen3_vl_text": _QWEN3_VL,
    "qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5,
    # (2j, 2j+1) pairs: rotate_every_two, or cos/sin built with repeat_interleave
    "gptj": _GPTJ, "codegen": _GPTJ,
    **{name: _INTER for name in ("cohere", "glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe")},
    # MLA [nope | rope] heads: DeepSeek-V2 rotates complex pairs (interleaved);
    # DeepSeek-V3 / GLM-4.7-Flash interleave when rope_interleave (default True).
    "deepseek_v2": Family(pairing="interleaved", span="mla"),
    "deepseek_v3": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    "glm4_moe_lite": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    "axk1": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    "youtu": Family(span="mla", interleave_field="rope_interleave", interleave_default=True),
    # MLA heads rotated with rotate_half on q_rot / k_rot.
    "minicpm3": Family(span="mla"), "hy_v4": Family(span="mla"),
    # Two pairings in one model: the attention's rope is interleaved, its
    # sparse-attention indexer's rotate_half.
    **{name: Family(refuse="its attention and its indexer pair dims differently (interleaved and rotate_half)")
       for name in ("axk2", "deepseek_v32", "glm_moe_dsa")},
    # Refused: RoPE on some layers only, or pairings / spans not verified.
    "cohere2": Family(refuse="RoPE is applied on its sliding-window layers only (the others have none)"),
    "llama4": Family(refuse="RoPE is skipped on its no_rope_layers, and its pairing is complex-interleaved"),
    "smollm3": Family(refuse="RoPE is skipped on its no_rope_layers"),
    **{name: Family(refuse=_NOT_VERIFIED) for name in (
        "bailing_hybrid", "blt", "cohere2_moe", "deepseek_v4", "dots3_note",
        "dots3_note_text", "efficientloftr", "hy_v4_vl", "hy_v4_vl_text", "lightglue", "longcat_flash",
        "mistral4", "mistral_large4", "mistral_large4_text", "moonshine", "moonshine_streaming",
        "llama4_text", "blt_global_transformer", "blt_local_decoder", "blt_local_encoder",
        "blt_patcher", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text", "glm4v", "glm4v_text", "glm_ocr", "glm_ocr_text",
        "inkling2", "inkling2_text", "moonshine_streaming_encoder", "neomme", "openai_privacy_filter", "roformer",
        "edgetam_video", "sam2_video", "sam3", "sam3_tracker_video")},
}


def family_of(model_type: str) -> Optional[Family]:
    return FAMILIES.get(model_type)
