"""apply_rope_with_kv_cache_: bit-identical to apply_rope_qk_ followed by
index writes, against the float64 reference, for every cache layout, paged
block sizes 1/16/17, skipped slots, GQA, partial rotary, packed varlen,
positions past the table, float8_e4m3fn caches; refused calls write nothing;
opcheck and torch.compile(fullgraph=True)."""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, KVCase, build, canonical_tokens, cache_view, expected_k_rows, quantize, unfused
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, PAIRING_IDS, PAIRINGS, Snapshot, TOL, bits
from rotary_testing.devices import needs_cuda

pytestmark = pytest.mark.usefixtures("reset_dynamo")

LAYOUT_CASES = [("BHSD", 16), ("BSHD", 16), ("NHD", 1), ("NHD", 16), ("NHD", 17), ("HND", 1), ("HND", 16), ("HND", 17)]


def same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype == FP8:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.is_floating_point():
        a, b = bits(a), bits(b)
    assert torch.equal(a.cpu(), b.cpu()), f"{what} differs from the unfused sequence"


def check_case(c: KVCase):
    args, kw, rope_pos, dest = build(c)
    q, k, v, kc, vc, f = args
    k_in = k.clone()
    got = rotary.apply_rope_with_kv_cache_(*args, **kw)
    assert got[0] is q and got[1] is k
    ref_args, _, _, _ = build(c)
    unfused(ref_args, kw, dest, c)
    for name, a, b in zip(("q", "k", "k_cache", "v_cache"), (q, k, kc, vc), (ref_args[0], ref_args[1], ref_args[3], ref_args[4])):
        same_bits(a, b, name)
    if c.fp8:
        return
    # float64 reference of what the cache holds for every written token.
    expect = expected_k_rows(k_in, rope_pos, c)
    vrows = canonical_tokens(v, c)
    rtol, atol = TOL[c.dtype]
    written = 0
    for t, d in enumerate(dest):
        if d is None:
            continue
        written += 1
        got_k = cache_view(kc, c.kv_layout)[d[0], :, d[1], :]
        torch.testing.assert_close(got_k.cpu().double(), expect[t], rtol=rtol, atol=atol)
        assert torch.equal(cache_view(vc, c.kv_layout)[d[0], :, d[1], :].cpu(), vrows[t].cpu())
    assert written == sum(d is not None for d in dest)


@pytest.mark.parametrize("kv_layout,block", LAYOUT_CASES, ids=[f"{l}{b}" for l, b in LAYOUT_CASES])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_layouts_dtypes(dtype, interleaved, kv_layout, block):
    check_case(KVCase(dtype=dtype, interleaved=interleaved, kv_layout=kv_layout, block=block, skip=True))


VARIANTS = {
    "gqa-partial": dict(Hq=6, Hk=2, r=8),
    "mqa": dict(Hq=4, Hk=1),
    "decode-s1": dict(S=1, B=5, start=20),
    "offsets": dict(pos="offsets"),
    "position-ids": dict(pos="ids"),
    "cache-positions": dict(pos="cache_positions"),
    "bshd-input": dict(layout="BSHD"),
    "sbhd-input": dict(layout="SBHD"),
    "strided": dict(strided=True, seed=3),
    "strided-bshd": dict(strided=True, layout="BSHD", seed=5),
    "varlen": dict(lens=[3, 0, 5, 1]),
    "varlen-offsets": dict(lens=[2, 4], pos="offsets"),
    "varlen-ids": dict(lens=[3, 2, 0, 4], pos="ids"),
    "past-table": dict(inv_freq=True, start=30, table=32),
    "start0": dict(start=0),
    # several token tiles and head groups of the CPU kernel, each writing its own rows
    "long": dict(B=2, S=1100, Hq=3, Hk=2, table=1200, smax=1200, start=50),
}


