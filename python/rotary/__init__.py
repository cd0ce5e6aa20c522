"""rotary: Rotary Position Embedding (RoPE) as dispatcher ops for PyTorch.

Importing this package registers ``torch.ops.rotary.*`` (CPU, CUDA, Meta and
Autograd kernels, all in C++) and exposes typed wrappers and an ``nn.Module``.
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # registers torch.ops.rotary via librotary
from ._ops import apply_rope, apply_rope_qk, rope_freqs
from .module import RotaryEmbedding

CppRotaryEmbedding = _C.CppRotaryEmbedding

__all__ = [
    "apply_rope",
    "apply_rope_qk",
    "rope_freqs",
    "RotaryEmbedding",
    "CppRotaryEmbedding",
]
__version__ = "0.1.0"
