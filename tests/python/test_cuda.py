"""CUDA parity: CUDA vs CPU vs the float64 reference, gradients, opcheck,
torch.compile, CUDA graphs, poisoned outputs. Skipped without a GPU.

``ROTARY_TEST_DEVICE=cpu`` runs the device-agnostic tests of this file on the
CPU (a dry run of the test logic on machines without a GPU); the tests that
need CUDA itself (graphs, streams, cross-device errors) still skip.
"""

import os

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import (
    op_positions,
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    TOL,
    Snapshot,
    assert_close_ref,
    make_heads,
    make_packed_qkv,
    positions_tensor,
    randn,
)

DEV = os.environ.get("ROTARY_TEST_DEVICE", "cuda")
HAS_CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.skipif(DEV == "cuda" and not HAS_CUDA, reason="needs a CUDA device")
needs_real_cuda = pytest.mark.skipif(not HAS_CUDA or DEV != "cuda", reason="needs a CUDA device")

LAYOUTS = ["contiguous", "transposed", "stride2", "qkv_slice", "permuted"]


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def poison_device(numel, dtype, count=8):
    """Fill the caching allocator with NaN blocks of the output's size and
    free them: an output element a kernel forgets to write stays NaN."""
    blocks = [torch.full((max(numel, 1),), float("nan"), dtype=dtype, device=DEV) for _ in range(count)]
    del blocks


def _assert_device_matches_cpu(out_dev, out_cpu, dtype):
    """Device and CPU kernels may round differently (FMA): one rounding apart."""
    assert out_dev.device.type == DEV
    rtol, atol = TOL[dtype]
    if dtype == torch.float64:
        rtol, atol = 1e-12, 1e-12  # same complex64 table, double arithmetic
    torch.testing.assert_close(out_dev.cpu().double(), out_cpu.double(), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def tables():
    cache = {}

    def get(dim, n=64):
        if (dim, n) not in cache:
            cache[(dim, n)] = rotary.freqs_table(dim, n).to(DEV)
        return cache[(dim, n)]

    return get


# ---------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [2, 6, 64, 80, 128])
def test_parity_apply_rope(tables, head_dim, dtype, interleaved, layout):
    B, H, S, start = 2, 3, 19, 7
    x = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim, device=DEV)
    snap = Snapshot(x)
    poison_device(x.numel(), dtype)
    out = rotary.apply_rope(x, tables(head_dim), start, interleaved)
    sync()
    snap.check()
    assert not out.isnan().any(), "output element not written (poison survived)"
    ref = rope_reference(x, start, interleaved)
    assert_close_ref(out, ref, dtype)
    x_cpu = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim)
    out_cpu = rotary.apply_rope(x_cpu, tables(head_dim).cpu(), start, interleaved)
    _assert_device_matches_cpu(out, out_cpu, dtype)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [6, 64, 128])
def test_parity_apply_rope_qk_packed(tables, head_dim, dtype, interleaved):
    B, S, H = 2, 23, 4
    packed, q, k, v = make_packed_qkv(B, S, H, head_dim, dtype, seed=210, device=DEV)
    k = k[:, :2]  # Hq = 4, Hk = 2, still views of the packed tensor
    snap = Snapshot(packed)
    poison_device(q.numel(), dtype)
    oq, ok = rotary.apply_rope_qk(q, k, tables(head_dim), 41, interleaved)
    sync()
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any()
    assert_close_ref(oq, rope_reference(q, 41, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, 41, interleaved), dtype)
    pc = packed.cpu()
    qc, kc = pc.transpose(1, 2)[:, :H], pc.transpose(1, 2)[:, H : H + 2]
    cq, ck = rotary.apply_rope_qk(qc, kc, tables(head_dim).cpu(), 41, interleaved)
    _assert_device_matches_cpu(oq, cq, dtype)
    _assert_device_matches_cpu(ok, ck, dtype)


