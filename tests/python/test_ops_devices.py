"""rotary.apply_rope / apply_rope_qk on every device (the ``device``
fixture): parity with the float64 reference and the CPU kernel for every
layout, packed qkv, grids of many blocks and partial rotary in and out of
place, empty tensors; on CUDA, offsets past 2**31 elements, heads past
2**30 and the L2 prefetch of the next rows. (Split from the old test_ops.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import (
    DTYPE_IDS,
    DTYPES,
    LAYOUTS,
    PAIRING_IDS,
    PAIRINGS,
    TOL,
    Snapshot,
    assert_close_ref,
    make_heads,
    make_packed_qkv,
    poison_allocator,
    randn,
)
from rotary_testing.devices import assert_matches_cpu, needs_cuda, sync


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [2, 6, 64, 80, 128])
def test_parity_apply_rope(device, tables, head_dim, dtype, interleaved, layout):
    B, H, S, start = 2, 3, 19, 7
    x = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim, device=device)
    snap = Snapshot(x)
    poison_allocator(x.numel(), dtype, device)
    out = rotary.apply_rope(x, tables(head_dim, 64).to(device), start, interleaved)
    sync(device)
    snap.check()
    assert not out.isnan().any(), "output element not written (poison survived)"
    ref = rope_reference(x, start, interleaved)
    assert_close_ref(out, ref, dtype)
    x_cpu = make_heads(B, H, S, head_dim, dtype, layout, seed=200 + head_dim)
    out_cpu = rotary.apply_rope(x_cpu, tables(head_dim, 64), start, interleaved)
    assert_matches_cpu(out, out_cpu, dtype)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [6, 64, 128])
def test_parity_apply_rope_qk_packed(device, tables, head_dim, dtype, interleaved):
    B, S, H = 2, 23, 4
    packed, q, k, v = make_packed_qkv(B, S, H, head_dim, dtype, seed=210, device=device)
    k = k[:, :2]  # Hq = 4, Hk = 2, still views of the packed tensor
    snap = Snapshot(packed)
    poison_allocator(q.numel(), dtype, device)
    oq, ok = rotary.apply_rope_qk(q, k, tables(head_dim, 64).to(device), 41, interleaved)
    sync(device)
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any()
    assert_close_ref(oq, rope_reference(q, 41, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, 41, interleaved), dtype)
    pc = packed.cpu()
    qc, kc = pc.transpose(1, 2)[:, :H], pc.transpose(1, 2)[:, H : H + 2]
    cq, ck = rotary.apply_rope_qk(qc, kc, tables(head_dim, 64), 41, interleaved)
    assert_matches_cpu(oq, cq, dtype)
    assert_matches_cpu(ok, ck, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_multi_block(device, tables, dtype):
    """Enough rows and heads for many thread blocks / a full grid."""
    B, H, Hk, S, D = 3, 16, 4, 300, 128
    q = make_heads(B, H, S, D, dtype, "transposed", seed=230, device=device)
    k = make_heads(B, Hk, S, D, dtype, seed=231, device=device)
    f = rotary.freqs_table(D, 1024).to(device)
    poison_allocator(q.numel(), dtype, device)
    for interleaved in PAIRINGS:
        oq, ok = rotary.apply_rope_qk(q, k, f, 700, interleaved)
        assert_close_ref(oq, rope_reference(q, 700, interleaved), dtype)
        assert_close_ref(ok, rope_reference(k, 700, interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conj_and_inverse(device, tables, dtype):
    x = make_heads(2, 3, 11, 64, dtype, "stride2", seed=232, device=device)
    f = tables(64, 64).to(device)
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
def test_grid_shapes_in_and_out_of_place(device, shape, layout, interleaved, dtype):
    hq, hk, S, D, R = shape
    B, start = 3, 11
    f = rotary.freqs_table(R, 64).to(device)
    q = make_heads(B, hq, S, D, dtype, layout, seed=240, device=device)
    k = make_heads(B, hk, S, D, dtype, layout, seed=241, device=device)

    def expect(x, out, msg):
        ref = rope_reference(x[..., :R], start, interleaved)
        assert_close_ref(out[..., :R], ref, dtype, msg)
        assert torch.equal(out[..., R:], x[..., R:]), msg + ": pass-through dims changed"

    snap = Snapshot(q, k)
    poison_allocator(q.numel(), dtype, device)
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    sync(device)
    snap.check()
    assert not oq.isnan().any() and not ok.isnan().any(), "output element not written (poison survived)"
    expect(q, oq, "q out of place")
    expect(k, ok, "k out of place")
    qi, ki = q.clone(), k.clone()
    rotary.apply_rope_qk_(qi, ki, f, start, interleaved)
    sync(device)
    assert torch.equal(qi, oq) and torch.equal(ki, ok), "in place differs from out of place"


@needs_cuda
def test_more_than_2_31_elements():
    """2^31 + 128 * 128 elements: offsets past int32 take the 64-bit index path."""
    B, S, D = (1 << 17) + 1, 128, 128
    need = 2 * B * S * D * 2
    if torch.cuda.mem_get_info()[0] < need + (2 << 30):
        pytest.skip("needs about 11 GB of free GPU memory")
    x = torch.empty(B, 1, S, D, dtype=torch.bfloat16, device="cuda").normal_(generator=torch.Generator("cuda").manual_seed(250))
    f = rotary.freqs_table(D, S).to("cuda")
    out = rotary.apply_rope(x, f, 0, False)
    sync("cuda")
    for b in (0, B // 2, B - 1):  # the last batch lies past element 2^31
        assert_close_ref(out[b : b + 1], rope_reference(x[b : b + 1], 0, False), torch.bfloat16, f"batch {b}")
    rotary.apply_rope_(x, f, 0, False)
    sync("cuda")
    assert torch.equal(x, out), "in place differs from out of place"


@needs_cuda
def test_more_than_2_30_heads_are_refused_by_name():
    """The kernels count a row's heads in 32 bits: 2^30 + 1 heads (4 GiB of
    fp16) are refused by name, the tensor untouched; 2^30 - 1 are served."""
    f = rotary.freqs_table(2, 4).to("cuda")
    x = torch.empty(1, (1 << 30) + 1, 1, 2, dtype=torch.float16, device="cuda").normal_()
    before = x[:, -4:].clone()
    for op in (rotary.apply_rope, rotary.apply_rope_):
        with pytest.raises(ValueError, match=r"q heads \+ k heads = 1073741825 \+ 0 is more than the CUDA kernels"):
            op(x, f, 0, False)
    assert torch.equal(x[:, -4:], before)
    served = x[:, 2:]
    out = rotary.apply_rope(served, f, 0, False)  # position 0 rotates by nothing
    sync("cuda")
    assert torch.equal(out[:, -4:], served[:, -4:])


@needs_cuda
@pytest.mark.parametrize("layout", ["hf", "bhsd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_l2_prefetch_of_next_rows_cuda(layout, dtype, interleaved):
    """Enough rows that every block strides (the launch prefetches each
    thread's next row into L2): the reference's values, and the bits of the
    launch without the prefetch, out of place and in place."""
    B, S, HQ, HK, D, start = 2, 4099, 8, 2, 128, 5
    gen = torch.Generator("cuda").manual_seed(260)
    if layout == "hf":
        q, k = (torch.randn(B, S, h, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2) for h in (HQ, HK))
    else:
        q, k = (torch.randn(B, h, S, D, device="cuda", dtype=dtype, generator=gen) for h in (HQ, HK))
    f = rotary.freqs_table(D, S + start).to("cuda")
    assert rotary._C._cuda_launch_shape(q, k, f, interleaved)["l2_prefetch"] == 1
    oq, ok = rotary.apply_rope_qk(q, k, f, start, interleaved)
    prior = rotary._C._cuda_set_l2_prefetch(False)
    try:
        pq, pk = rotary.apply_rope_qk(q, k, f, start, interleaved)
    finally:
        rotary._C._cuda_set_l2_prefetch(prior)
    sync("cuda")
    assert torch.equal(oq, pq) and torch.equal(ok, pk), "the prefetch changed the results"
    for x, out in ((q, oq), (k, ok)):
        assert_close_ref(out.cpu(), rope_reference(x.cpu(), start, interleaved), dtype, f"{layout}")
    qi, ki = q.clone(), k.clone()
    rotary.apply_rope_qk_(qi, ki, f, start, interleaved)
    sync("cuda")
    assert torch.equal(qi, oq) and torch.equal(ki, ok), "in place differs from out of place"


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 0, 4, 8), (2, 2, 0, 8)])
def test_empty(device, tables, shape):
    x = randn(shape, seed=233, device=device)
    out = rotary.apply_rope(x, tables(8, 64).to(device), 3)
    oq, ok = rotary.apply_rope_qk(x, x, tables(8, 64).to(device), 3)
    sync(device)
    assert out.shape == x.shape and oq.shape == x.shape and ok.shape == x.shape
