"""rotary as a kernel layer for Hugging Face's ``kernels`` route: the
``rotary_pos_emb`` name that transformers' modeling code registers its
``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` under. No
monkey-patching: ``kernels.kernelize`` swaps the function's forward for
:class:`RotaryPosEmb`'s, which rotates with :func:`rotary.apply_rope_cos_sin`
from the cos/sin the model computed.

    from kernels import Mode, kernelize, use_kernel_mapping
    from rotary.integrations.hub import kernel_mapping

    with use_kernel_mapping(kernel_mapping()):
        model = kernelize(model, mode=Mode.INFERENCE, device="cpu")

or, on a GPU, at load with transformers' own loader::

    model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=kernel_config())

:func:`kernel_repository` is the local kernel repository (a directory the
``kernels`` package loads: ``metadata.json`` and ``__init__.py``, whose
``layers`` holds :class:`RotaryPosEmb`). Importing this module does not
import ``kernels`` or ``transformers``.
"""

import functools
import pathlib
import types
from typing import Tuple

import torch
from torch import nn

from .._arg_checks import _plain_int
from .._ops import apply_rope_cos_sin
from ._hf_functions import LAYOUTS

__all__ = ["RotaryPosEmb", "apply_rotary_transformers", "kernel_config", "kernel_mapping", "kernel_repository",
           "layers"]

LAYER_NAME = "rotary_pos_emb"  # transformers' name for apply_rotary_pos_emb