@pytest.mark.parametrize("kind", ["scalar", "batch", "batch1", "ids", "ids_b1", "ids_s1", "ids_noncontig"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_positions(tables, kind, interleaved, dtype):
    B, S, D, start = 3, 9, 64, 4
    pos = positions_tensor(kind, B, S, room=64 - start, seed=220, device=DEV)
    q = make_heads(B, 4, S, D, dtype, "transposed", seed=221, device=DEV)
    k = make_heads(B, 1, S, D, dtype, seed=222, device=DEV)
    snap = Snapshot(q, k, pos)
    out = rotary.apply_rope(q, tables(D), interleaved=interleaved, **op_positions(start, pos))
    oq, ok = rotary.apply_rope_qk(q, k, tables(D), interleaved=interleaved, inverse=True, **op_positions(start, pos))
    sync()
    snap.check()
    assert_close_ref(out, rope_reference(q, start, interleaved, pos), dtype)
    assert_close_ref(oq, rope_reference(q, start, interleaved, pos, inverse=True), dtype)
    assert_close_ref(ok, rope_reference(k, start, interleaved, pos, inverse=True), dtype)
    out_cpu = rotary.apply_rope(q.cpu(), tables(D).cpu(), interleaved=interleaved, **op_positions(start, pos.cpu()))
    _assert_device_matches_cpu(out, out_cpu, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_multi_block(tables, dtype):
    """Enough rows and heads for many thread blocks / a full grid."""
    B, H, Hk, S, D = 3, 16, 4, 300, 128
    q = make_heads(B, H, S, D, dtype, "transposed", seed=230, device=DEV)
    k = make_heads(B, Hk, S, D, dtype, seed=231, device=DEV)
    f = rotary.freqs_table(D, 1024).to(DEV)
    poison_device(q.numel(), dtype)
    for interleaved in PAIRINGS:
        oq, ok = rotary.apply_rope_qk(q, k, f, 700, interleaved)
        assert_close_ref(oq, rope_reference(q, 700, interleaved), dtype)
        assert_close_ref(ok, rope_reference(k, 700, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conj_and_inverse(tables, dtype):
    x = make_heads(2, 3, 11, 64, dtype, "stride2", seed=232, device=DEV)
    f = tables(64)
    inv = rotary.apply_rope(x, f, 5, False, inverse=True)
    assert torch.equal(rotary.apply_rope(x, f.conj(), 5, False), inv)
    assert_close_ref(inv, rope_reference(x, 5, False, inverse=True), dtype)
    if dtype in (torch.float32, torch.float64):
        back = rotary.apply_rope(rotary.apply_rope(x, f, 5, False), f, 5, False, inverse=True)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(back, x, rtol=rtol, atol=atol)


# Head counts that are not a multiple of the heads a thread holds, rows that
# do not fill the last block, a head wider than a block's threads, and a
# partial rotary (dims past the table's width pass through), in and out of place.
@pytest.mark.parametrize("shape", [(27, 3, 5, 128, 128), (37, 5, 2, 640, 640), (5, 1, 33, 128, 64)],
                         ids=["gqa27_3", "d640", "partial64of128"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_grid_shapes_in_and_out_of_place(shape, layout, interleaved, dtype):
    hq, hk, S, D, R = shape
    B, start = 3, 11
    f = rotary.rope_freqs(R, 64).to(DEV)
    q = make_heads(B, hq, S, D, dtype, layout, seed=240, device=DEV)
    k = make_heads(B, hk, S, D, dtype, layout, seed=241, device=DEV)

    def expect(x, out, msg):
        ref = rope_reference(x[..., :R], start, interleaved)
        assert_close_ref(out[..., :R], ref, dtype, msg)
        assert torch.equal(out[..., R:], x[..., R:]), msg + ": pass-through dims changed"

    snap = Snapshot(q, k)
    poison_device(q.numel(), dtype)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    sync()
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any(), "output element not written (poison survived)"
    expect(q, oq, "q out of place")
    expect(k, ok, "k out of place")
    qi, ki = q.clone(), k.clone()
    rotary.apply_rope_qk_(qi, ki, f, start, interleaved)
    sync()
    assert torch.equal(qi, oq) and torch.equal(ki, ok), "in place differs from out of place"


@needs_real_cuda
def test_more_than_2_31_elements():
    """2^31 + 128 * 128 elements: offsets past int32 take the 64-bit index path."""
    B, S, D = (1 << 17) + 1, 128, 128
    need = 2 * B * S * D * 2
    if torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip("needs about 11 GB of free GPU memory")
    x = torch.empty(B, 1, S, D, dtype=torch.bfloat16, device="cuda").normal_(generator=torch.Generator("cuda").manual_seed(250))
    f = rotary.rope_freqs(D, S).to("cuda")
    out = rotary.apply_rope(x, f, 0, False)
    sync()
    for b in (0, B // 2, B - 1):  # the last batch lies past element 2^31
        assert_close_ref(out[b : b + 1], rope_reference(x[b : b + 1], 0, False), torch.bfloat16, f"batch {b}")
    rotary.apply_rope_(x, f, 0, False)
    sync()
    assert torch.equal(x, out), "in place differs from out of place"


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 0, 4, 8), (2, 2, 0, 8)])
def test_empty(tables, shape):
    x = randn(shape, seed=233, device=DEV)
    out = rotary.apply_rope(x, tables(8), 3)
    oq, ok = rotary.apply_rope_qk(x, x, tables(8), 3)
    sync()
    assert out.shape == x.shape and oq.shape == x.shape and ok.shape == x.shape


# ---------------------------------------------------------------------------
# Gradients, opcheck, compile
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_gradcheck(interleaved):
    f = rotary.freqs_table(6, 24).to(DEV)
    q = make_heads(2, 3, 4, 6, torch.float64, "transposed", seed=240, device=DEV).requires_grad_()
    k = make_heads(2, 1, 4, 6, torch.float64, seed=241, device=DEV).requires_grad_()
    pos = torch.tensor([2, 9], device=DEV)
    fn1 = lambda q: rotary.apply_rope(q, f, interleaved=interleaved, **op_positions(3, pos))  # noqa: E731
    fn2 = lambda q, k: rotary.apply_rope_qk(q, k, f, 1, interleaved)  # noqa: E731
    assert torch.autograd.gradcheck(fn1, (q,))
    assert torch.autograd.gradgradcheck(fn1, (q,))
    assert torch.autograd.gradcheck(fn2, (q, k))
    assert torch.autograd.gradgradcheck(fn2, (q, k))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grad_matches_cpu(dtype):
    f = rotary.freqs_table(64, 64)
    q_cpu = make_heads(2, 4, 9, 64, dtype, "transposed", seed=242).requires_grad_()
    k_cpu = make_heads(2, 2, 9, 64, dtype, seed=243)  # no grad through k
    w = randn((2, 4, 9, 64), dtype, seed=244)
    q_dev = q_cpu.detach().to(DEV).requires_grad_()
    k_dev = k_cpu.to(DEV)
    for q, k, fr, ww in ((q_cpu, k_cpu, f, w), (q_dev, k_dev, f.to(DEV), w.to(DEV))):
        oq, ok = rotary.apply_rope_qk(q, k, fr, 11, False)
        ((oq * ww).sum() + ok.sum()).backward()
    assert k_dev.grad is None
    assert_close_ref(q_dev.grad, rope_reference(w, 11, False, inverse=True), dtype)
    _assert_device_matches_cpu(q_dev.grad, q_cpu.grad, dtype)


def _opcheck_samples():
    f = rotary.freqs_table(64, 64).to(DEV)
    return [
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, seed=250, device=DEV).requires_grad_(), f, 2, True), {}),
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, torch.bfloat16, "transposed", seed=251, device=DEV), f, 0, False),
         {"positions": torch.tensor([1, 30], device=DEV), "inverse": True}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 4, 5, 64, seed=252, device=DEV).requires_grad_(),
          make_heads(2, 2, 5, 64, seed=253, device=DEV, layout="stride2").requires_grad_(), f, 3, False),
         {"positions": torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3)).to(DEV)}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 2, 5, 64, torch.bfloat16, seed=254, device=DEV),
          make_heads(2, 2, 5, 64, torch.bfloat16, seed=255, device=DEV), f, 1, True), {}),
    ]


