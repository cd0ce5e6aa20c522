"""apply_rope_with_kv_cache_ with the rotation features of the other ops:
inverse, rotary_offset (a span inside the head) and pair_axes (N-D
position_ids), alone and together, contiguous and paged caches. Each call is
checked against the float64 reference (q, and k in every written cache row),
v rows exactly, untouched rows bit for bit, and the unfused sequence
(apply_rope_qk_ then an index write) bit for bit; plus opcheck, compile,
both modules with a rotary_offset, and the refusal of N-D ids without cache
rows."""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import cache_view
from rotary_testing.reference import rope_reference_nd
from rotary_testing.rope_testing import TOL, Snapshot, bits, gen, randn

pytestmark = pytest.mark.usefixtures("reset_dynamo")

B, S, HQ, HK, D, R, TABLE, SMAX, BLOCK = 2, 5, 4, 2, 32, 16, 64, 24, 8
FEATURES = {
    "inverse": dict(inverse=True),
    "rotary_offset": dict(rotary_offset=8),
    "pair_axes": dict(pair_axes=[0] * 3 + [1] * 3 + [2] * 2),  # M-RoPE sections (3, 3, 2)
    "all": dict(inverse=True, rotary_offset=12, pair_axes=[2, 0, 1, 0, 1, 2, 0, 1]),
}


