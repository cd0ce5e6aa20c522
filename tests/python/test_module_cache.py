"""RotaryEmbedding.forward_with_cache against CppRotaryEmbedding.forward_with_cache:
the same bits in q, k, the returned keys / values and the cache buffers, and
the same length, over several prefill and decode steps, for fp32, bf16 and
float8_e4m3fn caches in both cache layouts, start_pos given or not, and the
rules with other paths (past the table, float32 angles, dynamic). Also: q / k
/ v layouts, the float64 reference, refusals that write nothing, and
torch.compile (one graph break: the length lives in C++)."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, bits, from_bhsd, randn, ref_rope4

pytestmark = pytest.mark.usefixtures("reset_dynamo")

FP8 = torch.float8_e4m3fn
HAS_ADVANCE = hasattr(rotary.KVCache(1, 1, 1, 2).cpp_module, "_advance")
needs_advance = pytest.mark.skipif(
    not HAS_ADVANCE, reason="rotary._C.KVCache lacks the _advance binding (csrc/python/bind_kv_cache.cpp)"
)

DIM, CAP = 32, 16
NAMES = ("q", "k", "keys", "values")
STEPS = [(5, 1), (1, 4), (1, 7), (3, 10), (1, 13)]  # (seq, seed): prefill, decode, a chunk, decode
RULES = {
    "default": dict(max_seq_len=64),
    "past_table": dict(max_seq_len=8),  # float64 angles: rows past 8 computed on the fly
    "fp32_angles": dict(max_seq_len=64, angle_dtype="float32"),
    "dynamic": dict(max_seq_len=8, scaling={"rope_type": "dynamic", "factor": 2.0,
                                            "max_position_embeddings": 8}),
}


def raw(t):
    return t.view(torch.uint8) if t.dtype == FP8 else bits(t)


def same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(raw(a), raw(b)), f"{what}: bits differ from CppRotaryEmbedding.forward_with_cache"


def make_cache(kv_layout, dtype, capacity=CAP):
    scales = dict(k_scale=0.5, v_scale=0.25) if dtype == FP8 else {}  # refused on other caches
    return rotary.KVCache(2, 2, capacity, DIM, layout=kv_layout, dtype=dtype, **scales)


def qkv(S, seed, dtype, layout="BHSD"):
    return [from_bhsd(randn((2, h, S, DIM), dtype, seed + i), layout).contiguous() for i, h in enumerate((4, 2, 2))]


@needs_advance
@pytest.mark.parametrize("given_start", [False, True], ids=["start=length", "start_pos"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("kv_layout,dtype", [("BHSD", torch.float32), ("BSHD", torch.float32),
                                             ("BHSD", torch.bfloat16), ("BHSD", FP8), ("BSHD", FP8)],
                         ids=["BHSD-fp32", "BSHD-fp32", "BHSD-bf16", "BHSD-fp8", "BSHD-fp8"])
def test_parity_with_cpp_module(kv_layout, dtype, interleaved, given_start):
    py = rotary.RotaryEmbedding(DIM, 64, interleaved=interleaved)
    cpp = rotary.CppRotaryEmbedding(DIM, 64, interleaved=interleaved)
    c_py, c_cpp = make_cache(kv_layout, dtype), make_cache(kv_layout, dtype)
    work = torch.float32 if dtype == FP8 else dtype
    for step, (S, seed) in enumerate(STEPS):
        a, b = qkv(S, seed, work), qkv(S, seed, work)
        start = c_py.length
        kw = dict(start_pos=start + 3 * step) if given_start else {}  # rotation elsewhere, rows at the length
        got = py.forward_with_cache(*a, c_py, **kw)
        want = cpp.forward_with_cache(*b, c_cpp, **kw)
        assert got[0] is a[0], "q is rotated in place and returned"
        assert c_py.length == c_cpp.length == start + S
        assert got[1].shape == (2, 2, start + S, DIM)
        for name, x, y in zip(NAMES, (a[0], a[1], *got[1:]), (b[0], b[1], *want[1:])):
            same_bits(x, y, f"step {step} {name}")
        for (name, x), (_, y) in zip(c_py.named_buffers(), c_cpp.named_buffers()):
            same_bits(x, y, f"step {step} cache.{name}")


@needs_advance
@pytest.mark.parametrize("rule", list(RULES))
def test_parity_for_each_path(rule):
    py = rotary.RotaryEmbedding(DIM, **RULES[rule])
    cpp = rotary.CppRotaryEmbedding(DIM, **RULES[rule])
    c_py, c_cpp = make_cache("BHSD", torch.float32), make_cache("BHSD", torch.float32)
    for step, (S, seed) in enumerate(STEPS[:3] if rule == "fp32_angles" else STEPS):
        a, b = qkv(S, seed, torch.float32), qkv(S, seed, torch.float32)
        got = py.forward_with_cache(*a, c_py)
        want = cpp.forward_with_cache(*b, c_cpp)
        for name, x, y in zip(NAMES, (a[0], a[1], *got[1:]), (b[0], b[1], *want[1:])):
            same_bits(x, y, f"{rule} step {step} {name}")
    assert c_py.length == c_cpp.length
    assert py.rope_state == cpp.rope_state


@needs_advance
@pytest.mark.parametrize("module", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["py", "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_against_float64_reference(dtype, module):
    rope, cache = module(DIM, 64), make_cache("BSHD", dtype)
    for S, seed in STEPS:
        q, k, v = qkv(S, seed, dtype)
        start, q_in, k_in = cache.length, q.clone(), k.clone()
        _, keys, values = rope.forward_with_cache(q, k, v, cache)
        assert_close_ref(q, ref_rope4(q_in, start=start), dtype)
        assert_close_ref(keys[:, :, start:], ref_rope4(k_in, start=start), dtype)
        assert torch.equal(values[:, :, start:], v)


@needs_advance
@pytest.mark.parametrize("module", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["py", "cpp"])
@pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
def test_q_k_v_layouts(layout, module):
    # The same cache contents and bits as BHSD inputs holding the same values.
    rope = module(DIM, 64)
    c_lay, c_ref = make_cache("BHSD", torch.float32), make_cache("BHSD", torch.float32)
    for S, seed in STEPS:
        a, b = qkv(S, seed, torch.float32, layout), qkv(S, seed, torch.float32)
        got = rope.forward_with_cache(*a, c_lay, layout=layout)
        want = rope.forward_with_cache(*b, c_ref)
        same_bits(from_bhsd(b[0], layout), a[0], "q")
        same_bits(got[1], want[1], "keys")
        same_bits(got[2], want[2], "values")
    assert c_lay.length == c_ref.length == sum(s for s, _ in STEPS)


# ---------------------------------------------------------------------------
# Refusals: the call raises before anything is written, the length stays.
# ---------------------------------------------------------------------------
def snapshot(*ts):
    return [raw(t).clone() for t in ts]


def refusal_cases():
    q, k, v = qkv(2, 30, torch.float32)
    bad_v = randn((2, 2, 3, DIM), torch.float32, 40)
    return {
        "capacity": (dict(), lambda: (qkv(CAP, 50, torch.float32), {}), IndexError,
                     r"forward_with_cache: appending 16 positions to a cache holding 2 exceeds its capacity 16"),
        "dtype": (dict(dtype=torch.bfloat16), lambda: ((q, k, v), {}), TypeError,
                  r"forward_with_cache: the KVCache holds torch.bfloat16 but k is torch.float32"),
        "3-D q": (dict(), lambda: ((q[0], k, v), {}), ValueError, r"forward_with_cache: q must be 4-D"),
        "negative start_pos": (dict(), lambda: ((q, k, v), dict(start_pos=-1)), ValueError,
                               r"start_pos must be >= 0, got -1"),
        "bool start_pos": (dict(), lambda: ((q, k, v), dict(start_pos=True)), TypeError,
                           r"start_pos must be an int, got True"),
        "layout": (dict(), lambda: ((q, k, v), dict(layout="BHDS")), ValueError,
                   r"forward_with_cache: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'"),
        "head_dim": (dict(dim=64), lambda: ((q, k, v), {}), ValueError,
                     r"RotaryEmbedding\(dim=64\): head_dim must be >= dim .*got head_dim 32"),
        "v shape (op check)": (dict(), lambda: ((q, k, bad_v), {}), ValueError,
                               r"apply_rope_with_kv_cache_: v must have the shape of k"),
        "fp32 angles past the table": (dict(max_seq_len=3, angle_dtype="float32"), lambda: ((q, k, v), {}),
                                       IndexError, r"start_pos \+ seq_len = 2 \+ 2 = 4 exceeds max_seq_len 3"),
        "span past head_dim": (dict(dim=16, rotary_offset=24), lambda: ((q, k, v), {}), ValueError,
                               r"head_dim must be >= rotary_offset \+ dim = 40 .*got head_dim 32"),
    }


@needs_advance
@pytest.mark.parametrize("case", list(refusal_cases()))
def test_refusals_write_nothing(case):
    opts, args, exc, msg = refusal_cases()[case]
    dim = opts.pop("dim", DIM)
    cache_dtype = opts.pop("dtype", torch.float32)
    rope = rotary.RotaryEmbedding(dim, **opts)
    cache = make_cache("BHSD", cache_dtype)
    if cache_dtype == torch.float32:  # two rows filled first
        rotary.RotaryEmbedding(DIM, 64).forward_with_cache(*qkv(2, 60, torch.float32), cache)
    (q, k, v), kw = args()
    length, before = cache.length, snapshot(q, k, v, *cache.buffers())
    with pytest.raises(exc, match=msg):
        rope.forward_with_cache(q, k, v, cache, **kw)
    assert cache.length == length
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(q, k, v, *cache.buffers())))


def test_cache_must_be_a_kv_cache():
    q, k, v = qkv(1, 90, torch.float32)
    with pytest.raises(TypeError, match=r"forward_with_cache: cache must be a rotary.KVCache, got dict"):
        rotary.RotaryEmbedding(DIM, 64).forward_with_cache(q, k, v, {})


@pytest.mark.skipif(HAS_ADVANCE, reason="only without the _advance binding")
def test_without_advance_binding_nothing_is_written():
    rope, cache = rotary.RotaryEmbedding(DIM, 64), make_cache("BHSD", torch.float32)
    q, k, v = qkv(2, 70, torch.float32)
    before = snapshot(q, k, *cache.buffers())
    with pytest.raises(RuntimeError, match=r"forward_with_cache needs KVCache._advance"):
        rope.forward_with_cache(q, k, v, cache)
    assert cache.length == 0 and all(torch.equal(x, y) for x, y in zip(before, snapshot(q, k, *cache.buffers())))


# ---------------------------------------------------------------------------
# torch.compile: forward_with_cache is one graph break; the rest compiles.
# ---------------------------------------------------------------------------
@needs_advance
@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=["fp32", "fp8"])
def test_compiled_step_matches_eager(dtype):
    rope = rotary.RotaryEmbedding(DIM, 64)
    caches = {"eager": make_cache("BHSD", dtype), "compiled": make_cache("BHSD", dtype)}

    def step(q, k, v, cache):
        q, k = q * 2.0, k + 1.0  # graph work on each side of the call
        q, keys, values = rope.forward_with_cache(q, k, v, cache)
        return torch.softmax(q @ keys.transpose(-1, -2).repeat_interleave(2, 1), -1) @ values.repeat_interleave(2, 1)

    compiled = torch.compile(step, backend="aot_eager")
    for S, seed in STEPS:
        want = step(*qkv(S, seed, torch.float32), caches["eager"])
        got = compiled(*qkv(S, seed, torch.float32), caches["compiled"])
        same_bits(got, want, "attention output")
        assert caches["eager"].length == caches["compiled"].length
    for (name, x), (_, y) in zip(caches["eager"].named_buffers(), caches["compiled"].named_buffers()):
        same_bits(x, y, f"cache.{name}")


@needs_advance
def test_fullgraph_refuses_the_host_side_call():
    rope, cache = rotary.RotaryEmbedding(DIM, 64), make_cache("BHSD", torch.float32)
    compiled = torch.compile(lambda q, k, v: rope.forward_with_cache(q, k, v, cache), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(*qkv(1, 80, torch.float32))
    assert cache.length == 0