@pytest.mark.parametrize("i", range(4))
def test_opcheck(i):
    op, args, kwargs = _opcheck_samples()[i]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile(backend):
    torch._dynamo.reset()
    f = rotary.freqs_table(64, 128).to(DEV)

    def fn(q, k, pos):
        q2, k2 = rotary.apply_rope_qk(q * 0.5, k, f, interleaved=False, **op_positions(3, pos))
        return torch.softmax(q2 @ k2.transpose(-1, -2), dim=-1)

    q = make_heads(2, 4, 16, 64, layout="transposed", seed=260, device=DEV).requires_grad_()
    k = make_heads(2, 4, 16, 64, seed=261, device=DEV).requires_grad_()
    pos = torch.tensor([0, 40], device=DEV)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    out, ref = compiled(q, k, pos), fn(q, k, pos)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), (q, k))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_module_to_device():
    py = rotary.RotaryEmbedding(64, 128, interleaved=False)
    cpp = rotary.CppRotaryEmbedding(64, 128, 10000.0, False)
    before = py.freqs.clone()
    py.to(DEV, torch.float16)
    cpp.to(torch.device(DEV))
    for m in (py, cpp):
        assert m.freqs.device.type == DEV and m.freqs.dtype == torch.complex64
        assert torch.equal(m.freqs.cpu(), before)
    x = make_heads(2, 4, 10, 64, torch.float16, seed=262, device=DEV)
    assert_close_ref(py(x, start_pos=100), rope_reference(x, 100, False), torch.float16)
    assert torch.equal(py(x, start_pos=100), cpp(x, start_pos=100))
    # Past the 128 cached rows the module computes the rotation from inv_freq.
    assert_close_ref(py(x, start_pos=119), rope_reference(x, 119, False), torch.float16)
    assert_close_ref(cpp(x, start_pos=5000), rope_reference(x, 5000, False), torch.float16)