@pytest.mark.parametrize("kv_layout,block", [("BHSD", 16), ("BSHD", 16), ("NHD", 17), ("HND", 16)], ids=["BHSD", "BSHD", "NHD17", "HND16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_variants(dtype, variant, kv_layout, block):
    check_case(KVCase(dtype=dtype, kv_layout=kv_layout, block=block, **VARIANTS[variant]))


@pytest.mark.parametrize("kv_layout", ["BHSD", "NHD", "HND"])
@pytest.mark.parametrize("scale", ["tensor", "head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fp8_cache(dtype, scale, kv_layout):
    check_case(KVCase(dtype=dtype, fp8=scale, kv_layout=kv_layout, Hq=4, Hk=3, skip=True))


# Quotients at fp8's edges: ties, subnormals, saturation, +-inf, NaN, -0.
FP8_EDGES = torch.tensor(
    [0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, 1e30, float("inf"), float("-inf"), float("nan"),
     2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6, 1.0625, 1.1875, -1.0625, 17.0, 19.0, 1e-30, 240.0, 232.0, 248.0],
    dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_fp8_matches_reference_expression_in_dtype(dtype):
    """Edge values through v (never rotated): ties, subnormals, saturation,
    +-inf, NaN, -0. In float32/float64 the documented expression is exactly
    (x / scale).clamp(-448, 448).to(float8_e4m3fn) in x's dtype."""
    c = KVCase(dtype=dtype, fp8="tensor", B=1, S=8, Hq=2, Hk=2, D=32)
    args, kw, _, dest = build(c)
    q, k, v, kc, vc, f = args
    special = FP8_EDGES
    vals = torch.cat([special, torch.randn(v.numel() - special.numel(), generator=torch.Generator().manual_seed(1)) * 100])
    v.copy_(vals.reshape(v.shape).to(dtype))
    kw["v_scale"] = torch.tensor(1.0)
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    want = (v / kw["v_scale"]).clamp(-448, 448).to(FP8)
    for t, d in enumerate(dest):
        got = cache_view(vc, "BHSD")[d[0], :, d[1], :]
        assert torch.equal(got.view(torch.uint8), canonical_tokens(want, c)[t].view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.1e-3, 2.0**-70, 2.0**70], ids=["1", "0.37", "3.1e-3", "2^-70", "2^70"])
def test_fp8_scales_cuda(scale):
    """The fused launch divides by a scale in [2^-64, 2^64] as x times its
    reciprocal with one fma correction, outside it by a division: either way
    the bits of (x / scale).clamp(-448, 448).to(float8_e4m3fn), edge values,
    fp8 ties and the quotient's whole range included."""
    c = KVCase(dtype=torch.float32, fp8="tensor", B=1, S=8, Hq=2, Hk=2, D=32, device="cuda")
    args, kw, _, dest = build(c)
    q, k, v, kc, vc, f = args
    special = FP8_EDGES
    spread = torch.exp2(torch.linspace(-14, 9, v.numel() - special.numel(), dtype=torch.float64))
    signs = torch.randint(0, 2, spread.shape, generator=torch.Generator().manual_seed(3)) * 2 - 1
    vals = (torch.cat([special, spread * signs]) * scale).to(torch.float32)
    v.copy_(vals.reshape(v.shape).to("cuda"))
    kw["v_scale"] = torch.tensor(scale, dtype=torch.float32, device="cuda")
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    want = (v.cpu() / kw["v_scale"].cpu()).clamp(-448, 448).to(FP8)
    for t, d in enumerate(dest):
        got = cache_view(vc, "BHSD")[d[0], :, d[1], :].cpu()
        assert torch.equal(got.view(torch.uint8), canonical_tokens(want, c)[t].view(torch.uint8)), t


def test_fp8_16bit_documented_rounding():
    """bf16 / fp16 input: the op divides in float32 once; torch's expression
    in the 16-bit dtype rounds the quotient to bf16 first. Where the two
    differ the float32 one is the correctly rounded quotient."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    s = torch.tensor(0.37)
    assert not torch.equal((x / s).clamp(-448, 448).to(FP8).view(torch.uint8), quantize(x, s, 0).view(torch.uint8))


# ---------------------------------------------------------------------------
# Refused calls: a clear error, every tensor bit-identical afterwards.
# ---------------------------------------------------------------------------
def _bad(c=None, **changes):
    c = c or KVCase()
    args, kw, _, _ = build(c)
    args = list(args)
    for name, val in changes.items():
        if name in ("q", "k", "v", "kc", "vc", "f"):
            args[["q", "k", "v", "kc", "vc", "f"].index(name)] = val(args) if callable(val) else val
        elif val is None:
            kw.pop(name, None)
        else:
            kw[name] = val(args) if callable(val) else val
    return args, kw


def _paged(**kw):
    return KVCase(kv_layout="NHD", block=4, **kw)


ERRORS = {
    "position-past-cache": (lambda: _bad(KVCase(start=37, inv_freq=True)), IndexError, "max_seq_len 40"),
    "cache-position-past": (lambda: _bad(KVCase(pos="cache_positions"), cache_positions=lambda a: torch.full((2, 5), 40)), IndexError, "cache position 40"),
    "cache-position-negative": (lambda: _bad(KVCase(pos="cache_positions"), cache_positions=lambda a: torch.full((2, 5), -1)), IndexError, "cache position -1"),
    "slot-past-pool": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.full((2, 5), a[3].shape[0] * 4)), IndexError, "outside the paged cache"),
    "slot-below-minus-one": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.full((2, 5), -2)), IndexError, "-1 skips"),
    "no-slot-mapping": (lambda: _bad(_paged(), slot_mapping=None), ValueError, "needs slot_mapping"),
    "slot-mapping-contiguous": (lambda: _bad(KVCase(), slot_mapping=torch.zeros(2, 5, dtype=torch.long)), ValueError, "slot_mapping is for paged"),
    "cache-positions-paged": (lambda: _bad(_paged(), cache_positions=torch.zeros(2, 5, dtype=torch.long)), ValueError, "cache_positions is for contiguous"),
    "slot-mapping-shape": (lambda: _bad(_paged(), slot_mapping=torch.zeros(3, dtype=torch.long)), ValueError, "one entry per token"),
    "slot-mapping-dtype": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.zeros(2, 5)), TypeError, "slot_mapping must be int32 or int64"),
    "bad-kv-layout": (lambda: _bad(kv_layout="HSD"), ValueError, "kv_layout must be"),
    "cache-heads": (lambda: _bad(kc=lambda a: a[3][:, :1].clone(), vc=lambda a: a[4][:, :1].clone()), ValueError, "kv_heads = 2"),
    "cache-head-dim": (lambda: _bad(kc=lambda a: a[3][..., :8].clone(), vc=lambda a: a[4][..., :8].clone()), ValueError, "head_dim = 16"),
    "cache-batch": (lambda: _bad(kc=lambda a: a[3][:1].clone(), vc=lambda a: a[4][:1].clone()), ValueError, "one row per sequence"),
    "cache-shapes-differ": (lambda: _bad(vc=lambda a: a[4][:, :, :20].clone()), ValueError, "k_cache and v_cache must have one shape"),
    "cache-dtype": (lambda: _bad(kc=lambda a: a[3].double(), vc=lambda a: a[4].double()), TypeError, "float8_e4m3fn, got Double"),
    "cache-dtypes-differ": (lambda: _bad(vc=lambda a: a[4].to(FP8)), TypeError, "the two caches must share one dtype"),
    "cache-int8": (lambda: _bad(kc=lambda a: a[3].to(torch.int8), vc=lambda a: a[4].to(torch.int8)), TypeError, "got Char"),
    "cache-3d": (lambda: _bad(kc=lambda a: a[3][0], vc=lambda a: a[4][0]), ValueError, "k_cache must be 4-D"),
    "v-dtype": (lambda: _bad(v=lambda a: a[2].double()), TypeError, "k and v must share one dtype"),
    "v-shape": (lambda: _bad(v=lambda a: a[2][:, :1].clone()), ValueError, "v must have the shape of k"),
    "k-heads-vs-q": (lambda: _bad(k=lambda a: a[1][..., :8].clone()), ValueError, "k must match q"),
    "k-aliases-cache": (lambda: _bad(k=lambda a: a[3][:, :, :5]), ValueError, "overlap in memory"),
    "v-aliases-cache": (lambda: _bad(v=lambda a: a[4][:, :, 10:15]), ValueError, "overlap in memory"),
    "v-is-k": (lambda: _bad(v=lambda a: a[1]), ValueError, "v would be read after k is rotated"),
    "caches-alias": (lambda: _bad(vc=lambda a: a[3]), ValueError, "k_cache and v_cache overlap"),
    "cache-expanded": (lambda: _bad(kc=lambda a: a[3][:, :1].expand(2, 2, 40, 16)), ValueError, "elements sharing memory"),
    "scale-without-fp8": (lambda: _bad(k_scale=torch.tensor(1.0)), ValueError, "only for float8_e4m3fn"),
    "scale-dtype": (lambda: _bad(KVCase(fp8="tensor"), k_scale=torch.tensor(1.0, dtype=torch.float64)), TypeError, "k_scale must be float32"),
    "scale-shape": (lambda: _bad(KVCase(fp8="tensor"), v_scale=torch.ones(3)), ValueError, "[kv_heads] = [2]"),
    "position-ids-with-start": (lambda: _bad(KVCase(pos="ids"), start_pos=2), ValueError, "start_pos must be 0 with position_ids"),
    "past-table": (lambda: _bad(KVCase(start=30)), IndexError, "exceeds the freqs table length"),
    "cu-seqlens-bad": (lambda: _bad(KVCase(lens=[2, 3]), cu_seqlens=torch.tensor([0, 3, 4])), ValueError, "cu_seqlens must start at 0"),
    "varlen-cache-rows": (lambda: _bad(KVCase(lens=[2, 3]), kc=lambda a: torch.zeros(3, 2, 40, 16), vc=lambda a: torch.zeros(3, 2, 40, 16)), ValueError, "num_seqs of cu_seqlens"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_refused_calls_write_nothing(case):
    make, exc, text = ERRORS[case]
    args, kw = make()
    snap = Snapshot(*args)
    with pytest.raises(exc, match=pytest.importorskip("re").escape(text)):
        rotary.apply_rope_with_kv_cache_(*args, **kw)
    snap.check()


def test_requires_grad_refused():
    args, kw, _, _ = build(KVCase())
    args[0].requires_grad_(True)
    with pytest.raises(ValueError, match="q requires grad"):
        rotary.apply_rope_with_kv_cache_(*args, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty(dtype):
    c = KVCase(dtype=dtype, S=0)
    args, kw, _, _ = build(c)
    snap = Snapshot(*args)
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    snap.check()


def test_version_counters_bumped():
    args, kw, _, _ = build(KVCase())
    before = [t._version for t in args]
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    after = [t._version for t in args]
    assert [a > b for a, b in zip(after, before)] == [True, True, False, True, True, False]


# ---------------------------------------------------------------------------
# opcheck, torch.compile
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [KVCase(), KVCase(kv_layout="NHD", block=17, skip=True), KVCase(kv_layout="HND", fp8="head"),
     KVCase(lens=[2, 3], pos="cache_positions", kv_layout="BSHD"), KVCase(dtype=torch.float16, pos="offsets")],
    ids=["bhsd", "nhd-skip", "hnd-fp8", "varlen-bshd", "fp16-offsets"],
)
def test_opcheck(case):
    args, kw, _, _ = build(case)
    # test_schema compares the inputs with ops torch lacks for float8 on the
    # CPU ("mul_cpu_reduced_float" not implemented); the other checks run.
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    extra = dict(test_utils=tests) if case.fp8 else {}
    torch.library.opcheck(torch.ops.rotary.apply_rope_with_kv_cache_, tuple(args), kw, **extra)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kv_layout,fp8", [("BHSD", None), ("NHD", None), ("HND", "tensor")])
def test_compile_fullgraph(kv_layout, fp8, backend):
    c = KVCase(kv_layout=kv_layout, fp8=fp8, block=16, S=1, B=3, start=7)

    def step(q, k, v, kc, vc, f, kw):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, **kw)
        return q * 2, k + 1

    eager_args, kw, _, _ = build(c)
    out_e = step(*eager_args, kw)
    comp_args, _, _, _ = build(c)
    # Under the inductor the wrapper passes torch.view_as_real(freqs)
    # (test_inductor_inplace.py says why).
    out_c = torch.compile(step, backend=backend, fullgraph=True)(*comp_args, kw)
    for a, b in zip(out_e + tuple(eager_args), out_c + tuple(comp_args)):
        same_bits(a, b, "compiled")


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


def raw(t):
    return t.view(torch.uint8) if t.dtype == FP8 else bits(t)


# One case per cache layout and feature, on every device.
CASES = {
    "bhsd": dict(),
    "bshd-gqa-partial": dict(kv_layout="BSHD", Hq=8, Hk=2, r=8),
    "nhd1": dict(kv_layout="NHD", block=1, skip=True),
    "nhd16-decode": dict(kv_layout="NHD", block=16, S=1, B=9, start=20),
    "hnd17-varlen": dict(kv_layout="HND", block=17, lens=[3, 0, 5, 2]),
    "strided-ids": dict(strided=True, pos="ids", seed=3),
    "cache-positions": dict(pos="cache_positions"),
    "past-table": dict(inv_freq=True, start=30),
    "fp8-head-nhd": dict(kv_layout="NHD", fp8="head", Hk=3),
    "fp8-tensor-bhsd": dict(fp8="tensor"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_device_matches_unfused_and_cpu(device, dtype, case):
    c = KVCase(dtype=dtype, device=device, **CASES[case])
    args, kw, _, dest = build(c)
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    ref_args, _, _, _ = build(c)
    unfused(ref_args, kw, dest, c)
    for i in (0, 1, 3, 4):
        assert torch.equal(raw(args[i]).cpu(), raw(ref_args[i]).cpu()), f"tensor {i} differs from the unfused sequence"
    cpu = KVCase(**{**c.__dict__, "device": "cpu"})
    cpu_args, cpu_kw, _, _ = build(cpu)
    rotary.apply_rope_with_kv_cache_(*cpu_args, **cpu_kw)
    rtol, atol = TOL[dtype]
    for i in (0, 1, 3, 4):
        a, b = args[i].cpu(), cpu_args[i]
        if a.dtype == FP8:  # one fp8 step where the rotations round differently
            a, b = a.float(), b.float()
            torch.testing.assert_close(a, b, rtol=0.125, atol=2.0**-9)
        else:
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("copy_blocks", [True, False], ids=["copy_blocks", "rows_copy"])
def test_copy_blocks_switch_cuda(dtype, case, copy_blocks):
    """These small calls fit one wave: their v is copied by copy blocks beside
    the rotation; switched off, by the rope rows after it. Either way the bits
    of the unfused sequence (the RoPE op, then torch's own cache writes)."""
    c = KVCase(dtype=dtype, device="cuda", **CASES[case])
    args, kw, _, dest = build(c)
    prior = rotary._C._cuda_set_copy_blocks(copy_blocks)
    try:
        rotary.apply_rope_with_kv_cache_(*args, **kw)
    finally:
        rotary._C._cuda_set_copy_blocks(prior)
    ref_args, _, _, _ = build(c)
    unfused(ref_args, kw, dest, c)
    for i in (0, 1, 3, 4):
        assert torch.equal(raw(args[i]).cpu(), raw(ref_args[i]).cpu()), f"tensor {i} differs from the unfused sequence"


@needs_cuda
@pytest.mark.parametrize("kv_layout", ["BHSD", "NHD", "HND"])
def test_device_side_out_of_range_skipped(kv_layout):
    c = KVCase(kv_layout=kv_layout, block=16, device="cuda", pos="cache_positions" if kv_layout == "BHSD" else "none")
    args, kw, _, dest = build(c)
    name = "cache_positions" if kv_layout == "BHSD" else "slot_mapping"
    bad = kw[name].clone()
    limit = cache_view(args[3], kv_layout).shape[2] if kv_layout == "BHSD" else args[3].shape[0] * c.block
    flat = bad.view(-1)
    flat[1], flat[4], flat[7] = limit, -7, 1 << 40
    kw[name] = bad
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    torch.cuda.synchronize()
    ref_args, _, _, _ = build(c)
    for t in (1, 4, 7):
        dest[t] = None
    unfused(ref_args, kw | {name: kw[name]}, dest, c)
    for i in (0, 1, 3, 4):
        assert torch.equal(raw(args[i]).cpu(), raw(ref_args[i]).cpu())


@needs_cuda
@pytest.mark.parametrize("kv_layout", ["BHSD", "NHD"])
def test_cuda_graph_replay_with_device_positions_and_slots(kv_layout):
    c = KVCase(kv_layout=kv_layout, block=16, device="cuda", S=1, B=4, pos="ids", dtype=torch.bfloat16)
    args, kw, _, _ = build(c)
    q, k, v, kc, vc, f = args
    static = {n: kw[n].clone() for n in ("position_ids", "slot_mapping") if n in kw}
    q0, k0 = q.clone(), k.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, **(kw | static))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, **(kw | static))
    for step in range(3):
        ids = torch.randint(0, 30, (c.B, 1), device="cuda")
        static["position_ids"].copy_(ids)
        if "slot_mapping" in static:
            static["slot_mapping"].copy_(torch.randperm(kc.shape[0] * 16, device="cuda")[: c.B].view_as(static["slot_mapping"]))
        q.copy_(q0)
        k.copy_(k0)
        kc_e, vc_e, q_e, k_e = kc.clone(), vc.clone(), q0.clone(), k0.clone()
        rotary.apply_rope_with_kv_cache_(q_e, k_e, v, kc_e, vc_e, f, **(kw | {n: t.clone() for n, t in static.items()}))
        g.replay()
        torch.cuda.synchronize()
        for a, b in ((q, q_e), (k, k_e), (kc, kc_e), (vc, vc_e)):
            assert torch.equal(raw(a), raw(b)), f"replay {step}"


def test_compile_fullgraph_device(device):
    c = KVCase(kv_layout="NHD", block=16, device=device, S=1, B=3, start=7, dtype=torch.float16)

    def step(q, k, v, kc, vc, f, kw):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, **kw)
        return q * 2

    eager_args, kw, _, _ = build(c)
    out_e = step(*eager_args, kw)
    comp_args, _, _, _ = build(c)
    out_c = torch.compile(step, backend="aot_eager", fullgraph=True)(*comp_args, kw)
    assert torch.equal(raw(out_e), raw(out_c))
    for a, b in zip(eager_args, comp_args):
        assert torch.equal(raw(a), raw(b))
