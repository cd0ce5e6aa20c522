"""The prologue op, apply_qk_norm_rope: q/k RMSNorm then RoPE in one pass,
against a float64 norm-then-rope reference written here (the rotation's from
reference.py), on random inputs and weights, on every device."""

import pytest
import torch

import rotary
from rotary_testing.devices import assert_matches_cpu
from rotary_testing.prologue_reference import check, heads_weight, ref_norm, ref_prologue
from rotary_testing.rope_testing import (
    DTYPE_IDS, DTYPES, LAYOUT_NAMES, cu_from_lens, layout_shape, poison_allocator, randn, random_strided, ref_rope4,
)

MAX_LEN = 64


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", ["head", "heads"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_matches_reference(device, dtype, norm, layout):
    """GQA, partial rotary at an offset, start_pos > 0, both pairings, Gemma's
    offset on one of them, weights in another dtype than q. k's odd head
    count puts a pair of the CPU's 16-bit norm across two tokens."""
    B, Hq, Hk, S, D = 2, 6, 3, 5, 32
    for case, (interleaved, r, off, offset) in enumerate([(True, 32, 0, 0.0), (False, 16, 8, 1.0)]):
        seed = 100 * case + DTYPES.index(dtype)
        q = randn(layout_shape(layout, B, Hq, S, D), dtype, seed, device)
        k = randn(layout_shape(layout, B, Hk, S, D), dtype, seed + 1, device)
        qw = heads_weight(norm, Hq, D, torch.float32, seed + 2, device)
        kw = heads_weight(norm, Hk, D, torch.bfloat16, seed + 3, device)
        freqs = rotary.freqs_table(r, MAX_LEN).to(device)
        poison_allocator(q.numel(), dtype, device)
        kwargs = dict(start_pos=3, interleaved=interleaved, layout=layout, rotary_offset=off, q_weight=qw,
                      k_weight=kw, eps=1e-5, norm=norm, weight_offset=offset)
        oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, **kwargs)
        for out, x, w in ((oq, q, qw), (ok, k, kw)):
            check(out, ref_prologue(x, w, r, off, 3, interleaved, None, 1e-5, norm, offset, layout), dtype)
        if device != "cpu":
            cq, ck = rotary.apply_qk_norm_rope(q.cpu(), k.cpu(), freqs.cpu(), **{
                **kwargs, "q_weight": qw.cpu(), "k_weight": kw.cpu()})
            assert_matches_cpu(oq, cq, dtype)
            assert_matches_cpu(ok, ck, dtype)


