"""apply_rope_cos_sin: RoPE from cos/sin tables as callers hand them (Hugging
Face's per-token pair, vLLM's cos_sin_cache with position ids), against a
float64 reference of the rotation written here from the tables' definition,
on random angles and inputs, on every device."""

import pytest
import torch

import rotary
from rotary_testing.devices import assert_matches_cpu
from rotary_testing.rope_testing import (
    DTYPE_IDS, DTYPES, LAYOUT_NAMES, TOL, from_bhsd, gen, layout_shape, poison_allocator, randn, random_strided,
    to_bhsd,
)

MAX_POS = 40


def angles(rows, half, seed):
    """float64 [*rows, half]: random positions times RoPE frequencies."""
    pos = torch.randint(0, MAX_POS, rows, generator=gen(seed)).double()
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / (2 * half))
    return pos[..., None] * inv


def hf_tables(a, interleaved, dtype):
    """Hugging Face's (cos, sin) of angles: [c | c] (rotate_half) or each
    value twice (repeat_interleave)."""
    c, s = a.cos(), a.sin()
    if interleaved:
        return c.repeat_interleave(2, -1).to(dtype), s.repeat_interleave(2, -1).to(dtype)
    return torch.cat([c, c], -1).to(dtype), torch.cat([s, s], -1).to(dtype)


def reference(x, c, s, interleaved, off=0, inverse=False, layout="BHSD"):
    """float64 rotation of x's dims [off, off + 2 * half) by per-token c, s
    [B | 1, S, half] (float64, the values the op reads: float32-rounded)."""
    x = to_bhsd(x.detach().to("cpu", torch.float64), layout)
    c, s = c[:, None].double(), (-s if inverse else s)[:, None].double()
    out, h = x.clone(), c.shape[-1]
    span = x[..., off:off + 2 * h]
    x1, x2 = (span[..., 0::2], span[..., 1::2]) if interleaved else (span[..., :h], span[..., h:])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        out[..., off:off + 2 * h] = torch.stack([o1, o2], -1).flatten(-2)
    else:
        out[..., off:off + 2 * h] = torch.cat([o1, o2], -1)
    return from_bhsd(out, layout)


def check(out, ref, dtype):
    rtol, atol = TOL[dtype]
    if dtype == torch.float64:  # the tables are read in float32
        rtol, atol = 1e-6, 1e-6
    assert out.dtype == dtype and tuple(out.shape) == tuple(ref.shape)
    torch.testing.assert_close(out.detach().to("cpu", torch.float64), ref, rtol=rtol, atol=atol)


def read(t):
    """The float32 values the op reads from a table, in float64."""
    return t.float().double().cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("form", ["S", "1S", "BS"])
