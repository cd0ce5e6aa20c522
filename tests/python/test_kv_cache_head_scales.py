"""rotary.KVCache with one float8 scale per kv head (k_scale=[...]): the
bits each head stores against the reference quantisation at its own scale,
keys_values dequantised per head, both module front ends and layouts, the
state (state_dict, pickle, deepcopy, clone), and the refusals by name."""

import copy
import pickle

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, quantize
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import randn

pytestmark = pytest.mark.usefixtures("reset_dynamo")

K_SCALES, V_SCALES = [0.5, 2.0, 0.125], [0.25, 4.0, 1.0]  # powers of two: dequantising is exact


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_each_head_is_stored_at_its_own_scale(make, layout, device):
    rope = make(16, 64).to(device)
    cache = rotary.KVCache(2, 3, 8, 16, layout=layout, dtype=FP8, k_scale=K_SCALES, v_scale=V_SCALES).to(device)
    assert "k_scale=[0.5, 2, 0.125]" in repr(cache) and cache.k_scale.shape == (3,)
    for step, (S, seed) in enumerate([(5, 1), (1, 4)]):
        start = cache.length
        q, k, v = (randn((2, h, S, 16), torch.float32, seed + i, device) for i, h in enumerate((6, 3, 3)))
        want_k = rope(q, k, start)[1].cpu()
        ref = rope_reference(k.double().cpu(), start)  # before the call rotates k in place
        _, keys, values = rope.forward_with_cache(q, k, v, cache)
        keys, v = keys.cpu(), v.cpu()
        stored_k = (cache.k if layout == "BHSD" else cache.k.transpose(1, 2)).cpu()
        stored_v = (cache.v if layout == "BHSD" else cache.v.transpose(1, 2)).cpu()
        rows = slice(start, start + S)
        assert torch.equal(_bits(stored_k[:, :, rows]), _bits(quantize(want_k, torch.tensor(K_SCALES), 1))), step
        assert torch.equal(_bits(stored_v[:, :, rows]), _bits(quantize(v, torch.tensor(V_SCALES), 1))), step
        # Dequantised per head: the stored value times its head's scale, exactly (powers of two).
        per_head = torch.tensor(K_SCALES).view(1, 3, 1, 1)
        assert torch.equal(keys[:, :, rows], stored_k[:, :, rows].float() * per_head)
        # And near the float64 rotation: fp8 keeps 3 mantissa bits.
        torch.testing.assert_close(keys[:, :, rows].double(), ref, rtol=0.07, atol=0.02 * max(K_SCALES))
    # A scale read the wrong way round (one per tensor, or another head's) stores other bits.
    assert not torch.equal(_bits(stored_k[:, :, rows]), _bits(quantize(want_k, torch.tensor(K_SCALES[0]), 1)))


def test_state_travels_and_is_checked():
    rope = rotary.RotaryEmbedding(16, 64)
    cache = rotary.KVCache(1, 3, 8, 16, dtype=FP8, k_scale=K_SCALES, v_scale=0.5)
    q, k, v = (randn((1, h, 4, 16), torch.float32, 10 + i) for i, h in enumerate((3, 3, 3)))
    rope.forward_with_cache(q, k, v, cache)
    keys = cache.keys_values()[0]
    for other in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache), cache.clone()):
        assert torch.equal(other.k_scale, cache.k_scale) and other.length == 4
        assert torch.equal(other.keys_values()[0], keys)
    twin = rotary.KVCache(1, 3, 8, 16, dtype=FP8, k_scale=[1.0, 1.0, 1.0], v_scale=0.5)
    twin.load_state_dict(cache.state_dict())
    assert torch.equal(twin.keys_values()[0], keys) and twin.k_scale.tolist() == K_SCALES
    # A cache of one scale is not one of three: refused by name, left as it was.
    single = rotary.KVCache(1, 3, 8, 16, dtype=FP8, k_scale=0.5, v_scale=0.5)
    before = [t.clone() for t in single.buffers()]
    with pytest.raises(RuntimeError, match=r"saved k_scale is Float \[3\], this cache's is Float \[\]"):
        single.load_state_dict(cache.state_dict())
    assert all(torch.equal(_bits(a) if a.dtype == FP8 else a, _bits(b) if b.dtype == FP8 else b)
               for a, b in zip(single.buffers(), before))
    bad = cache.state_dict()
    bad["k_scale"] = torch.tensor([0.5, float("inf"), 1.0])
    with pytest.raises(RuntimeError, match=r"saved k_scale\[1\] must be finite and > 0, got inf"):
        twin.load_state_dict(bad)


