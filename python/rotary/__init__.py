"""rotary: Rotary Position Embedding (RoPE) as dispatcher ops for PyTorch.

Importing this package registers ``torch.ops.rotary.*`` (CPU, CUDA, Meta and
Autograd kernels, all in C++) and exposes typed wrappers and an ``nn.Module``.
"""

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # registers torch.ops.rotary via librotary
from ._ops import apply_rope, apply_rope_, apply_rope_qk, apply_rope_qk_, rope_freqs
from ._ops import rope_frequencies
from ._C import alibi_bias, alibi_slopes, sinusoidal_table  # the older schemes of the seeds
from .hf import rope_kwargs_from_hf_config
from .module import RotaryEmbedding

CppRotaryEmbedding = _C.CppRotaryEmbedding
RopeScaling = _C.RopeScaling

__all__ = [
    "apply_rope",
    "apply_rope_",
    "apply_rope_qk",
    "apply_rope_qk_",
    "rope_freqs",
    "rope_frequencies",
    "rope_kwargs_from_hf_config",
    "RopeScaling",
    "RotaryEmbedding",
    "CppRotaryEmbedding",
    "sinusoidal_table",
    "alibi_slopes",
    "alibi_bias",
]
__version__ = "0.1.0"