@pytest.mark.parametrize("D", [32, 64, 128, 256, 512])
def test_head_dims(device, D):
    """head_dim 32 to 512 (vLLM's fused kernel stops at 256), a rotary span
    that is a quarter of the head (partial models)."""
    q = randn((1, 3, 4, D), torch.float32, D, device)
    k = randn((1, 1, 4, D), torch.float32, D + 1, device)
    qw, kw = heads_weight("head", 3, D, torch.float32, 1, device), heads_weight("head", 1, D, torch.float32, 2, device)
    for r in (D, D // 4):
        oq, ok = rotary.apply_qk_norm_rope(q, k, rotary.freqs_table(r, MAX_LEN).to(device), 1, False,
                                           q_weight=qw, k_weight=kw)
        check(oq, ref_prologue(q, qw, r, 0, 1, False), torch.float32)
        check(ok, ref_prologue(k, kw, r, 0, 1, False), torch.float32)


@pytest.mark.parametrize("form", ["offsets", "position_ids", "varlen", "varlen_ids", "nd"])
def test_position_forms(device, form):
    dtype, D, r = torch.float32, 16, 16
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    qw, kw = heads_weight("head", 2, D, dtype, 5, device), heads_weight("head", 1, D, dtype, 6, device)
    if form.startswith("varlen"):
        lens = [3, 0, 5, 1]
        cu = cu_from_lens(lens).to(device)
        T = sum(lens)
        q, k = randn((T, 2, D), dtype, 1, device), randn((T, 1, D), dtype, 2, device)
        ids = torch.randint(0, MAX_LEN, (T,), generator=torch.Generator().manual_seed(3)) if form == "varlen_ids" else None
        kw_pos = dict(position_ids=ids.to(device)) if ids is not None else dict(start_pos=2)
        oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, cu_seqlens=cu, q_weight=qw, k_weight=kw, **kw_pos)
        start = 0 if ids is not None else 2
        check(oq, ref_prologue(q, qw, r, start=start, positions=ids, cu=cu.cpu()), dtype)
        check(ok, ref_prologue(k, kw, r, start=start, positions=ids, cu=cu.cpu()), dtype)
        return
    B, S = 3, 4
    q, k = randn((B, 2, S, D), dtype, 1, device), randn((B, 1, S, D), dtype, 2, device)
    g = torch.Generator().manual_seed(4)
    if form == "nd":
        # Three axes; pair j reads axis j % 3. Reference: each pair at its own axis's position.
        ids = torch.randint(0, MAX_LEN, (3, B, S), generator=g)
        axes = [j % 3 for j in range(r // 2)]
        oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, position_ids=ids.to(device), pair_axes=axes,
                                           q_weight=qw, k_weight=kw)
        for out, x, w in ((oq, q, qw), (ok, k, kw)):
            y = ref_norm(x, w, 1e-6, "head", 0.0, 1)
            want = torch.empty_like(y)
            for j in range(r // 2):
                rot = ref_rope4(y, r, 0, True, ids[axes[j]])
                want[..., 2 * j:2 * j + 2] = rot[..., 2 * j:2 * j + 2]
            check(out, want, dtype)
        return
    if form == "offsets":
        pos = torch.randint(0, MAX_LEN - S, (B,), generator=g)
        kw_pos, ref_pos = dict(offsets=pos.to(device)), pos
    else:
        pos = torch.randint(0, MAX_LEN, (B, S), generator=g).to(torch.int32)
        kw_pos, ref_pos = dict(position_ids=pos.to(device)), pos
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, q_weight=qw, k_weight=kw, **kw_pos)
    check(oq, ref_prologue(q, qw, r, positions=ref_pos), dtype)
    check(ok, ref_prologue(k, kw, r, positions=ref_pos), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", ["head", "heads"])
def test_in_place_packed_qkv(device, dtype, norm):
    """q and k as views of one [T, (Hq + 2 Hk) * D] projection, normalized and
    rotated in place with no copy; v and the bytes between are untouched; the
    bits equal the out-of-place op's."""
    T, Hq, Hk, D, r = 6, 4, 2, 16, 8
    qkv = randn((T, (Hq + 2 * Hk) * D), dtype, 7, device)
    before = qkv.clone()
    q = qkv[:, : Hq * D].view(1, T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].view(1, T, Hk, D)
    qw, kw = heads_weight(norm, Hq, D, dtype, 8, device), heads_weight(norm, Hk, D, dtype, 9, device)
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    args = dict(start_pos=1, layout="BSHD", rotary_offset=4, q_weight=qw, k_weight=kw, norm=norm)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, **args)
    ptr = qkv.data_ptr()
    rq, rk = rotary.apply_qk_norm_rope_(q, k, freqs, **args)
    assert rq is q and rk is k and qkv.data_ptr() == ptr
    assert torch.equal(q, oq) and torch.equal(k, ok)
    assert torch.equal(qkv[:, (Hq + Hk) * D:], before[:, (Hq + Hk) * D:])
    check(q, ref_prologue(before[:, : Hq * D].view(1, T, Hq, D), qw, r, 4, 1, norm=norm, layout="BSHD"), dtype)


def test_strided_inputs(device):
    """Random strides, padding and a last-dim stride of 2, in and out of place."""
    D, r = 16, 12
    q = random_strided((2, 3, 4, D), torch.float32, 11).to(device)
    k = random_strided((2, 1, 4, D), torch.float32, 12).to(device)
    qw, kw = heads_weight("heads", 3, D, torch.float32, 1, device), heads_weight("heads", 1, D, torch.float32, 2, device)
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, 2, False, rotary_offset=2, q_weight=qw, k_weight=kw, norm="heads")
    check(oq, ref_prologue(q, qw, r, 2, 2, False, norm="heads"), torch.float32)
    check(ok, ref_prologue(k, kw, r, 2, 2, False, norm="heads"), torch.float32)


