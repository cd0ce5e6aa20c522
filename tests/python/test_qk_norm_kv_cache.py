"""apply_qk_norm_rope_with_kv_cache_: the prologue and the cache write in one
call. q and k against the float64 norm-then-rope reference; the cache rows
hold k's result bits (or their fp8 encoding by torch's own expression) and
v's raw bits; every other cache byte stays as poisoned."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, randn
from rotary_testing.prologue_reference import check, heads_weight, ref_prologue

MAX_LEN = 64


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_layout", ["BHSD", "NHD"])
def test_cache_holds_the_normalized_rotated_k(device, dtype, kv_layout):
    B, Hq, Hk, S, D, r = 2, 4, 2, 3, 16, 8
    q = randn((B, S, Hq, D), dtype, 1, device)
    k = randn((B, S, Hk, D), dtype, 2, device)
    v = randn((B, S, Hk, D), dtype, 3, device)
    qw, kw = heads_weight("head", Hq, D, dtype, 4, device), heads_weight("head", Hk, D, dtype, 5, device)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    freqs = rotary.freqs_table(r, MAX_LEN).to(device)
    start = 5
    kw_cache = {}
    if kv_layout == "BHSD":
        shape = (B, Hk, 16, D)
    else:
        blocks, block = 6, 4
        shape = (blocks, block, Hk, D)
        slots = torch.tensor([[9, 2, 17], [4, -1, 22]], device=device)
        kw_cache = dict(slot_mapping=slots)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    rq, rk = rotary.apply_qk_norm_rope_with_kv_cache_(
        q, k, v, k_cache, v_cache, freqs, start, False, layout="BSHD", kv_layout=kv_layout, rotary_offset=4,
        q_weight=qw, k_weight=kw, eps=1e-5, **kw_cache)
    assert rq is q and rk is k and torch.equal(v, v0)
    check(q, ref_prologue(q0, qw, r, 4, start, False, eps=1e-5, layout="BSHD"), dtype)
    check(k, ref_prologue(k0, kw, r, 4, start, False, eps=1e-5, layout="BSHD"), dtype)
    written = torch.zeros(shape[:-1], dtype=torch.bool, device=device)
    for b in range(B):
        for s in range(S):
            if kv_layout == "BHSD":
                at = (b, slice(None), start + s)
            else:
                slot = int(slots[b, s])
                if slot < 0:
                    continue
                at = (slot // block, slot % block)
            assert torch.equal(k_cache[at], k[b, s]) and torch.equal(v_cache[at], v0[b, s])
            written[at] = True
    assert torch.isnan(k_cache[~written]).all() and torch.isnan(v_cache[~written]).all()


def test_fp8_cache():
    B, Hq, Hk, S, D = 1, 2, 2, 4, 8
    q, k, v = randn((B, Hq, S, D), seed=1), randn((B, Hk, S, D), seed=2), randn((B, Hk, S, D), seed=3)
    kw = 2.0 + torch.rand(D, generator=torch.Generator().manual_seed(4))  # large k values, so some saturate
    k_scale, v_scale = torch.tensor([0.004, 0.5]), torch.tensor(0.01)
    k_cache = torch.zeros(B, Hk, 8, D, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(B, Hk, 8, D, dtype=torch.float8_e4m3fn)
    freqs = rotary.freqs_table(D, MAX_LEN)
    rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs, 2, k_weight=kw, k_scale=k_scale,
                                             v_scale=v_scale)
    want_k = (k / k_scale.view(1, Hk, 1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    want_v = (v / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (k / k_scale.view(1, Hk, 1, 1)).abs().max() > 448  # saturation is exercised
    assert torch.equal(k_cache[:, :, 2:6].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache[:, :, 2:6].view(torch.uint8), want_v.view(torch.uint8))


def test_refusals_write_nothing():
    q, k, v = randn((1, 2, 3, 8), seed=1), randn((1, 1, 3, 8), seed=2), randn((1, 1, 3, 8), seed=3)
    k_cache, v_cache = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    freqs = rotary.freqs_table(8, MAX_LEN)
    saved = [t.clone() for t in (q, k, k_cache, v_cache)]
    cases = [
        (dict(q_weight=torch.ones(4)), r"q_weight must be 1-D \[head_dim\] = \[8\]"),
        (dict(start_pos=2), "exceeds the cache's max_seq_len 4"),
        (dict(k_weight=k_cache[0, 0, 0]), "k_cache and k_weight overlap in memory"),
        (dict(norm="rms"), "norm must be 'head'"),
    ]
    for bad, message in cases:
        with pytest.raises((ValueError, IndexError, RuntimeError), match=message):
            rotary.apply_qk_norm_rope_with_kv_cache_(q, k, v, k_cache, v_cache, freqs, **bad)
        for t, s in zip((q, k, k_cache, v_cache), saved):
            assert torch.equal(t, s)


def test_opcheck():
    q, k, v = randn((1, 2, 3, 8), seed=1), randn((1, 1, 3, 8), seed=2), randn((1, 1, 3, 8), seed=3)
    caches = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    freqs = torch.view_as_real(rotary.freqs_table(8, MAX_LEN))
    torch.library.opcheck(torch.ops.rotary.apply_qk_norm_rope_with_kv_cache_.default,
                          (q, k, v, *caches, freqs), dict(start_pos=1, k_weight=torch.rand(8), eps=1e-5))
