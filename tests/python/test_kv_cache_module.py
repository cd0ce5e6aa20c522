"""rotary.KVCache with CppRotaryEmbedding.forward_with_cache (bound from
C++): the cache fills step by step (float8_e4m3fn too), refuses past its
capacity and a rotary span past head_dim, and writes nothing then. (Split
from the old test_kv_cache.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, quantize

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# rotary.KVCache + CppRotaryEmbedding.forward_with_cache (bound from C++)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout,dtype", [("BHSD", torch.float32), ("BSHD", torch.bfloat16), ("BHSD", FP8)])
def test_cpp_module_forward_with_cache(layout, dtype):
    from rotary_testing.rope_testing import randn

    rope = rotary.CppRotaryEmbedding(32, 64)
    scales = dict(k_scale=0.5, v_scale=0.25) if dtype == FP8 else {}  # refused on other caches
    cache = rotary.KVCache(2, 2, 8, 32, layout=layout, dtype=dtype, **scales)
    assert "capacity=8" in repr(cache) and cache.length == 0
    work = torch.float32 if dtype == FP8 else dtype
    for step, (S, seed) in enumerate([(5, 1), (1, 4), (1, 7)]):
        start = cache.length
        q, k, v = (randn((2, h, S, 32), work, seed + i) for i, h in enumerate((4, 2, 2)))
        want_q, want_k = rope(q, k, start)
        got_q, keys, values = rope.forward_with_cache(q, k, v, cache)
        assert got_q is q and torch.equal(q, want_q) and torch.equal(k, want_k), step
        assert cache.length == start + S and keys.shape == (2, 2, start + S, 32)
        new_k, new_v = keys[:, :, start:], values[:, :, start:]
        if dtype == FP8:
            # dequantised as x * scale (powers of two here): the stored bits come back exactly
            assert torch.equal((keys[:, :, start:] / 0.5).to(FP8).view(torch.uint8), quantize(want_k, torch.tensor(0.5), 1).view(torch.uint8))
            assert torch.equal((values[:, :, start:] / 0.25).to(FP8).view(torch.uint8), quantize(v, torch.tensor(0.25), 1).view(torch.uint8))
        else:
            assert torch.equal(new_k, want_k) and torch.equal(new_v, v)
    full = cache.length
    before = [t.clone() for t in cache.buffers()]
    q, k, v = (randn((2, h, 2, 32), work, 9) for h in (4, 2, 2))
    with pytest.raises(IndexError, match="exceeds its capacity 8"):
        rope.forward_with_cache(q, k, v, cache)
    assert cache.length == full and all(torch.equal(a.float(), b.float()) for a, b in zip(cache.buffers(), before))
    cache.truncate(3)
    assert cache.length == 3


def test_cpp_module_forward_with_cache_refuses_a_span_past_head_dim():
    # A rotary_offset is served (test_kv_cache_features.py); a span past head_dim is not.
    from rotary_testing.rope_testing import randn

    rope = rotary.CppRotaryEmbedding(16, 64, rotary_offset=24)
    cache = rotary.KVCache(1, 1, 8, 32)
    q, k, v = (randn((1, h, 2, 32), torch.float32, 20 + h) for h in (2, 1, 1))
    before = [t.clone() for t in (q, k, *cache.buffers())]
    with pytest.raises(ValueError, match=r"head_dim must be >= rotary_offset \+ dim = 40 .*got head_dim 32"):
        rope.forward_with_cache(q, k, v, cache)
    assert cache.length == 0 and all(torch.equal(a, b) for a, b in zip((q, k, *cache.buffers()), before))


def test_fp8_cache_dequantised_in_float64_for_float64():
    """keys_values multiplied fp8 by its scale in float32 for a float64
    caller: off by up to a float32 rounding (5e-8 here)."""
    cache = rotary.KVCache(1, 2, 8, 16, dtype=FP8, k_scale=0.37, v_scale=1.3)
    rope = rotary.CppRotaryEmbedding(16, 32)
    q, k, v = (torch.randn(1, 2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in (1, 2, 3))
    _, keys, values = rope.forward_with_cache(q, k, v, cache)
    assert keys.dtype == values.dtype == torch.float64
    stored_k, stored_v = cache.k[:, :, :5].to(torch.float64), cache.v[:, :, :5].to(torch.float64)
    scale_k, scale_v = cache.k_scale.to(torch.float64), cache.v_scale.to(torch.float64)  # stored as float32
    assert torch.equal(keys, stored_k * scale_k) and torch.equal(values, stored_v * scale_v)


def test_clone_gives_a_module_and_the_bare_one_is_named():
    """clone() of a bound C++ module is a module of its class with its own
    buffers and state (torch's binding returned the bare C++ module, which
    nothing could call); the bare one, reached as .cpp_module, is named in
    forward_with_cache's refusal."""
    rope = rotary.RotaryEmbedding(16, 32)
    cache = rotary.KVCache(1, 2, 8, 16)
    q = torch.randn(1, 2, 3, 16)
    rope.forward_with_cache(q.clone(), q.clone(), q.clone(), cache)
    twin = cache.clone()
    assert type(twin) is rotary.KVCache and twin.length == cache.length == 3
    assert torch.equal(twin.k, cache.k) and twin.k.data_ptr() != cache.k.data_ptr()
    rope.forward_with_cache(q.clone(), q.clone(), q.clone(), twin)
    assert twin.length == 6 and cache.length == 3, "the clone shares the original's state"
    cpp = rotary.CppRotaryEmbedding(16, 32)
    cpp_twin = cpp.clone()
    assert type(cpp_twin) is rotary.CppRotaryEmbedding and torch.equal(cpp_twin.freqs, cpp.freqs)
    assert cpp_twin.freqs.data_ptr() != cpp.freqs.data_ptr()
    torch.testing.assert_close(cpp_twin(q), cpp(q), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"cache must be a rotary.KVCache, got KVCache \(the bare C\+\+ module, "
                                        r"cache.cpp_module; pass the rotary.KVCache itself\)"):
        rope.forward_with_cache(q, q.clone(), q.clone(), cache.cpp_module)


def test_reset_empties_the_cache_from_python():
    """A cache forked mid-write is told to reset() it; Python's KVCache had
    no reset(). It gives the buffers fresh zero storage (kv_cache.md) and
    empties the cache."""
    rope, cache = rotary.RotaryEmbedding(8, 16), rotary.KVCache(1, 2, 4, 8)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with torch.no_grad():
        rope.forward_with_cache(q, k, v, cache)
    buffer, before = cache.k, cache.k.view(-1)
    assert cache.length == 3 and buffer.abs().sum() > 0
    cache.reset()
    assert cache.length == 0 and cache.k is buffer and not cache.k.any() and not cache.v.any()
    assert before.abs().sum() > 0 and before.data_ptr() != cache.k.data_ptr()  # new storage, as documented
    with torch.no_grad():
        rope.forward_with_cache(q.clone(), k.clone(), v, cache)
    assert cache.length == 3 and torch.equal(cache.v[:, :, :3], v)