def test_empty_decode_and_no_weight(device):
    freqs = rotary.freqs_table(8, MAX_LEN).to(device)
    q, k = torch.empty(2, 3, 0, 8, device=device), torch.empty(2, 1, 0, 8, device=device)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs)
    assert oq.shape == q.shape and ok.shape == k.shape
    q, k = randn((2, 3, 1, 8), torch.float32, 1, device), randn((2, 1, 1, 8), torch.float32, 2, device)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, start_pos=40, weight_offset=0.5)  # S == 1, no weights
    check(oq, ref_prologue(q, None, 8, start=40, offset=0.5), torch.float32)
    check(ok, ref_prologue(k, None, 8, start=40, offset=0.5), torch.float32)


def test_float64_serves_an_eps_past_float32(device):
    """float64 q accumulates in float64: eps = 1e39 is a finite value there
    (refused for the other dtypes, test_errors_leave_inputs_untouched)."""
    freqs = rotary.freqs_table(8, MAX_LEN).to(device)
    q, k = randn((1, 2, 3, 8), torch.float64, 1, device), randn((1, 1, 3, 8), torch.float64, 2, device)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, eps=1e39, weight_offset=-1e39)
    check(oq, ref_prologue(q, None, 8, eps=1e39, offset=-1e39), torch.float64)
    check(ok, ref_prologue(k, None, 8, eps=1e39, offset=-1e39), torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", ["head", "heads"])
def test_weight_dtypes_and_strides(device, dtype, norm):
    """A weight in each float dtype (read as it is when it is the
    accumulation type or q's, else converted once), strided, or none, with
    and without Gemma's offset: the reference's result, and the same bits as
    the weight given in the accumulation type."""
    B, Hq, Hk, S, D = 2, 4, 2, 3, 16
    q, k = randn((B, Hq, S, D), dtype, 1, device), randn((B, Hk, S, D), dtype, 2, device)
    freqs = rotary.freqs_table(D, MAX_LEN).to(device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for i, wdtype in enumerate(DTYPES):
        for strided in (False, True):
            qw = heads_weight(norm, Hq, D, wdtype, 10 + i, device)
            qw = torch.stack([qw, -qw], dim=-1).flatten()[::2] if strided else qw  # stride 2
            kw = None if strided else heads_weight(norm, Hk, D, wdtype, 20 + i, device)
            for offset in (0.0, 1.0):
                args = dict(start_pos=2, norm=norm, weight_offset=offset)
                oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, q_weight=qw, k_weight=kw, **args)
                check(oq, ref_prologue(q, qw, D, start=2, norm=norm, offset=offset), dtype)
                check(ok, ref_prologue(k, kw, D, start=2, norm=norm, offset=offset), dtype)
                aq, ak = rotary.apply_qk_norm_rope(q, k, freqs, q_weight=qw.to(acc),
                                                   k_weight=None if kw is None else kw.to(acc), **args)
                assert torch.equal(oq, aq) and torch.equal(ok, ak), (wdtype, strided, offset)


def test_weights_are_read_in_place():
    """Weights in q's dtype, in fp32 or absent, with or without the offset:
    the call converts, fills or adds nothing (on CUDA each would be a launch)."""
    from torch.profiler import profile
    q, k = randn((4, 1, 16, 32), torch.bfloat16, 1, "cpu"), randn((4, 1, 8, 32), torch.bfloat16, 2, "cpu")
    freqs = rotary.freqs_table(32, MAX_LEN)
    for wdtype in (torch.bfloat16, torch.float32, None):
        w = None if wdtype is None else heads_weight("head", 16, 32, wdtype, 3, "cpu")
        for offset in (0.0, 1.0):
            with profile() as prof:
                rotary.apply_qk_norm_rope(q, k, freqs, 3, layout="BSHD", q_weight=w, k_weight=w, weight_offset=offset)
            ops = {e.name for e in prof.events()} & {"aten::_to_copy", "aten::add", "aten::fill_", "aten::ones"}
            assert not ops, (wdtype, offset, ops)


@pytest.mark.parametrize("norm", ["head", "heads"])
def test_gradients(norm):
    """gradcheck and gradgradcheck in float64 through q, k and both weights,
    with GQA, partial rotary at an offset and the Gemma offset."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hk, S, D, r = 1, 2, 1, 3, 8, 4
    q = torch.randn(B, S, Hq, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, S, Hk, D, dtype=torch.float64, generator=g, requires_grad=True)
    n = (lambda H: D) if norm == "head" else (lambda H: H * D)
    qw = torch.randn(n(Hq), dtype=torch.float64, generator=g, requires_grad=True)
    kw = torch.randn(n(Hk), dtype=torch.float64, generator=g, requires_grad=True)
    freqs = rotary.freqs_table(r, MAX_LEN)

    def f(q, k, qw, kw):
        return rotary.apply_qk_norm_rope(q, k, freqs, 2, False, layout="BSHD", rotary_offset=2, q_weight=qw,
                                         k_weight=kw, norm=norm, weight_offset=1.0, eps=1e-3)

    assert torch.autograd.gradcheck(f, (q, k, qw, kw))
    assert torch.autograd.gradgradcheck(f, (q, k, qw, kw))


def test_gradient_matches_unfused():
    """The gradients equal those of torch's RMSNorm followed by apply_rope_qk."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 5, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, generator=g, requires_grad=True)
    qw = torch.randn(16, generator=g, requires_grad=True)
    kw = torch.randn(16, generator=g, requires_grad=True)
    freqs = rotary.freqs_table(16, MAX_LEN)
    gq, gk = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, 1, q_weight=qw, k_weight=kw)
    fused = torch.autograd.grad((oq * gq).sum() + (ok * gk).sum(), (q, k, qw, kw))
    nq = torch.nn.functional.rms_norm(q, (16,), qw, 1e-6)
    nk = torch.nn.functional.rms_norm(k, (16,), kw, 1e-6)
    uq, uk = rotary.apply_rope_qk(nq, nk, freqs, 1)
    unfused = torch.autograd.grad((uq * gq).sum() + (uk * gk).sum(), (q, k, qw, kw))
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_opcheck_and_compile():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    qw, kw = torch.randn(8, generator=g), torch.randn(8, generator=g)
    freqs = torch.view_as_real(rotary.freqs_table(8, MAX_LEN))
    kwargs = dict(start_pos=1, interleaved=False, q_weight=qw, k_weight=kw, eps=1e-5)
    torch.library.opcheck(torch.ops.rotary.apply_qk_norm_rope.default, (q, k, freqs), kwargs)
    torch.library.opcheck(torch.ops.rotary.apply_qk_norm_rope_.default, (q.clone(), k.clone(), freqs), kwargs)
    grad_args = (q.clone().requires_grad_(), k.clone().requires_grad_(), freqs)
    torch.library.opcheck(torch.ops.rotary.apply_qk_norm_rope.default, grad_args,
                          {**kwargs, "norm": "heads", "q_weight": torch.randn(16, generator=g).requires_grad_(),
                           "k_weight": None})

    def f(q, k, qw, kw):
        return rotary.apply_qk_norm_rope(q, k, freqs, 1, False, q_weight=qw, k_weight=kw, eps=1e-5)

    want = f(q, k, qw, kw)
    got = torch.compile(f, fullgraph=True)(q, k, qw, kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_hf_norms_then_rope():
    """transformers' own norms and rotate_half rotation: Qwen3's per-head
    RMSNorm, Gemma 3's (1 + w) one, OLMo2's across all heads (applied to the
    [*, heads * head_dim] projection), fp32, against the fused op."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(8)
    B, S, Hq, Hk, D = 2, 5, 4, 2, 16
    q, k = torch.randn(B, S, Hq, D, generator=g), torch.randn(B, S, Hk, D, generator=g)
    pos = torch.arange(3, 3 + S)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([pos[:, None].float() * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    freqs = rotary.freqs_table(D, MAX_LEN)
    for norm_cls, kind, offset in ((Qwen3RMSNorm, "head", 0.0), (Gemma3RMSNorm, "head", 1.0),
                                   (Olmo2RMSNorm, "heads", 0.0)):
        n = D if kind == "head" else None
        qn = norm_cls(n or Hq * D, eps=1e-6)
        kn = norm_cls(n or Hk * D, eps=1e-6)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(qn.weight.shape, generator=g))
            kn.weight.copy_(torch.randn(kn.weight.shape, generator=g))
            if kind == "head":
                hq, hk = qn(q), kn(k)
            else:
                hq, hk = qn(q.reshape(B, S, -1)).view(B, S, Hq, D), kn(k.reshape(B, S, -1)).view(B, S, Hk, D)
            want_q, want_k = apply_rotary_pos_emb(hq.transpose(1, 2), hk.transpose(1, 2), cos, sin)
            oq, ok = rotary.apply_qk_norm_rope(q, k, freqs, 3, False, layout="BSHD", q_weight=qn.weight,
                                               k_weight=kn.weight, eps=1e-6, norm=kind, weight_offset=offset)
        torch.testing.assert_close(oq.transpose(1, 2), want_q, rtol=2e-5, atol=2e-5, msg=norm_cls.__name__)
        torch.testing.assert_close(ok.transpose(1, 2), want_k, rtol=2e-5, atol=2e-5, msg=norm_cls.__name__)


def _snapshot(*ts):
    return [t.clone() for t in ts]


BAD_NORM_ARGS = [
    (dict(norm="layer"), "norm must be 'head'"),
    (dict(norm="HEADS"), "norm must be 'head'"),
    (dict(eps=-1.0), "eps must be finite and >= 0, got -1"),
    (dict(eps=float("nan")), "eps must be finite"),
    (dict(weight_offset=float("inf")), "weight_offset must be finite"),
    (dict(eps=1e39), r"eps must be finite in float32 \(the norm's accumulation type for Float q\), got 1e\+39"),
    (dict(weight_offset=-1e39), r"weight_offset must be finite in float32 .*got -1e\+39"),
    (dict(eps=1e-46), r"eps is 0 in float32 \(the norm's accumulation type for Float q\), got 1e-46; pass 0 for no "
                      r"eps, or at least 1\.4013e-45"),
    (dict(q_weight=torch.ones(7)), r"q_weight must be 1-D \[head_dim\] = \[8\] for norm 'head'"),
    (dict(k_weight=torch.ones(16), norm="heads"), r"k_weight must be 1-D \[heads \* head_dim\] = \[8\]"),
    (dict(q_weight=torch.ones(2, 8), norm="heads"), r"q_weight must be 1-D"),
    (dict(q_weight=torch.ones(8, dtype=torch.int64)), "q_weight must be float32, float64, float16 or bfloat16"),
    (dict(q_weight=torch.ones(8, device="meta")), "q_weight is on meta but q is on cpu"),
    (dict(eps=True), "eps must be a number, got True"),
    (dict(weight_offset="1"), "weight_offset must be a number"),
    (dict(eps=10**400), r"eps must be finite, got an int of 1329 bits, past a float's range"),
]


@pytest.mark.parametrize("bad, message", BAD_NORM_ARGS)
def test_errors_leave_inputs_untouched(bad, message):
    q, k = randn((1, 2, 3, 8), torch.float32, 1), randn((1, 1, 3, 8), torch.float32, 2)
    freqs = rotary.freqs_table(8, MAX_LEN)
    saved = _snapshot(q, k)
    for op in (rotary.apply_qk_norm_rope, rotary.apply_qk_norm_rope_):
        with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
            op(q, k, freqs, **bad)
        assert torch.equal(q, saved[0]) and torch.equal(k, saved[1])


@pytest.mark.parametrize("bad, message", BAD_NORM_ARGS)
@pytest.mark.parametrize("needs_grad", ["q", "k"])
def test_errors_are_the_same_with_autograd(bad, message, needs_grad):
    """The autograd path refuses what the op does (it once read norm as a
    bool: any string but 'heads' ran as 'head')."""
    q, k = randn((1, 2, 3, 8), torch.float32, 1), randn((1, 1, 3, 8), torch.float32, 2)
    (q if needs_grad == "q" else k).requires_grad_(True)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        rotary.apply_qk_norm_rope(q, k, rotary.freqs_table(8, MAX_LEN), **bad)


def test_in_place_refusals():
    q, k = randn((1, 2, 3, 8), torch.float32, 1), randn((1, 1, 3, 8), torch.float32, 2)
    freqs = rotary.freqs_table(8, MAX_LEN)
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(ValueError, match="apply_qk_norm_rope_: q_weight requires grad"):
        rotary.apply_qk_norm_rope_(q, k, freqs, q_weight=w)
    # A weight that is a slice of q itself would be overwritten while read.
    qkv = randn((3, 4 * 8), torch.float32, 3)
    qq, kk = qkv[:, :16].view(1, 3, 2, 8), qkv[:, 16:24].view(1, 3, 1, 8)
    saved = qkv.clone()
    with pytest.raises(ValueError, match="q and q_weight overlap in memory"):
        rotary.apply_qk_norm_rope_(qq, kk, freqs, layout="BSHD", q_weight=qkv[0, :8])
    assert torch.equal(qkv, saved)
    with pytest.raises(ValueError, match="layout must be"):
        rotary.apply_qk_norm_rope(q, k, freqs, layout="HSD")