def apply_rotary_transformers(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` contract: q, k ``[batch,
    heads, seq, head_dim]`` (``unsqueeze_dim=2``: ``[batch, seq, heads,
    head_dim]``), cos/sin ``[batch, seq, head_dim]`` rotate_half tables that
    the function multiplies into q and k elementwise (the partial-rotary
    families split q before the call; Pixtral: ``[seq, head_dim]`` with
    ``unsqueeze_dim=0``), in the dtype that product promotes to under
    autocast (q and k of two dtypes: each in its own product's, with or
    without autocast), else in q's (only families whose function returns q's
    dtype hand 16-bit q float32 tables there). Anything else (a table that is not
    rotate_half, of another width or rank) is an error, never misread."""
    # Pixtral: unsqueeze_dim 0 on a [patches, head_dim] table, which broadcasts as BHSD's [seq, head_dim] does.
    if type(unsqueeze_dim) is not int:  # numpy's ints as ints; a bool or a float stays refused below
        unsqueeze_dim = _plain_int(unsqueeze_dim)
    pixtral = type(unsqueeze_dim) is int and unsqueeze_dim == 0 and cos.dim() == 2
    layout = "BHSD" if pixtral else LAYOUTS.get(unsqueeze_dim) if type(unsqueeze_dim) is int else None  # not True
    if layout is None or q.dim() != 4:
        raise ValueError(
            f"rotary_pos_emb: rotary serves 4-D q and k with unsqueeze_dim 1 ([batch, heads, seq, head_dim]) or 2 "
            f"([batch, seq, heads, head_dim]), or 0 with [seq, head_dim] tables (Pixtral), got q of shape "
            f"{tuple(q.shape)} and unsqueeze_dim={unsqueeze_dim!r}"
        )
    if (cos.dim() != 3 and not pixtral) or cos.shape[-1] != q.shape[-1]:
        # A 2-D table broadcasts against another dim of q under unsqueeze_dim; a narrower one (gpt-oss's one
        # value per pair) is another function's contract: its halves can look alike (position 0).
        raise ValueError(
            f"rotary_pos_emb: cos and sin must be [batch, seq, head_dim] = [*, *, {q.shape[-1]}], multiplied into q "
            f"elementwise as transformers' apply_rotary_pos_emb does; got cos of shape {tuple(cos.shape)}")
    # q * cos: bf16 q and float32 tables (autocast) give float32; q and k of two dtypes, each its own product's.
    # Outside autocast only the families whose function returns q's dtype (OLMo's .to(q_type), ModernBERT's
    # upcast) hand 16-bit q float32 tables: there q keeps its dtype. (dtypes alone: torch.compile traces them.)
    table = torch.promote_types(cos.dtype, sin.dtype) if isinstance(sin, torch.Tensor) else cos.dtype
    if k.dtype == q.dtype and not torch.is_autocast_enabled(q.device.type):
        dq = dk = q.dtype
    else:
        dq, dk = torch.promote_types(q.dtype, table), torch.promote_types(k.dtype, table)
    common = torch.promote_types(dq, dk)
    if common.is_floating_point and (q.dtype, k.dtype) != (common, common):
        q, k = q.to(common), k.to(common)
    try:
        q, k = apply_rope_cos_sin(q, k, cos, sin, layout=layout)
    except ValueError as e:
        if "must be rotate_half tables" not in str(e):
            raise
        # The op's way out (interleaved=True) is not this layer's caller's to take.
        raise ValueError(
            "rotary_pos_emb: cos and sin must be rotate_half tables, their two halves equal ([c | c]), as "
            "transformers' apply_rotary_pos_emb multiplies them; these are not, so this model's function has "
            "another contract: leave its rotary_pos_emb unkernelized (rotary.integrations.transformers patches "
            "by family)") from None
    return (q if q.dtype == dq else q.to(dq)), (k if k.dtype == dk else k.to(dk))


class RotaryPosEmb(nn.Module):
    """The layer ``kernels`` swaps in: stateless, with the forward signature
    of the function it replaces."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary_transformers(q, k, cos, sin, unsqueeze_dim)


layers = types.SimpleNamespace(RotaryPosEmb=RotaryPosEmb)


def kernel_repository() -> pathlib.Path:
    """The local kernel repository of :class:`RotaryPosEmb` (installed with
    the package)."""
    return pathlib.Path(__file__).resolve().parent / "hub_kernel"


def kernel_mapping(devices=("cpu", "cuda")) -> dict:
    """``{"rotary_pos_emb": {device: {Mode.FALLBACK: repository}}}`` (``devices``: one
    device type or several) for
    ``kernels.use_kernel_mapping`` / ``register_kernel_mapping``: every mode
    (inference, training, torch.compile), on each device."""
    from kernels import LocalLayerRepository, Mode

    if isinstance(devices, str):
        devices = (devices,)
    try:
        devices = tuple(devices)
    except TypeError:
        raise TypeError(f"kernel_mapping: devices must be a device type or a sequence of them, got "
                        f"{devices!r}") from None
    if not all(isinstance(d, str) for d in devices):
        raise TypeError(f"kernel_mapping: devices must be device types ('cpu', 'cuda'), got {devices!r}")
    for d in devices:  # the ops' kernels: another device's tensors would fail inside the layer
        if d not in ("cpu", "cuda"):
            raise ValueError(f"kernel_mapping: rotary's layer runs on device types 'cpu' and 'cuda', got {d!r} "
                             f"(devices={devices!r})")
    repo = LocalLayerRepository(repo_path=kernel_repository(), layer_name="RotaryPosEmb")
    return {LAYER_NAME: {device: {Mode.FALLBACK: repo} for device in devices}}


def kernel_config():
    """A ``transformers.KernelConfig`` naming :class:`RotaryPosEmb` in the local
    repository, for ``from_pretrained(..., use_kernels=True,
    kernel_config=kernel_config())`` (transformers loads kernels on GPU
    devices only)."""
    return _local_kernel_config_class()({LAYER_NAME: f"{kernel_repository()}:RotaryPosEmb"}, use_local_kernel=True)


@functools.lru_cache(maxsize=None)
def _local_kernel_config_class():
    from transformers import KernelConfig

    class LocalKernelConfig(KernelConfig):
        """transformers 5.24's from_pretrained rewrites each mapping entry as
        (repository, metadata) before it builds the kernels mapping, and its
        local-repository branch reads only a string: the string is given back
        to it."""

        def create_compatible_mapping(self, model, compile=False):
            self.kernel_mapping = {name: repo[0] if isinstance(repo, tuple) else repo
                                   for name, repo in self.kernel_mapping.items()}
            return super().create_compatible_mapping(model, compile)

    return LocalKernelConfig