def make_call(feature, kv_layout, dtype, interleaved=True, seed=0, S=S):
    """(args, kwargs, ids [n_axes, B, S], rows [(outer, inner)] per token)."""
    g = gen(seed + 40)
    q, k, v = (randn((B, h, S, D), dtype, seed + i) for i, h in enumerate((HQ, HK, HK)))
    kw = dict(interleaved=interleaved, kv_layout=kv_layout, **FEATURES[feature])
    if "pair_axes" in kw:
        ids = torch.randint(0, TABLE, (3, B, S), generator=g)
        kw["position_ids"] = ids
    else:
        kw["start_pos"] = 7
        ids = (7 + torch.arange(S)).expand(1, B, S)
    tokens = B * S
    if kv_layout in ("NHD", "HND"):
        blocks = tokens // BLOCK + 2
        slots = torch.randperm(blocks * BLOCK, generator=g)[:tokens]
        kw["slot_mapping"] = slots.reshape(B, S)
        rows = [(int(s) // BLOCK, int(s) % BLOCK) for s in slots]
        shape = (blocks, BLOCK, HK, D) if kv_layout == "NHD" else (blocks, HK, BLOCK, D)
    else:
        inner = torch.stack([torch.randperm(SMAX, generator=g)[:S] for _ in range(B)])
        if "pair_axes" in kw:  # N-D ids are not rows: the call must name them
            kw["cache_positions"] = inner
        else:
            inner = ids[0].clone()  # default: the token's rotary position
        rows = [(b, int(inner[b, s])) for b in range(B) for s in range(S)]
        shape = (B, HK, SMAX, D) if kv_layout == "BHSD" else (B, SMAX, HK, D)
    kc, vc = randn(shape, dtype, seed + 5), randn(shape, dtype, seed + 6)  # poison: random rows
    return [q, k, v, kc, vc, rotary.freqs_table(R, TABLE)], kw, ids, rows


def reference(x, ids, kw):
    axes = kw.get("pair_axes", [0] * (R // 2))
    return rope_reference_nd(x, ids.numpy(), axes, R, kw.get("rotary_offset", 0), kw["interleaved"],
                             kw.get("inverse", False))


def tokens_of(x):  # [B, H, S, D] -> [B * S, H, D]
    return x.transpose(1, 2).reshape(-1, x.shape[1], D)


def unfused(args, kw, rows, kv_layout):
    q, k, v, kc, vc, f = args
    rope_kw = {n: kw[n] for n in ("start_pos", "interleaved", "position_ids", "inverse", "rotary_offset", "pair_axes")
               if n in kw}
    rotary.apply_rope_qk_(q, k, f, **rope_kw)
    o = torch.tensor([r[0] for r in rows])
    n = torch.tensor([r[1] for r in rows])
    for src, cache in ((k, kc), (v, vc)):
        cache_view(cache, kv_layout)[o, :, n, :] = tokens_of(src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp64", "fp16", "bf16"])
@pytest.mark.parametrize("kv_layout", ["BHSD", "BSHD", "NHD", "HND"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_against_reference_and_unfused(feature, interleaved, kv_layout, dtype):
    args, kw, ids, rows = make_call(feature, kv_layout, dtype, interleaved)
    q, k, v, kc, vc, _ = args
    q_in, k_in, kc_in, vc_in = q.clone(), k.clone(), kc.clone(), vc.clone()
    rotary.apply_rope_with_kv_cache_(*args, **kw)

    rtol, atol = TOL[dtype]
    want_q, want_k = reference(q_in, ids, kw), tokens_of(reference(k_in, ids, kw))
    torch.testing.assert_close(q.double(), want_q, rtol=rtol, atol=atol)
    written = torch.zeros(cache_view(kc, kv_layout).shape[0], cache_view(kc, kv_layout).shape[2], dtype=torch.bool)
    for t, (o, i) in enumerate(rows):
        torch.testing.assert_close(cache_view(kc, kv_layout)[o, :, i].double(), want_k[t], rtol=rtol, atol=atol)
        assert torch.equal(bits(cache_view(vc, kv_layout)[o, :, i]), bits(tokens_of(v)[t]))
        written[o, i] = True
    for c, before in ((kc, kc_in), (vc, vc_in)):  # every other row keeps its bits
        keep = ~written
        assert torch.equal(bits(cache_view(c, kv_layout).transpose(1, 2)[keep]),
                           bits(cache_view(before, kv_layout).transpose(1, 2)[keep]))

    ref_args = make_call(feature, kv_layout, dtype, interleaved)[0]
    unfused(ref_args, kw, rows, kv_layout)
    for name, a, b in zip(("q", "k", "k_cache", "v_cache"), (q, k, kc, vc), [ref_args[i] for i in (0, 1, 3, 4)]):
        assert torch.equal(bits(a), bits(b)), f"{name} differs from the unfused sequence"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_decode_step(feature):
    # S == 1: one token per sequence, on the reference.
    args, kw, ids, rows = make_call(feature, "NHD", torch.float32, seed=3, S=1)
    k_in = args[1].clone()
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    want = tokens_of(reference(k_in, ids, kw))
    rtol, atol = TOL[torch.float32]
    for t, (o, i) in enumerate(rows):
        torch.testing.assert_close(cache_view(args[3], "NHD")[o, :, i].double(), want[t], rtol=rtol, atol=atol)


@pytest.mark.parametrize("kv_layout", ["BHSD", "HND"])
@pytest.mark.parametrize("feature", ["inverse", "rotary_offset", "all"])
def test_opcheck(feature, kv_layout):
    args, kw, _, _ = make_call(feature, kv_layout, torch.float32)
    torch.library.opcheck(torch.ops.rotary.apply_rope_with_kv_cache_, tuple(args), kw)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    def step(q, k, v, kc, vc, f, kw):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, **kw)
        return q * 2, k + 1

    eager, kw, _, _ = make_call("all", "NHD", torch.float32)
    out_e = step(*eager, kw)
    comp, _, _, _ = make_call("all", "NHD", torch.float32)
    out_c = torch.compile(step, backend=backend, fullgraph=True)(*comp, kw)
    for a, b in zip(out_e + tuple(eager), out_c + tuple(comp)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("kv_layout", ["BHSD", "BSHD"])
def test_nd_ids_need_cache_positions(kv_layout):
    args, kw, _, _ = make_call("pair_axes", kv_layout, torch.float32)
    del kw["cache_positions"]
    snap = Snapshot(*args)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: with pair_axes \(N-D position_ids\) a "
                                         r"contiguous cache needs cache_positions"):
        rotary.apply_rope_with_kv_cache_(*args, **kw)
    snap.check()
    with pytest.raises(ValueError, match="needs cache_positions"):  # Meta: the same validator
        torch.ops.rotary.apply_rope_with_kv_cache_(*[a.to("meta") for a in args[:5]], args[5].to("meta"), **{
            n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})


@pytest.mark.parametrize("module", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["python", "cpp"])
def test_modules_forward_with_cache_rotary_offset(module):
    off, dim = 8, 16
    rope = module(dim, 64, rotary_offset=off)
    cache = rotary.KVCache(2, 2, 8, D)
    for S_, seed in ((5, 1), (1, 4)):
        start = cache.length
        q, k, v = (randn((2, h, S_, D), torch.float32, seed + i) for i, h in enumerate((4, 2, 2)))
        q_in, k_in = q.clone(), k.clone()
        _, keys, values = rope.forward_with_cache(q, k, v, cache)
        ids = (start + torch.arange(S_)).expand(1, 2, S_)
        rtol, atol = TOL[torch.float32]
        for got, x in ((q, q_in), (keys[:, :, start:], k_in)):
            want = rope_reference_nd(x, ids.numpy(), [0] * (dim // 2), dim, off)
            torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
        assert torch.equal(values[:, :, start:], v)
    assert cache.length == 6
