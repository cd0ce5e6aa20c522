"""rotary.KVCache's state as it travels (state_dict, pickle, deepcopy, a
move) and in-place writes to inference tensors: each restores exactly what
the cache holds (its length and the scales it uses included), or refuses by
name and writes nothing."""

import copy
import pickle

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import rotate_pairs_nd
from rotary_testing.rope_testing import randn

FP8 = torch.float8_e4m3fn


def raw(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def snapshot(cache):
    return [raw(t).clone() for t in cache.buffers()] + [cache.length]


def same(before, cache):
    return all(torch.equal(a, raw(b)) for a, b in zip(before, cache.buffers())) and before[-1] == cache.length


def rotated(x, pos):
    """float64 reference: x [.., S, 16] rotated (interleaved, theta 1e4) at positions pos.."""
    inv = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    angle = (pos + np.arange(x.shape[-2]))[:, None] * inv
    return torch.from_numpy(rotate_pairs_nd(x.double().numpy(), angle, True))


def filled(dtype=torch.float32, **kw):
    """A cache holding 3 rotated tokens (positions 0..2), with the inputs."""
    rope = rotary.RotaryEmbedding(16, 32)
    cache = rotary.KVCache(1, 2, 8, 16, dtype=dtype, **kw)
    k, v = randn((1, 2, 3, 16), seed=2), randn((1, 2, 3, 16), seed=3)
    rope.forward_with_cache(randn((1, 2, 3, 16), seed=1), k.clone(), v, cache)
    return rope, cache, k, v


def test_state_dict_carries_the_length():
    """Loaded, the cache appends at the saved length: the next token is
    rotated at position 3 and written to row 3, rows 0..2 kept."""
    rope, a, _, _ = filled()
    assert set(a.state_dict()) == {"k", "v", "_extra_state"}
    b = rotary.KVCache(1, 2, 8, 16)
    b.load_state_dict(a.state_dict())
    assert b.length == 3 and torch.equal(b.k, a.k)
    k1 = randn((1, 2, 1, 16), seed=4)
    _, keys, _ = rope.forward_with_cache(randn((1, 2, 1, 16), seed=5), k1.clone(), randn((1, 2, 1, 16), seed=6), b)
    assert keys.shape == (1, 2, 4, 16) and torch.equal(b.k[:, :, :3], a.k[:, :, :3])
    torch.testing.assert_close(b.k[:, :, 3:4].double(), rotated(k1, 3), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["fp32-into-fp8", "fp32-into-fp16", "bshd-into-bhsd", "no-length", "meta-v",
                                  "not-a-tensor", "sparse-v", "mkldnn-v"])
def test_refused_loads_change_nothing(case):
    _, src, _, _ = filled()
    sd = src.state_dict()
    # An empty cache: a partial load would show.
    dst = {"fp32-into-fp8": lambda: rotary.KVCache(1, 2, 8, 16, dtype=FP8, k_scale=0.5),
           "fp32-into-fp16": lambda: rotary.KVCache(1, 2, 8, 16, dtype=torch.float16)}.get(
               case, lambda: rotary.KVCache(1, 2, 8, 16))()
    if case == "bshd-into-bhsd":  # a [1, 8, 2, 16] BSHD cache would have the same buffer shape as this one
        sd = {**sd, "_extra_state": {"length": 3, "layout": "BSHD"}}
    want = {"fp32-into-fp8": r"the state has k, v, _extra_state but not k_scale, v_scale",
            "fp32-into-fp16": r"saved k is Float \[1, 2, 8, 16\], this cache's is Half",
            "bshd-into-bhsd": r"the state was saved from a 'BSHD' cache, this one is 'BHSD'",
            "no-length": r"the state has k, v but not _extra_state",
            "meta-v": r"the saved 'v' is a meta tensor",
            "not-a-tensor": r"the saved 'v' must be a tensor, got \[1.0\]",
            # v is checked before k is copied: the first piece is not loaded alone.
            "sparse-v": r"the saved 'v' must be a dense \(strided\) tensor, got a sparse COO tensor",
            "mkldnn-v": r"the saved 'v' must be a dense \(strided\) tensor, got an mkldnn tensor"}[case]
    if case == "no-length":
        del sd["_extra_state"]
    elif case == "meta-v":
        sd["v"] = sd["v"].to("meta")
    elif case == "not-a-tensor":
        sd["v"] = [1.0]
    elif case in ("sparse-v", "mkldnn-v"):
        sd["v"] = sd["v"].to_sparse() if case == "sparse-v" else sd["v"].to_mkldnn()
    before = snapshot(dst)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=want):
            dst.load_state_dict(sd, strict=strict)
        assert same(before, dst)
    if case == "fp32-into-fp8":  # with scales, the dtype is what is refused
        sd8 = {**sd, "k_scale": torch.tensor(0.5), "v_scale": torch.tensor(1.0)}
        with pytest.raises(RuntimeError, match=r"saved k is Float \[1, 2, 8, 16\], this cache's is Float8_e4m3fn"):
            dst.load_state_dict(sd8)
        assert same(before, dst)


