"""Drop-in integrations of ``rotary`` into other libraries.

``rotary.integrations.transformers``: patch a Hugging Face Llama-family model
so its q/k rotation runs through ``torch.ops.rotary`` (importing it does not
import ``transformers``).
"""

from .transformers import (
    SUPPORTED_MODEL_TYPES,
    RotaryPositions,
    apply_rotary_to_model,
    is_patched,
    patch_llama,
    rotary_embedding_of,
    rotary_patched,
    unpatch,
    unpatch_llama,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "RotaryPositions",
    "apply_rotary_to_model",
    "is_patched",
    "patch_llama",
    "rotary_embedding_of",
    "rotary_patched",
    "unpatch",
    "unpatch_llama",
]