# ---------------------------------------------------------------------------
# CUDA-only: graphs, streams, cross-device errors
# ---------------------------------------------------------------------------
@needs_real_cuda
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_replay_with_device_positions(interleaved, dtype):
    """Capture once with a 0-dim int64 device tensor `positions`; change it
    (and the input) in place between replays. Capture fails if the op syncs
    with the host (e.g. reads positions with .item())."""
    D, L = 64, 256
    f = rotary.freqs_table(D, L).cuda()
    x = make_heads(2, 4, 8, D, dtype, "transposed", seed=270, device="cuda")
    k = make_heads(2, 2, 8, D, dtype, seed=271, device="cuda")
    pos = torch.zeros((), dtype=torch.int64, device="cuda")
    rope = rotary.RotaryEmbedding(D, L, interleaved=interleaved).cuda()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the capture
            rotary.apply_rope(x, f, interleaved=interleaved, **op_positions(3, pos))
            rotary.apply_rope_qk(x, k, f, interleaved=interleaved, **op_positions(3, pos))
            rope(x, offsets=pos)
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = rotary.apply_rope(x, f, interleaved=interleaved, **op_positions(3, pos))
        oq, ok = rotary.apply_rope_qk(x, k, f, interleaved=interleaved, **op_positions(3, pos))
        om = rope(x, offsets=pos)

    for i, p in enumerate([0, 5, 17, 240, 1]):
        pos.fill_(p)
        x.copy_(make_heads(2, 4, 8, D, dtype, "transposed", seed=272 + i, device="cuda"))
        for o in (out, oq, ok, om):
            o.fill_(float("nan"))  # poison: replay must overwrite every element
        g.replay()
        torch.cuda.synchronize()
        ref = rope_reference(x, 3 + p, interleaved)
        assert_close_ref(out, ref, dtype, msg=f"replay with positions={p}")
        assert_close_ref(oq, ref, dtype)
        assert_close_ref(ok, rope_reference(k, 3 + p, interleaved), dtype)
        assert_close_ref(om, rope_reference(x, p, interleaved), dtype)