def test_hf_tables(device, dtype, layout, form):
    """[seq, R], [1, seq, R] and [batch, seq, R] tables; full and partial
    rotary at an offset; both pairings; GQA."""
    B, Hq, Hk, S, D = 3, 4, 2, 5, 32
    for case, (interleaved, r, off) in enumerate([(False, 32, 0), (True, 16, 8), (False, 8, 0)]):
        seed = 10 * case + DTYPES.index(dtype)
        q = randn(layout_shape(layout, B, Hq, S, D), dtype, seed, device)
        k = randn(layout_shape(layout, B, Hk, S, D), dtype, seed + 1, device)
        a = angles((B if form == "BS" else 1, S), r // 2, seed + 2)
        cos, sin = hf_tables(a, interleaved, dtype)
        c, s = read(cos)[..., 0::2] if interleaved else read(cos)[..., :r // 2], None
        s = read(sin)[..., 0::2] if interleaved else read(sin)[..., :r // 2]
        if form == "S":
            cos, sin = cos[0], sin[0]
        poison_allocator(q.numel(), dtype, device)
        kw = dict(interleaved=interleaved, layout=layout, rotary_offset=off)
        oq, ok = rotary.apply_rope_cos_sin(q, k, cos.to(device), sin.to(device), **kw)
        check(oq, reference(q, c, s, interleaved, off, layout=layout), dtype)
        check(ok, reference(k, c, s, interleaved, off, layout=layout), dtype)
        if device != "cpu":
            cq, ck = rotary.apply_rope_cos_sin(q.cpu(), k.cpu(), cos, sin, **kw)
            assert_matches_cpu(oq, cq, dtype)
            assert_matches_cpu(ok, ck, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_sin_cache(device, dtype, interleaved):
    """vLLM's cos_sin_cache [max_pos, R] (R/2 cos then R/2 sin) with ids:
    [tokens, heads, head_dim] q and k, and 4-D ones with [batch, seq] ids."""
    T, H, D, r = 7, 3, 16, 16
    a = angles((MAX_POS,), r // 2, 3)
    a = a[torch.randperm(MAX_POS, generator=gen(4))]  # rows unrelated to their index
    cache = torch.cat([a.cos(), a.sin()], -1).float()
    ids = torch.randint(0, MAX_POS, (T,), generator=gen(5))
    q, k = randn((T, H, D), dtype, 6, device), randn((T, 1, D), dtype, 7, device)
    oq, ok = rotary.apply_rope_cos_sin(q, k, cache.to(device), None, position_ids=ids.to(device),
                                       interleaved=interleaved)
    c, s = read(cache[ids, :r // 2])[None], read(cache[ids, r // 2:])[None]
    as4 = lambda x: x.unsqueeze(0).transpose(1, 2)  # [1, H, T, D]
    check(oq, reference(as4(q), c, s, interleaved)[0].transpose(0, 1), dtype)
    check(ok, reference(as4(k), c, s, interleaved)[0].transpose(0, 1), dtype)

    B, S = 2, 4
    ids2 = torch.randint(0, MAX_POS, (B, S), generator=gen(8), dtype=torch.int32)
    q4, k4 = randn((B, H, S, D), dtype, 9, device), randn((B, 1, S, D), dtype, 10, device)
    oq, ok = rotary.apply_rope_cos_sin(q4, k4, cache.to(device), position_ids=ids2.to(device),
                                       interleaved=interleaved)
    c, s = read(cache[ids2.long(), :r // 2]), read(cache[ids2.long(), r // 2:])
    check(oq, reference(q4, c, s, interleaved), dtype)
    check(ok, reference(k4, c, s, interleaved), dtype)


def test_hf_tables_with_ids(device):
    """cos/sin as [max_pos, R] tables indexed by position_ids ([seq] and
    [batch, seq], or [1, seq] for every row)."""
    B, H, S, D = 2, 2, 6, 16
    a = angles((MAX_POS,), D // 2, 11)
    cos, sin = hf_tables(a, False, torch.float32)
    q, k = randn((B, H, S, D), torch.float32, 12, device), randn((B, H, S, D), torch.float32, 13, device)
    for ids in (torch.randint(0, MAX_POS, (S,), generator=gen(14)),
                torch.randint(0, MAX_POS, (B, S), generator=gen(15)),
                torch.randint(0, MAX_POS, (1, S), generator=gen(16))):  # [1, seq] broadcasts
        oq, ok = rotary.apply_rope_cos_sin(q, k, cos.to(device), sin.to(device), position_ids=ids.to(device))
        c = read(cos)[ids, :D // 2].reshape(-1, S, D // 2)
        s = read(sin)[ids, :D // 2].reshape(-1, S, D // 2)
        check(oq, reference(q, c, s, False), torch.float32)
        check(ok, reference(k, c, s, False), torch.float32)


def test_strided_inputs_and_tables(device):
    """Non-contiguous q, k and tables (views), inverse undoing the rotation."""
    B, H, S, D = 2, 3, 5, 16
    q = random_strided((B, H, S, D), torch.float32, 20).to(device)
    k = random_strided((B, 1, S, D), torch.float32, 21).to(device)
    a = angles((B, S), D // 2, 22)
    cos, sin = hf_tables(a, False, torch.float32)
    cos_t = cos.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert not cos_t.is_contiguous()
    oq, ok = rotary.apply_rope_cos_sin(q, k, cos_t.to(device), sin.to(device))
    c, s = read(cos)[..., :D // 2], read(sin)[..., :D // 2]
    check(oq, reference(q, c, s, False), torch.float32)
    check(ok, reference(k, c, s, False), torch.float32)
    bq, bk = rotary.apply_rope_cos_sin(oq, ok, cos_t.to(device), sin.to(device), inverse=True)
    check(bq, reference(oq, c, s, False, inverse=True), torch.float32)
    torch.testing.assert_close(bq, q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bk, k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 1, 16), (0, 3, 4, 16), (2, 3, 0, 16)], ids=["S1", "B0", "S0"])
def test_decode_and_empty(device, shape):
    B, H, S, D = shape
    q, k = randn(shape, torch.float32, 30, device), randn((B, 1, S, D), torch.float32, 31, device)
    a = angles((max(B, 1), S), D // 2, 32)
    cos, sin = hf_tables(a, False, torch.float32)
    oq, ok = rotary.apply_rope_cos_sin(q, k, cos[:B].to(device) if B else cos[:1].to(device),
                                       sin[:B].to(device) if B else sin[:1].to(device))
    c, s = read(cos)[..., :D // 2][:max(B, 1)], read(sin)[..., :D // 2][:max(B, 1)]
    check(oq, reference(q, c[:B] if B else c, s[:B] if B else s, False), torch.float32)
    assert ok.shape == k.shape


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_a_nan_in_the_tables_reaches_the_output(interleaved):
    """A NaN angle repeated as the table form repeats it is a RoPE table: its
    pair turns to NaN, as in the formula, and nothing else changes (it was
    refused as 'not rotate_half tables', the wrong cause)."""
    q, k = randn((1, 2, 3, 8), torch.float32, 40), randn((1, 1, 3, 8), torch.float32, 41)
    a = angles((1, 3), 4, 42)
    a[0, 1, 2] = float("nan")
    cos, sin = hf_tables(a, interleaved, torch.float32)
    oq, ok = rotary.apply_rope_cos_sin(q, k, cos, sin, interleaved=interleaved)
    c, s = read(cos), read(sin)
    c, s = (c[..., 0::2], s[..., 0::2]) if interleaved else (c[..., :4], s[..., :4])
    for out, x in ((oq, q), (ok, k)):
        want = reference(x, c, s, interleaved)
        assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()
        torch.testing.assert_close(out.double().nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-6)


def test_gradients_fp64():
    """gradcheck / gradgradcheck in q and k (the backward is the inverse
    rotation by the same tables)."""
    B, H, S, D = 1, 2, 3, 8
    q = randn((B, H, S, D), torch.float64, 40).requires_grad_()
    k = randn((B, 1, S, D), torch.float64, 41).requires_grad_()
    cos, sin = hf_tables(angles((B, S), 2, 42), True, torch.float64)
    f = lambda q, k: rotary.apply_rope_cos_sin(q, k, cos, sin, interleaved=True, rotary_offset=2)
    assert torch.autograd.gradcheck(f, (q, k))
    assert torch.autograd.gradgradcheck(f, (q, k))


def test_opcheck_and_compile(reset_dynamo):
    B, H, S, D = 2, 2, 4, 16
    q, k = randn((B, H, S, D), torch.float32, 50), randn((B, H, S, D), torch.float32, 51)
    cos, sin = hf_tables(angles((B, S), D // 2, 52), False, torch.float32)
    cache = torch.cat([cos[0, :, :D // 2], sin[0, :, :D // 2]], -1)
    ids = torch.tensor([3, 1, 2, 0])
    op = torch.ops.rotary.apply_rope_cos_sin.default
    torch.library.opcheck(op, (q, k, cos, sin), {"layout": "BHSD"})
    torch.library.opcheck(op, (q, k, cache, None), {"position_ids": ids})
    eager = rotary.apply_rope_cos_sin(q, k, cos, sin)
    compiled = torch.compile(lambda *a: rotary.apply_rope_cos_sin(*a), fullgraph=True)(q, k, cos, sin)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Compiled, ids past the rows are refused by the graph, naming the bound
    with_ids = torch.compile(lambda *a: rotary.apply_rope_cos_sin(*a[:4], position_ids=a[4]), fullgraph=True)
    for got, want in zip(with_ids(q, k, cache, None, ids), rotary.apply_rope_cos_sin(q, k, cache, None, position_ids=ids)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for bad in ([0, 1, 4, 2], [0, -1, 2, 3]):
        with pytest.raises(RuntimeError, match=r"position_ids must be in \[0, 4\) \(the rows of cos \(the cos_sin_cache\)\)"):
            with_ids(q, k, cache, None, torch.tensor(bad))


def test_errors():
    """Every refusal names the argument, what it got and what was wanted."""
    q, k = randn((2, 2, 4, 16), torch.float32, 60), randn((2, 1, 4, 16), torch.float32, 61)
    cos, sin = hf_tables(angles((2, 4), 8, 62), False, torch.float32)
    f = rotary.apply_rope_cos_sin
    cases = [
        (lambda: f(q[0, 0], k[0, 0], cos, sin), ValueError, r"q must be \[batch, heads, seq, head_dim\]"),
        (lambda: f(q, k[0], cos, sin), ValueError, r"k must have q's rank 4"),
        (lambda: f(q[0], k[0], cos[0], sin[0], layout="BSHD"), ValueError, r"layout applies to 4-D q and k"),
        # q and k are checked as this op names them, not as the inner op's
        (lambda: f(q.int(), k, cos, sin), TypeError, r"^apply_rope_cos_sin: q must be float32, .*, got Int"),
        (lambda: f(q, k.double(), cos, sin), TypeError, r"^apply_rope_cos_sin: k has dtype Double but q has"),
        (lambda: f(q, k[:, :, :3], cos, sin), ValueError,
         r"^apply_rope_cos_sin: k must match q in all but the head count, got q \[2, 2, 4, 16\] and k \[2, 1, 3, 16\]"),
        (lambda: f(q[0], k[0, :, :3], cos[0], sin[0]), ValueError,
         r"k must match q in all but the head count, got q \[2, 4, 16\] and k \[1, 3, 16\] \(layout \[tokens, heads"),
        (lambda: torch.func.jvp(lambda c: f(q, k, c, sin)[0], (cos,), (torch.ones_like(cos),)), NotImplementedError,
         r"^apply_rope_cos_sin: cos carries a forward-mode tangent"),
        (lambda: f(q, k, cos, sin, layout="HSBD"), ValueError, r"layout must be 'BHSD', 'BSHD' or 'SBHD', got 'HSBD'"),
        (lambda: f(q, k, cos.long(), sin), TypeError, r"cos must be a float tensor, got Long"),
        (lambda: f(q, k, cos.requires_grad_(), sin), ValueError, r"cos requires grad"),
        (lambda: f(q, k, cos[..., :7], sin[..., :7]), ValueError, r"R = rotary_dim even and > 0, got shape"),
        (lambda: f(q, k, cos, sin[:1]), ValueError, r"sin must have cos's shape"),
        (lambda: f(torch.randn(4, 2, 9), torch.randn(4, 1, 9), torch.ones(4, 8), torch.zeros(4, 8)), ValueError,
         r"^apply_rope_cos_sin: q\.size\(-1\) \(head_dim\) must be even, got 9 \(shape \[4, 2, 9\]\)"),
        (lambda: f(q, k, cos * torch.linspace(1, 2, 16), sin), ValueError, r"cos and sin must be rotate_half tables"),
        (lambda: f(q, k, cos, sin, interleaved=True), ValueError, r"must repeat each value twice"),
        (lambda: f(q, k, cos[0, :, :8], None), ValueError, r"sin=None reads cos as a cos_sin_cache"),
        (lambda: f(q, k, cos[0], None, position_ids=torch.ones(4)), TypeError,
         r"position_ids must have an integer dtype \(int64 or int32 are read without a copy\), got Float"),
        (lambda: f(q, k, cos[0], None, position_ids=torch.tensor([0, 1, 2, 4])), IndexError,
         r"position_ids must be in \[0, 4\) \(the rows of cos \(the cos_sin_cache\)\), got values in \[0, 4\]"),
        (lambda: f(q, k, cos[0], None, position_ids=torch.tensor([0, -1, 2, 3])), IndexError, r"got values in \[-1, 3\]"),
        (lambda: f(q, k, cos[0], None, position_ids=torch.zeros(3, dtype=torch.long)), ValueError,
         r"position_ids must be \[seq\] = \[4\] or \[batch, seq\] = \[2, 4\] \(batch may be 1\), got shape \[3\]"),
        (lambda: f(q, k, cos, sin, position_ids=torch.zeros(4, dtype=torch.long)), ValueError,
         r"with position_ids, cos must be a \[max_pos, R\] table"),
        (lambda: f(q, k, cos[:, :3], sin[:, :3]), ValueError, r"one row per token of q: \[seq\] = \[4\]"),
        (lambda: f(q, k, cos.expand(2, 4, 16)[:, :, :], sin, rotary_offset=4), ValueError,
         r"rotate R = 16 dims from rotary_offset = 4, which must fit in head_dim = 16"),
    ]
    for i, (call, exc, pattern) in enumerate(cases):
        with pytest.raises(exc, match=pattern):
            call()
        cos.requires_grad_(False)
