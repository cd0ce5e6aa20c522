"""The fused KV-cache write on the MLA path: DeepSeek-style heads (q and k
[nope | rope], the rope dims at rotary_offset) with v of its own head_dim
(v_head_dim), into contiguous and paged caches whose rows are each tensor's
width; against the float64 rotation, v raw, unwritten rows untouched."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, TOL, bits, randn, ref_rope4

FP8 = torch.float8_e4m3fn
B, H, S, NOPE, ROPE, START, SMAX = 2, 3, 5, 12, 8, 4, 16


def reference(x, interleaved):
    """float64: dims [NOPE, NOPE + ROPE) rotated at positions START + s."""
    out = x.detach().to("cpu", torch.float64).clone()
    out[..., NOPE:NOPE + ROPE] = ref_rope4(x[..., NOPE:NOPE + ROPE], None, START, interleaved)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("v_dim", [10, 24], ids=["v-narrower", "v-wider"])
@pytest.mark.parametrize("kv_layout", ["BHSD", "NHD"])
def test_mla_heads_into_the_cache(device, dtype, v_dim, kv_layout):
    D = NOPE + ROPE
    interleaved = dtype in (torch.float32, torch.bfloat16)  # DeepSeek-V3's rope_interleave, and rotate_half
    q, k = randn((B, H, S, D), dtype, 1, device), randn((B, H, S, D), dtype, 2, device)
    v = randn((B, H, S, v_dim), dtype, 3, device)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    kw = dict(interleaved=interleaved, rotary_offset=NOPE, kv_layout=kv_layout)
    if kv_layout == "BHSD":
        kc = torch.full((B, H, SMAX, D), float("nan"), dtype=dtype, device=device)
        vc = torch.full((B, H, SMAX, v_dim), float("nan"), dtype=dtype, device=device)
        rows = [(b, START + s) for b in range(B) for s in range(S)]
    else:  # paged [num_blocks, block_size, heads, head_dim], slots scattered
        blocks, block = 4, 8
        kc = torch.full((blocks, block, H, D), float("nan"), dtype=dtype, device=device)
        vc = torch.full((blocks, block, H, v_dim), float("nan"), dtype=dtype, device=device)
        slots = torch.randperm(blocks * block, generator=torch.Generator().manual_seed(4))[:B * S].view(B, S)
        kw["slot_mapping"] = slots.to(device)
        rows = [divmod(int(x), block) for x in slots.flatten()]
    rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, rotary.freqs_table(ROPE, 32).to(device), START, **kw)
    rtol, atol = TOL[dtype]
    for out, x in ((q, q0), (k, k0)):
        torch.testing.assert_close(out.cpu().double(), reference(x, interleaved), rtol=rtol, atol=atol)
    assert torch.equal(bits(v), bits(v0))  # v is read, never written
    bhsd = kv_layout == "BHSD"
    written = torch.zeros((kc.shape[0], kc.shape[2] if bhsd else kc.shape[1]), dtype=torch.bool)
    for t, (o, i) in enumerate(rows):
        b, s = divmod(t, S)
        kc_row, vc_row = (kc[o, :, i], vc[o, :, i]) if bhsd else (kc[o, i], vc[o, i])
        assert torch.equal(bits(kc_row), bits(k[b, :, s])), f"k_cache row of token {(b, s)}"
        assert torch.equal(bits(vc_row), bits(v0[b, :, s])), f"v_cache row of token {(b, s)}"
        written[o, i] = True
    for c in (kc, vc):  # every other row still holds its poison
        other = (c.permute(0, 2, 1, 3) if bhsd else c)[~written.to(device)]
        assert torch.isnan(other.float()).all()


def test_mla_fp8_cache_and_refusals(device):
    D, v_dim = NOPE + ROPE, 10
    q, k = randn((1, H, S, D), torch.bfloat16, 5, device), randn((1, H, S, D), torch.bfloat16, 6, device)
    v = randn((1, H, S, v_dim), torch.bfloat16, 7, device)
    kc = torch.zeros((1, H, SMAX, D), dtype=FP8, device=device)
    vc = torch.zeros((1, H, SMAX, v_dim), dtype=FP8, device=device)
    scale = torch.tensor(0.5, device=device)
    freqs = rotary.freqs_table(ROPE, 32).to(device)
    k0 = k.clone()
    rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, freqs, START, rotary_offset=NOPE, k_scale=scale, v_scale=scale)
    want_v = (v.float() / 0.5).clamp(-448, 448).to(FP8)
    assert torch.equal(vc[0, :, START:START + S].view(torch.uint8), want_v[0].view(torch.uint8))
    want_k = (k.float() / 0.5).clamp(-448, 448).to(FP8)
    assert torch.equal(kc[0, :, START:START + S].view(torch.uint8), want_k[0].view(torch.uint8))
    assert not torch.equal(k, k0)

    snap = lambda t: t.view(torch.uint8).clone() if t.dtype == FP8 else bits(t).clone()  # noqa: E731
    snapshot = [snap(t) for t in (q, k, v, kc, vc)]
    bad = torch.zeros((1, H, SMAX, v_dim + 2), dtype=FP8, device=device)
    with pytest.raises(ValueError, match=r"v_cache must have v's head_dim = 10 \(k's and v's may differ"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, bad, freqs, START, rotary_offset=NOPE)
    with pytest.raises(ValueError, match=r"v must have the shape of k but for head_dim"):
        rotary.apply_rope_with_kv_cache_(q, k, v[:, :2], kc, vc, freqs, START, rotary_offset=NOPE)
    with pytest.raises(ValueError, match=r"v's head_dim \(its last dim\) must be > 0, got v \[1, 3, 5, 0\]"):
        rotary.apply_rope_with_kv_cache_(q, k, v[..., :0], kc, vc[..., :0], freqs, START, rotary_offset=NOPE)
    for t, s in zip((q, k, v, kc, vc), snapshot):  # a refused call writes nothing
        assert torch.equal(snap(t), s)
