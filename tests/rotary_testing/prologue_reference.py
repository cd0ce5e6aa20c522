"""The prologue's float64 reference (apply_qk_norm_rope): RMSNorm of the
whole head, then the rotation of reference.py on the rotated span. Written
from the definitions; nothing here calls rotary."""

import torch

from .reference import inv_freq
from .rope_testing import TOL, randn, ref_rope4, ref_varlen


def ref_norm(x, w, eps, norm, offset, heads_axis):
    """float64 RMSNorm of x as passed: over head_dim ("head") or over the
    heads axis and head_dim ("heads"), times (w + offset)."""
    X = x.detach().to("cpu", torch.float64)
    dims = (-1,) if norm == "head" else (heads_axis, -1)
    y = X / torch.sqrt((X * X).mean(dim=dims, keepdim=True) + eps)
    if w is None:
        return y * (1.0 + offset)
    weff = w.detach().to("cpu", torch.float32).double() + offset
    if norm == "heads":
        shape = [1] * X.dim()
        shape[heads_axis], shape[-1] = X.shape[heads_axis], X.shape[-1]
        weff = weff.view(shape)
    return y * weff


def ref_prologue(x, w, r, off=0, start=0, interleaved=True, positions=None, eps=1e-6, norm="head", offset=0.0,
                 layout="BHSD", cu=None, inverse=False):
    """Norm the whole head, then rotate dims [off, off + r) (as a head of r
    dims), by the negative angle with inverse."""
    axis = 1 if cu is not None else (2 if layout in ("BSHD", "SBHD") else 1)
    y = ref_norm(x, w, eps, norm, offset, axis)
    span = y[..., off:off + r]
    if cu is not None:
        rot = ref_varlen(span, cu, r, start, interleaved, positions, inverse)
    else:
        rot = ref_rope4(span, r, start, interleaved, positions, inverse, layout)
    return torch.cat([y[..., :off], rot, y[..., off + r:]], dim=-1)


def heads_weight(norm, H, D, dtype, seed, device):
    n = D if norm == "head" else H * D
    return (1.0 + 0.5 * randn((n,), torch.float32, seed)).to(dtype).to(device)


def check(out, ref, dtype):
    rtol, atol = TOL[dtype]
    assert out.dtype == dtype and tuple(out.shape) == tuple(ref.shape)
    torch.testing.assert_close(out.detach().to("cpu", torch.float64), ref, rtol=rtol, atol=atol)


def ref_norm_rope(x, w, start, positions=None, heads=False):
    """float64 RMSNorm of [B, H, S, D] x over head_dim (heads: over every
    head too; eps 1e-6, weight w), then RoPE with interleaved pairs at
    positions start + s (or `positions`), in differentiable torch ops (for
    gradients and tangents)."""
    D = x.shape[-1]
    if heads:
        xn = x * torch.rsqrt(x.pow(2).mean((1, 3), keepdim=True) + 1e-6) * w.view(1, x.shape[1], 1, D)
    else:
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    pos = start + torch.arange(x.shape[2], dtype=torch.float64) if positions is None else positions
    ang = pos[:, None] * torch.from_numpy(inv_freq(D))
    c, s = ang.cos(), ang.sin()
    x0, x1 = xn[..., 0::2], xn[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)
