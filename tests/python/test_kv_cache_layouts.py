"""apply_rope_with_kv_cache_: bit-identical to apply_rope_qk_ followed by
index writes, against the float64 reference, for every cache layout, paged
block sizes 1/16/17, skipped slots, GQA, partial rotary, packed varlen,
positions past the table, float8_e4m3fn caches; opcheck and
torch.compile(fullgraph=True). (Split from the old test_kv_cache.py by
concern: refusals, the module path and the device cases have files of their
own, test_kv_cache_refusals.py, test_kv_cache_module.py,
test_kv_cache_devices.py.)"""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, KVCase, build, canonical_tokens, cache_view, expected_k_rows, quantize, unfused
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, PAIRING_IDS, PAIRINGS, TOL, bits
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
    "varlen-seq-offsets": dict(lens=[3, 0, 5, 2], pos="seq_offsets"),
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
