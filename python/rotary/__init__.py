"""rotary: Rotary Position Embedding (RoPE) as dispatcher ops for PyTorch.

Importing this package registers ``torch.ops.rotary.*`` (CPU, CUDA, Meta and
Autograd kernels, all in C++) and exposes typed wrappers and an ``nn.Module``.
A process that only runs a saved ``torch.export`` program or an AOTInductor
package needs the ops but not this package: ``torch.ops.load_library(path)``
with the path :func:`library_path` gives (docs/deploy.md).
"""

import os

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # registers torch.ops.rotary via librotary
from ._ops import apply_rope, apply_rope_, apply_rope_qk, apply_rope_qk_, apply_rope_with_kv_cache_
from ._ops import apply_qk_norm_rope, apply_qk_norm_rope_, apply_qk_norm_rope_with_kv_cache_
from ._ops import apply_rope_cos_sin
from ._ops import freqs_table, inv_frequencies
from ._ops import rope_freqs, rope_frequencies  # deprecated aliases, removed in the next release
from ._ops import alibi_bias, alibi_slopes, sinusoidal_table  # the older position schemes, for comparison
from .hf import rope_kwargs_from_hf_config
from .module import RotaryEmbedding
from . import _functionalize, _nested, _vmap

_functionalize._install()  # complex tables under the default inductor
_nested._install()  # jagged nested tensors refused by name
_vmap._install()  # torch.func.vmap: one call with the vmapped dim in the heads

if torch.distributed.is_available():  # DTensor rules, installed when DTensor is imported
    from . import distributed as _distributed

    _distributed._install()

CppRotaryEmbedding = _C.CppRotaryEmbedding
KVCache = _C.KVCache  # the C++ rotary::KVCache; filled by CppRotaryEmbedding.forward_with_cache
RopeScaling = _C.RopeScaling


def library_path() -> str:
    """Absolute path of librotary, the shared library that registers
    ``torch.ops.rotary``. A process that loads a saved ``ExportedProgram``
    (``torch.export.load``) or an AOTInductor package without importing
    ``rotary`` calls ``torch.ops.load_library(path)`` first."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.startswith("librotary") and (".so" in name or name.endswith(".dylib")):
            return os.path.join(here, name)
    raise FileNotFoundError(f"rotary.library_path: no librotary shared library in {here}")


__all__ = [
    "apply_rope",
    "apply_rope_",
    "apply_rope_qk",
    "apply_rope_qk_",
    "apply_rope_with_kv_cache_",
    "apply_qk_norm_rope",
    "apply_qk_norm_rope_",
    "apply_qk_norm_rope_with_kv_cache_",
    "apply_rope_cos_sin",
    "freqs_table",
    "inv_frequencies",
    "library_path",
    "rope_freqs",
    "rope_frequencies",
    "rope_kwargs_from_hf_config",
    "RopeScaling",
    "RotaryEmbedding",
    "CppRotaryEmbedding",
    "KVCache",
    "sinusoidal_table",
    "alibi_slopes",
    "alibi_bias",
]
__version__ = "0.1.0"
