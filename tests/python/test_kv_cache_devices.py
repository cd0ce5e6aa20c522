"""apply_rope_with_kv_cache_ on every device (the ``device`` fixture): the
bits of the unfused sequence and the CPU op's values, one case per cache
layout and feature, and torch.compile; on CUDA, the copy-blocks switch,
out-of-range positions and slots skipped on the device, and CUDA graph
replay with device positions and slots. (Split from the old
test_kv_cache.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, KVCase, build, cache_view, unfused
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, TOL, bits
from rotary_testing.devices import needs_cuda

pytestmark = pytest.mark.usefixtures("reset_dynamo")


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