def test_one_saved_scale_loads_into_a_per_head_cache():
    # [] and [1] mean one scale for every head: a per-head cache takes it for
    # each head, and with kv_heads = 1 either shape loads into the other.
    rope = rotary.RotaryEmbedding(16, 64)
    for heads in (1, 3):
        single = rotary.KVCache(1, heads, 8, 16, dtype=FP8, k_scale=0.25, v_scale=0.5)
        q, k, v = (randn((1, heads, 4, 16), torch.float32, 20 + i) for i in range(3))
        rope.forward_with_cache(q, k, v, single)
        per_head = rotary.KVCache(1, heads, 8, 16, dtype=FP8, k_scale=[1.0] * heads, v_scale=[2.0] * heads)
        per_head.load_state_dict(single.state_dict())
        assert per_head.k_scale.tolist() == [0.25] * heads and per_head.v_scale.tolist() == [0.5] * heads
        assert torch.equal(_bits(per_head.keys_values()[0]), _bits(single.keys_values()[0]))
        assert torch.equal(per_head.keys_values()[1].float(), single.keys_values()[1].float())
    # kv_heads = 1 the other way: a [1] state into a [] cache.
    back = rotary.KVCache(1, 1, 8, 16, dtype=FP8, k_scale=1.0, v_scale=1.0)
    one = rotary.KVCache(1, 1, 8, 16, dtype=FP8, k_scale=[0.125], v_scale=[4.0])
    back.load_state_dict(one.state_dict())
    assert back.k_scale.dim() == 0 and back.k_scale.item() == 0.125 and back.v_scale.item() == 4.0


def test_scales_of_other_kinds_are_taken_as_before():
    # numpy's floats and a one-element tensor, as the per-tensor argument always took them.
    cache = rotary.KVCache(1, 2, 4, 8, dtype=FP8, k_scale=np.float32(0.5), v_scale=[np.float64(1.0), torch.tensor(2.0)])
    assert cache.k_scale.item() == 0.5 and cache.v_scale.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k_scale=[1.0]), ValueError, r"KVCache: k_scale per head must have kv_heads = 3 entries, got 1"),
    (dict(v_scale=[1.0, 0.0, 1.0]), ValueError, r"KVCache: v_scale\[1\] must be finite and > 0 as a float32, got 0"),
    (dict(k_scale=[1.0, 1.0, 1e-50]), ValueError, r"k_scale\[2\] must be finite and > 0 as a float32, got 1e-50"),
    (dict(k_scale=[1.0, float("nan"), 1.0]), ValueError, r"k_scale\[1\] must be finite and > 0 as a float32, got nan"),
    (dict(k_scale=[]), ValueError, r"KVCache: k_scale must not be empty \(None: 1\), got \[\]"),
    (dict(k_scale=[1.0, True, 1.0]), TypeError, r"KVCache: k_scale\[1\] must be a number, got True"),
    (dict(k_scale="1"), TypeError, r"KVCache: k_scale must be a number, or a list of numbers \(one per kv head\)"),
    (dict(k_scale=[1.0, 10**400, 1.0]), ValueError, r"k_scale\[1\] must be finite, got an int of 1329 bits"),
])
def test_bad_head_scales_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        rotary.KVCache(1, 3, 4, 8, dtype=FP8, **kwargs)


def test_head_scales_need_a_float8_cache():
    with pytest.raises(ValueError, match=r"k_scale is only for float8_e4m3fn caches; dtype Float is stored unscaled"):
        rotary.KVCache(1, 2, 4, 8, k_scale=[1.0, 2.0])