def test_fp8_scales_are_checked_and_travel_as_the_cache_uses_them():
    _, src, _, v = filled(FP8, k_scale=0.5, v_scale=0.5)
    dst = rotary.KVCache(1, 2, 8, 16, dtype=FP8)  # built with scale 1: the load brings 0.5
    bad = {**src.state_dict(), "v_scale": torch.tensor(0.0)}
    before = snapshot(dst)
    with pytest.raises(RuntimeError, match=r"saved v_scale must be finite and > 0, got 0"):
        dst.load_state_dict(bad)
    assert same(before, dst)
    with pytest.raises(RuntimeError, match=r"the saved 'k_scale' must be a dense \(strided\) tensor, got a sparse"):
        dst.load_state_dict({**src.state_dict(), "k_scale": torch.tensor([0.5]).to_sparse()})
    assert same(before, dst)
    # A negative-bit view is checked by the value it shows: -0.5 shown is refused, +0.5 shown loads.
    with pytest.raises(RuntimeError, match=r"saved k_scale must be finite and > 0, got -0.5"):
        dst.load_state_dict({**src.state_dict(), "k_scale": torch.tensor(0.5)._neg_view()})
    assert same(before, dst)
    dst.load_state_dict({**src.state_dict(), "v_scale": torch.tensor(-0.5)._neg_view()})
    assert "v_scale=0.5" in repr(dst) and dst.length == 3
    want = (v.double() / 0.5).float().to(FP8).double() * 0.5  # the fp8 cast of v / scale, scaled back
    for other in (pickle.loads(pickle.dumps(dst)), copy.deepcopy(dst)):
        assert other.v_scale.item() == 0.5 and other.length == 3 and repr(other) == repr(dst)
        assert torch.equal(other.keys_values(torch.float64)[1], want)
    dst.k_scale.fill_(0.25)  # calibrated in place: the copy keeps the buffer's value
    assert pickle.loads(pickle.dumps(dst)).k_scale.item() == 0.25
    rebuild, (state,) = dst.__reduce__()  # a 12-entry state, pickled before the scales travelled, still loads
    older = rebuild(state[:12])
    assert older.length == 3 and older.k_scale.item() == 1.0 and torch.equal(raw(older.k), raw(dst.k))


@pytest.mark.parametrize("cls", ["KVCache", "CppRotaryEmbedding"])
def test_a_cpp_module_cannot_move_to_meta(cls):
    m = rotary.KVCache(1, 2, 4, 8) if cls == "KVCache" else rotary.CppRotaryEmbedding(8, 16)
    name = "rotary::KVCache" if cls == "KVCache" else "rotary::RotaryEmbedding"
    with pytest.raises(ValueError, match=rf"{name}: a C\+\+ module holds real buffers and cannot move to the meta"):
        m.to("meta")
    assert all(b.device.type == "cpu" for b in m.buffers())


