"""The sweep's check at the rotation itself: every call of a modeling
module's rotation function (the ones the patch replaces) in one forward,
unpatched against patched. Logits can hide a wrong rotation where a tiny
model barely depends on position (HY-V4's by 1.4e-5, under the sweep's
logit tolerance); the rotated q and k cannot."""

import sys

import torch

ROT_TOL = 1e-5  # fp32 rotations, relative to the largest value (one rounding of q and k apart)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


@torch.no_grad()
def rotation_outputs(model, kw):
    """The outputs of every rotation call of one forward, in call order (a
    list of tensors per call); its length is how many times it rotates."""
    from rotary.integrations import _hf_functions
    from rotary.integrations.transformers import _attention_modules

    calls, saved = [], []

    def recorded(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append([t.detach().clone() for t in _tensors(out)])
            return out
        return call

    for name in _attention_modules(model, "BHSD"):  # every rotation function, the complex form too
        module = sys.modules[name]
        for f in _hf_functions.FUNC_NAMES:
            fn = getattr(module, f, None)
            if callable(fn):
                saved.append((module, f, fn))
                setattr(module, f, recorded(fn))
    try:
        model(**kw)
    finally:
        for module, f, fn in saved:
            setattr(module, f, fn)
    return calls


def rotation_diff(got, ref):
    """The largest difference of the patched rotations from transformers',
    relative to each output's largest value; inf when the calls or shapes
    differ. A pair kept in place where transformers writes evens then odds
    (MLA's rope_interleave) counts as equal: q . k is the same."""
    if len(got) != len(ref):
        return float("inf")
    worst = 0.0
    for g_call, r_call in zip(got, ref):
        if len(g_call) != len(r_call):
            return float("inf")
        for g, r in zip(g_call, r_call):
            if g.shape != r.shape:
                return float("inf")
            g, r = (torch.view_as_real(t) if t.is_complex() else t for t in (g, r))
            g, r = g.double(), r.double()
            scale = max(r.abs().max().item(), 1e-30) if r.numel() else 1.0
            d = (g - r).abs().max().item() / scale if r.numel() else 0.0
            if d > ROT_TOL and g.shape[-1] % 2 == 0:
                split = torch.cat([g[..., 0::2], g[..., 1::2]], -1)
                d = min(d, (split - r).abs().max().item() / scale)
            worst = max(worst, d)
    return worst