@needs_real_cuda
def test_compile_reduce_overhead_cudagraphs():
    torch._dynamo.reset()
    f = rotary.freqs_table(64, 128).cuda()

    def fn(x, pos):
        return rotary.apply_rope(x, f, interleaved=True, **op_positions(0, pos)) * 2

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    x = make_heads(2, 4, 8, 64, seed=280, device="cuda")
    for p in [0, 7, 7, 50, 3]:
        pos = torch.tensor(p, device="cuda")
        out = compiled(x, pos).clone()
        assert_close_ref(out / 2, rope_reference(x, p, True), torch.float32)
    torch._dynamo.reset()


@needs_real_cuda
def test_side_stream():
    f = rotary.freqs_table(64, 64).cuda()
    x = make_heads(2, 4, 8, 64, seed=281, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = rotary.apply_rope(x, f, 9, False)
    torch.cuda.current_stream().wait_stream(s)
    assert_close_ref(out, rope_reference(x, 9, False), torch.float32)


@needs_real_cuda
def test_cross_device_errors():
    f_cpu = rotary.freqs_table(8, 16)
    x = randn((1, 2, 3, 8), seed=282, device="cuda")
    with pytest.raises(ValueError, match=r"freqs is on cpu but q/x is on cuda"):
        rotary.apply_rope(x, f_cpu)
    with pytest.raises(ValueError, match=r"positions is on cpu"):
        rotary.apply_rope(x, f_cpu.cuda(), **op_positions(0, torch.tensor(1)))
    with pytest.raises(ValueError, match=r"k is on cpu"):
        rotary.apply_rope_qk(x, x.cpu(), f_cpu.cuda())
    with pytest.raises(ValueError, match=r"head_dim"):
        rotary.apply_rope(randn((1, 2, 3, 7), device="cuda"), f_cpu.cuda())
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len"):
        rotary.apply_rope(x, f_cpu.cuda(), 14)


@needs_real_cuda
@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_qk"])
def test_device_positions_outside_table_give_nan(op):
    """README: device-side positions are not read on the host; a position
    outside the table yields NaN for that token (never an out-of-bounds read),
    and every other token is still rotated correctly."""
    f = rotary.freqs_table(16, 32).cuda()
    x = make_heads(2, 3, 4, 16, seed=290, device="cuda")
    ids = torch.tensor([[0, 5, 32, 31], [-1, 7, 1000, 2]], device="cuda")
    if op == "apply_rope":
        out = rotary.apply_rope(x, f, interleaved=True, **op_positions(0, ids))
    else:
        out, _ = rotary.apply_rope_qk(x, x[:, :1], f, interleaved=True, **op_positions(0, ids))
    torch.cuda.synchronize()
    bad = torch.tensor([[False, False, True, False], [True, False, True, False]])
    out = out.cpu()
    assert torch.equal(out.isnan().all(-1).all(1), bad)  # [B, S]: whole token NaN or not
    good_ids = ids.cpu().clamp(0, 31)
    ref = rope_reference(x, 0, True, good_ids)
    mask = (~bad)[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[mask].double(), ref[mask], rtol=1e-5, atol=1e-5)
