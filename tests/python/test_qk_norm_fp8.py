"""The prologue op's fp8 q (q_fp8_scale): its bits against torch's own
quantization of the unrounded result, its allocations and its refusals."""

import pytest
import torch

import rotary
from rotary_testing.prologue_reference import heads_weight, ref_prologue
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, randn

MAX_LEN = 64


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_q_bits(device, dtype, per_head):
    """q as float8_e4m3fn: the bits of torch's (q / scale).clamp(-448, 448)
    .to(float8_e4m3fn) on the unrounded result (the op in fp32 on the
    widened inputs; fp64 itself), some values saturating; k as without it."""
    B, Hq, Hk, S, D, r = 2, 4, 2, 3, 16, 8
    q, k = randn((B, S, Hq, D), dtype, 1, device), randn((B, S, Hk, D), dtype, 2, device)
    qw, kw = heads_weight("head", Hq, D, torch.float32, 3, device), heads_weight("head", Hk, D, torch.float32, 4, device)
    scale = (torch.linspace(0.004, 0.05, Hq) if per_head else torch.tensor(0.006)).to(device)
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    args = dict(layout="BSHD", rotary_offset=4, q_weight=qw, k_weight=kw)
    q8, k_out = rotary.apply_qk_norm_rope(q, k, freqs, 2, False, q_fp8_scale=scale, **args)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape and k_out.dtype == dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    exact_q, _ = rotary.apply_qk_norm_rope(q.to(wide), k.to(wide), freqs, 2, False, **args)
    _, want_k = rotary.apply_qk_norm_rope(q, k, freqs, 2, False, **args)
    s = scale.view(1, 1, Hq, 1) if per_head else scale
    want = (exact_q / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (exact_q / s).abs().max() > 448  # saturation is exercised
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))
    if device == "cpu" or dtype == torch.float64:
        assert torch.equal(k_out, want_k)
    else:  # on CUDA the fp8 q call and the plain one run different instantiations (each compiled on its own):
        # the two agree to a rounding
        torch.testing.assert_close(k_out, want_k, **ONE_ROUNDING[dtype])


ONE_ROUNDING = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=2**-10, atol=2**-14),
                torch.bfloat16: dict(rtol=2**-7, atol=2**-14)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_fp8_q_on_the_vector_path(device, dtype, interleaved, per_head):
    """Aligned BHSD rows with norm "head": on CUDA the fp8 q takes the vector
    path (each vector's fp8 bytes in one store, its head's scale read with
    its loads). q against torch's quantization of the widened call: a
    different reduction order may move a value across an fp8 rounding
    boundary, so at most 0.1% of the bytes may differ, each by one step."""
    B, Hq, Hk, S, D, r = 2, 6, 2, 5, 128, 96
    q, k = randn((B, Hq, S, D), dtype, 5, device), randn((B, Hk, S, D), dtype, 6, device)
    qw, kw = heads_weight("head", Hq, D, torch.float32, 7, device), heads_weight("head", Hk, D, torch.float32, 8, device)
    scale = (torch.linspace(0.004, 0.03, Hq) if per_head else torch.tensor(0.01)).to(device)
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    args = dict(rotary_offset=16, q_weight=qw, k_weight=kw)
    launch = rotary._C._cuda_norm_launch(q.cpu(), k.cpu(), freqs.cpu(), "head", 132, interleaved,
                                         q_fp8_scale=scale.cpu())
    if launch:  # built with CUDA kernels: the launch a GPU would make
        assert launch["vector_items"] > 0 and launch["fp8_q"] == 1, launch
    q8, k_out = rotary.apply_qk_norm_rope(q, k, freqs, 3, interleaved, q_fp8_scale=scale, **args)
    exact_q, _ = rotary.apply_qk_norm_rope(q.float(), k.float(), freqs, 3, interleaved, **args)
    _, want_k = rotary.apply_qk_norm_rope(q, k, freqs, 3, interleaved, **args)
    s = scale.view(1, Hq, 1, 1) if per_head else scale
    want = (exact_q / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (exact_q / s).abs().max() > 448  # saturation is exercised
    got, ref = q8.view(torch.uint8).to(torch.int16), want.view(torch.uint8).to(torch.int16)
    differ = got != ref
    assert differ.sum() <= q8.numel() // 1000, f"{int(differ.sum())} of {q8.numel()} fp8 bytes differ"
    assert ((got - ref).abs()[differ] == 1).all()  # one step, the same sign (sign-magnitude bytes)
    # And against the float64 reference: within half an fp8 step (2^-4 relative) of q / scale, saturated.
    exact = (ref_prologue(q, qw, r, 16, 3, interleaved) / s.cpu().double()).clamp(-448, 448)
    torch.testing.assert_close(q8.cpu().double(), exact, rtol=2**-4, atol=2**-10, msg="q8 against float64")
    torch.testing.assert_close(k_out, want_k, **ONE_ROUNDING[dtype], msg="k as without fp8 q")


def test_fp8_q_allocates_two_outputs():
    """With q_fp8_scale the call allocates the fp8 q and k, no q-dtype q."""
    from torch.profiler import profile
    q, k = randn((2, 3, 4, 16), torch.bfloat16, 1, "cpu"), randn((2, 1, 4, 16), torch.bfloat16, 2, "cpu")
    freqs, scale = rotary.freqs_table(16, MAX_LEN), torch.tensor(0.01)
    with profile() as prof:
        rotary.apply_qk_norm_rope(q, k, freqs, 1, q_fp8_scale=scale)
    op = next(e for e in prof.events() if e.name == "rotary::apply_qk_norm_rope")
    allocations = [c.name for c in op.cpu_children if c.name.startswith("aten::empty")]  # the scale's check aside
    assert allocations == ["aten::empty_strided"] * 2


def test_fp8_q_refusals():
    q, k = randn((1, 2, 3, 8), torch.float32, 1), randn((1, 1, 3, 8), torch.float32, 2)
    freqs = rotary.freqs_table(8, MAX_LEN)
    with pytest.raises(ValueError, match=r"q_fp8_scale must be \[\], \[1\] or \[heads\] = \[2\]"):
        rotary.apply_qk_norm_rope(q, k, freqs, q_fp8_scale=torch.ones(3))
    with pytest.raises(TypeError, match="q_fp8_scale must be float32, got Double"):
        rotary.apply_qk_norm_rope(q, k, freqs, q_fp8_scale=torch.ones((), dtype=torch.float64))
    saved = q.clone()
    with pytest.raises(ValueError, match="q_fp8_scale .* needs the out-of-place apply_qk_norm_rope"):
        rotary.apply_qk_norm_rope_(q, k, freqs, q_fp8_scale=torch.ones(()))
    assert torch.equal(q, saved)
    with pytest.raises(ValueError, match="float8_e4m3fn, which is not differentiable"):
        rotary.apply_qk_norm_rope(q.requires_grad_(), k, freqs, q_fp8_scale=torch.ones(()))
    with torch.no_grad():
        q8, _ = rotary.apply_qk_norm_rope(q, k, freqs, q_fp8_scale=torch.ones(()))
    assert q8.dtype == torch.float8_e4m3fn
    # Meta: the dtype and shape without running.
    qm, km = torch.ops.rotary.apply_qk_norm_rope(q.detach().to("meta"), k.to("meta"), freqs.to("meta"),
                                                 q_fp8_scale=torch.ones((), device="meta"))
    assert qm.dtype == torch.float8_e4m3fn and qm.shape == q.shape and km.dtype == torch.float32