# ------------------------------------------------------ inference tensors
INPLACE = ["apply_rope_", "apply_rope_qk_", "apply_qk_norm_rope_", "apply_rope_with_kv_cache_",
           "apply_qk_norm_rope_with_kv_cache_"]


@pytest.mark.parametrize("op,made", [(op, "q") for op in INPLACE] + [(op, "cache") for op in INPLACE if "cache" in op])
def test_inference_tensors_are_refused_before_any_write(op, made):
    """torch refuses an inference tensor's in-place update only after the
    kernel ran; the ops refuse it first, and nothing is written."""
    f = rotary.freqs_table(16, 16)
    with torch.inference_mode(made == "q"):
        q, k = randn((1, 2, 3, 16), seed=1), randn((1, 2, 3, 16), seed=2)
    v = randn((1, 2, 3, 16), seed=3)
    with torch.inference_mode(made == "cache"):
        kc, vc = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    before = [t.clone() for t in (q, k, v, kc, vc)]
    args = {"apply_rope_": (q,), "apply_rope_qk_": (q, k), "apply_qk_norm_rope_": (q, k)}.get(op, (q, k, v, kc, vc))
    name = "x" if op == "apply_rope_" else ("q" if made == "q" else "k_cache")
    with pytest.raises(ValueError, match=rf"{op}: {name} is an inference tensor"):
        getattr(rotary, op)(*args, f, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, kc, vc)))
    with torch.inference_mode():  # inside the mode they are served
        getattr(rotary, op)(*args, f, 2)
    assert not torch.equal(before[0], q)


def test_forward_with_cache_on_a_cache_built_in_inference_mode():
    rope = rotary.RotaryEmbedding(16, 32)
    with torch.inference_mode():
        cache = rotary.KVCache(1, 2, 8, 16)
    before = snapshot(cache)
    q, k, v = randn((1, 2, 3, 16), seed=1), randn((1, 2, 3, 16), seed=2), randn((1, 2, 3, 16), seed=3)
    with pytest.raises(ValueError, match=r"k_cache is an inference tensor"):
        rope.forward_with_cache(q, k, v, cache)
    assert same(before, cache)


def test_loading_into_a_cache_built_in_inference_mode_is_named():
    """load_state_dict copies into the cache's buffers: outside inference mode
    it is refused in the cache's words, leaving the cache as it was, and
    served inside the mode."""
    with torch.inference_mode():
        cache = rotary.KVCache(1, 2, 8, 16)
    src = rotary.KVCache(1, 2, 8, 16)
    rotary.RotaryEmbedding(16, 32).forward_with_cache(*(randn((1, 2, 3, 16), seed=s) for s in (1, 2, 3)), src)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match=r"KVCache\.load_state_dict: this cache was built under "
                                           r"torch\.inference_mode\(\), so its 'k' cannot be updated outside it"):
        cache.load_state_dict(src.state_dict())
    assert same(before, cache)
    with torch.inference_mode():
        cache.load_state_dict(src.state_dict())
    assert cache.length == 3 and torch.equal(cache.k, src.k) and torch.equal(cache.v, src.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_load_of_the_caches_own_tensors_reads_them_first(dtype):
    """k and v swapped, from this cache's own state: each piece is read
    before any is written (copied in turn, both ended up holding v)."""
    _, cache, _, _ = filled(dtype)
    k, v = cache.k.clone(), cache.v.clone()
    assert not torch.equal(k.float(), v.float())
    sd = cache.state_dict()
    cache.load_state_dict({**sd, "k": sd["v"], "v": sd["k"]})
    assert torch.equal(cache.k.view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(cache.v.view(torch.uint8), k.view(torch.uint8))
