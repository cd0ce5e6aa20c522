"""Precision: table entries and outputs against exact values, and the
fp32-angle compatibility mode against an independent float32 formula.

What "exact" means here. A table entry (p, j) is exp(i * p * inv_freq[j]).
inv_freq[j] = theta ** (-2j / d) is a float64 number, taken from the
independent reference (reference.py, numpy). The reference angle is the
exact product p * inv_freq[j] (mpmath at 40 digits, so not rounded to
float64: a float64 product errs by p * inv_freq[j] * 2^-53 rad and rounds p
past 2^53), and its cosine and sine are the true ones.
Nothing here calls rotary to build a reference.

Metrics (stated once, used below):
* table entries: max |entry - exact| over cos and sin, absolute (entries are
  of magnitude <= 1); bound 1e-7 (the brief), and in fact 2^-25 = one
  rounding to float32 (half an ulp at 1).
* fp32 outputs: per pair, ||out - exact||_2 <= 1e-6 * ||x||_2 (the rotation
  preserves the pair's norm, so this is the relative error of the rotated
  pair; an elementwise relative error is meaningless where a component
  cancels to ~0).
* fp16 / bf16 outputs: |out - exact| <= 0.5 ulp(exact) + 1e-6 * ||x pair||_2
  per element: one rounding of the exact result, plus slack for the fp32
  table and fp32 arithmetic before that rounding (~3e-7 relative), which can
  only move a result lying within that distance of a rounding boundary to the
  other side.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import inv_freq as ref_inv_freq
from rotary_testing.reference import exact_angle, rope_reference, rotate_pairs_nd
from rotary_testing.rope_testing import gen, op_positions

mpmath.mp.dps = 40

TWO22 = 2**22
HALF_ULP_1 = 2.0**-25  # half an fp32 ulp in [0.5, 1): one correct rounding of a cos/sin


def sample_positions(n=48, seed=0, top=TWO22):
    """Positions in [0, top], always including the ends and a few powers of two."""
    g = np.random.default_rng(seed)
    fixed = [0, 1, 2, 3, 4095, 4096, 131071, 131072, 2**20 - 1, 2**20, top - 1, top]
    rand = g.integers(0, top + 1, size=n).tolist()
    return sorted(set(fixed + rand))


def exact_entries(positions, inv, scale=1.0):
    """complex128 [len(positions), len(inv)]: scale * exp(i * p * inv_j), the
    exact product and its cos/sin evaluated exactly (mpmath)."""
    out = np.empty((len(positions), len(inv)), dtype=np.complex128)
    for r, p in enumerate(positions):
        for j, f in enumerate(inv):
            a = mpmath.mpf(int(p)) * mpmath.mpf(float(f))  # exact at 40 digits (p < 2^60, f 53 bits)
            out[r, j] = complex(float(scale * mpmath.cos(a)), float(scale * mpmath.sin(a)))
    return out


def entry_error(table: torch.Tensor, exact: np.ndarray) -> float:
    t = table.numpy().astype(np.complex128)
    return float(max(np.abs(t.real - exact.real).max(), np.abs(t.imag - exact.imag).max()))


# ---------------------------------------------------------------------------
# Table entries up to 2^22
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dim,theta", [(128, 10000.0), (64, 500000.0), (6, 10000.0)])
def test_table_rows_exact_up_to_2_22(dim, theta):
    """rope_freqs_at builds single rows with the table's own entry code (no
    table of 2^22 rows is materialised)."""
    positions = sample_positions(seed=dim)
    rows = rotary._C.rope_freqs_at(dim, torch.tensor(positions), theta)
    assert rows.dtype == torch.complex64 and rows.shape == (len(positions), dim // 2)
    err = entry_error(rows, exact_entries(positions, ref_inv_freq(dim, theta)))
    print(f"\ntable entries dim={dim} theta={theta:g}, positions up to 2^22: max |error| = {err:.3g}")
    assert err <= 1e-7
    assert err <= HALF_ULP_1 * (1 + 1e-6)  # correctly rounded (up to libm's last bit)


def test_real_table_up_to_2_22():
    """A real table, 2^22 + 1 rows (dim 4: 2 pairs, 64 MB): the last rows and
    sampled ones against exact values, and rope_freqs_at equal to it bit for
    bit."""
    table = rotary.freqs_table(4, TWO22 + 1)
    positions = sample_positions(n=64, seed=11)
    picked = table[torch.tensor(positions)]
    err = entry_error(picked, exact_entries(positions, ref_inv_freq(4)))
    assert err <= HALF_ULP_1 * (1 + 1e-6), err
    assert torch.equal(rotary._C.rope_freqs_at(4, torch.tensor(positions)), picked)
    del table


def test_moderate_table_every_entry():
    """Every entry of a [8192, 64] table, against numpy float64 cos/sin of the
    float64 angle (numpy's cos is within an ulp of float64, far below the
    float32 rounding checked here)."""
    dim, n = 128, 8192
    table = rotary.freqs_table(dim, n).numpy().astype(np.complex128)
    angle = np.arange(n, dtype=np.float64)[:, None] * ref_inv_freq(dim)[None, :]
    err = max(np.abs(table.real - np.cos(angle)).max(), np.abs(table.imag - np.sin(angle)).max())
    assert err <= HALF_ULP_1 * (1 + 1e-6) + 1e-15, err


def test_scaled_rule_rows_exact():
    """A rule with attention scaling (yarn): entries are scale * exp(i angle),
    the product also rounded once."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    inv, scale = rotary.inv_frequencies(32, 10000.0, scaling)
    assert scale != 1.0
    positions = sample_positions(n=16, seed=5)
    rows = rotary._C.rope_freqs_at(32, torch.tensor(positions), 10000.0, scaling)
    err = entry_error(rows, exact_entries(positions, inv.tolist(), scale))
    assert err <= 1e-7 and err <= 2 * HALF_ULP_1, err


FAR = [2**30 + 7, 2**40 + 1, 2**52 + 3, 2**53 - 1, 2**53 + 1, 2**55 + 3, 2**59 + 5, 2**60 - 1]


def test_far_positions_exact_up_to_2_60():
    """Positions past 2^53 (where a float64 product rounds p itself) up to the
    last one accepted, 2^60 - 1: table rows and the on-the-fly path are both
    within one float32 rounding of the exact rotation, and neighbours differ."""
    dim = 16
    inv, _ = rotary.inv_frequencies(dim)
    exact = exact_entries(FAR, ref_inv_freq(dim))
    rows = rotary._C.rope_freqs_at(dim, torch.tensor(FAR))
    assert entry_error(rows, exact) <= 2**-25 * 1.01
    x = torch.zeros(1, 1, len(FAR), dim, dtype=torch.float64)
    x[..., 0::2] = 1.0
    out = rotary.apply_rope(x, rotary.freqs_table(dim, 1), inv_freq=inv, **op_positions(0, torch.tensor(FAR)[None]))
    got = torch.complex(out[0, 0, :, 0::2], out[0, 0, :, 1::2])
    assert entry_error(got, exact) <= 2**-25 * 1.01
    prev = rotary._C.rope_freqs_at(dim, torch.tensor([p - 1 for p in FAR]))
    assert not (prev == rows).all(dim=1).any()


def test_positions_at_2_60_are_refused():
    f, inv = rotary.freqs_table(8, 4), rotary.inv_frequencies(8)[0]
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len = 1152921504606846974 \+ 4 reaches past the last position"):
        rotary.apply_rope(x, f, 2**60 - 2, inv_freq=inv)
    with pytest.raises(IndexError, match=r"has position 1441151880758558720 \(start_pos 576460752303423488 \+ offsets"
                                         r" \+ s\); positions must be < 2\^60"):
        rotary.apply_rope(x, f, 2**59, offsets=torch.tensor([2**59 + 2**58]), inv_freq=inv)
    assert torch.isfinite(rotary.apply_rope(x, f, 2**60 - 4, inv_freq=inv)).all()


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_past_table_path_equals_table_bit_for_bit(interleaved):
    """The op's on-the-fly path (positions past a 1-row table, with inv_freq)
    gives exactly the table entries: with x = (1, 0) in every pair and float64
    math, the output pair is (cos, sin) as stored."""
    dim = 16
    positions = sample_positions(n=40, seed=3)
    n = len(positions)
    x = torch.zeros(1, 1, n, dim, dtype=torch.float64)
    if interleaved:
        x[..., 0::2] = 1.0
    else:
        x[..., : dim // 2] = 1.0
    inv, _ = rotary.inv_frequencies(dim)
    out = rotary.apply_rope(x, rotary.freqs_table(dim, 1), interleaved=interleaved, inv_freq=inv, **op_positions(0, torch.tensor(positions)[None]))[0, 0]
    c, s = (out[:, 0::2], out[:, 1::2]) if interleaved else (out[:, : dim // 2], out[:, dim // 2 :])
    rows = rotary._C.rope_freqs_at(dim, torch.tensor(positions))
    assert torch.equal(c, rows.real.double()) and torch.equal(s, rows.imag.double())
    err = entry_error(rows, exact_entries(positions, ref_inv_freq(dim)))
    assert err <= 1e-7


# ---------------------------------------------------------------------------
# Outputs against the float64 reference
# ---------------------------------------------------------------------------
def _pair_view(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """[..., D] -> [..., D/2, 2] pairs (a copy is fine here)."""
    d = t.shape[-1]
    if interleaved:
        return t.reshape(*t.shape[:-1], d // 2, 2)
    return torch.stack([t[..., : d // 2], t[..., d // 2 :]], dim=-1)


def _ulp(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of `dtype` at |v| (subnormal spacing below the smallest normal)."""
    mant = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = torch.finfo(dtype).tiny
    e = np.floor(np.log2(np.maximum(np.abs(v), tiny)))
    return np.exp2(e - mant)


def _outputs(dtype, interleaved, seed):
    """One module call reaching positions up to 2^22 (table rows and the
    on-the-fly path): returns (x, out, exact) as float64 arrays."""
    B, H, S, D = 2, 3, 64, 128
    g = gen(seed)
    x = torch.randn(B, H, S, D, generator=g).to(dtype)
    ids = torch.randint(0, TWO22 + 1, (B, S), generator=g)
    ids[0, :4] = torch.tensor([0, 4095, TWO22 - 1, TWO22])
    rope = rotary.RotaryEmbedding(D, 4096, interleaved=interleaved)
    out = rope(x, position_ids=ids)
    exact = rope_reference(x, 0, interleaved, ids)
    return x.double(), out.double(), exact


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_fp32_outputs_relative_error(interleaved):
    x, out, exact = _outputs(torch.float32, interleaved, seed=1)
    err = (_pair_view(out - exact, interleaved).norm(dim=-1) / _pair_view(x, interleaved).norm(dim=-1)).max()
    print(f"\nfp32 output, max per-pair relative error: {float(err):.3g}")
    assert err <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_16bit_outputs_within_one_rounding(dtype, interleaved):
    x, out, exact = _outputs(dtype, interleaved, seed=2)
    pair_norm = _pair_view(x, interleaved).norm(dim=-1, keepdim=True).expand(*x.shape[:-1], x.shape[-1] // 2, 2)
    norm = pair_norm.reshape(*x.shape) if interleaved else torch.cat([pair_norm[..., 0], pair_norm[..., 1]], -1)
    e, o = exact.numpy(), out.numpy()
    half_ulp = 0.5 * _ulp(e, dtype)
    excess = (np.abs(o - e) - half_ulp) / norm.numpy()  # beyond one correct rounding, relative to ||pair||
    correctly_rounded = float((torch.from_numpy(e).to(dtype).double().numpy() == o).mean())
    print(
        f"\n{dtype} output: worst |out - exact| = {(np.abs(o - e) / (2 * half_ulp)).max():.3f} ulp; "
        f"beyond half an ulp by at most {max(excess.max(), 0):.2g} * ||x pair||; "
        f"{100 * correctly_rounded:.3f}% of elements correctly rounded"
    )
    assert (excess <= 1e-6).all(), float(excess.max())


# ---------------------------------------------------------------------------
# angle_dtype="float32": the fp32-angle tables of Hugging Face / Meta
# ---------------------------------------------------------------------------
def fp32_angle_table(positions, dim, theta=10000.0, scale=1.0):
    """Independent numpy float32 formula: float32(p) * float32(inv_freq) in
    float32 (numpy rounds the float32 product once), then cos/sin of that
    angle in float64, times the scaling, rounded to float32."""
    inv32 = ref_inv_freq(dim, theta).astype(np.float32)
    p32 = np.asarray(positions, dtype=np.int64).astype(np.float32)
    angle32 = p32[:, None] * inv32[None, :]
    assert angle32.dtype == np.float32
    a = angle32.astype(np.float64)
    return (scale * np.cos(a)).astype(np.float32) + 1j * (scale * np.sin(a)).astype(np.float32)


def test_fp32_angle_table_matches_numpy_float32():
    dim, n = 128, 8192
    ours = rotary.freqs_table(dim, n, angle_dtype="float32").numpy()
    ref = fp32_angle_table(range(n), dim)
    diff = np.maximum(np.abs(ours.real - ref.real), np.abs(ours.imag - ref.imag))
    # Same angle bits; cos/sin may differ in the last float bit only where
    # the float64 cos of two libms straddle a float32 rounding boundary.
    assert diff.max() <= 2.0**-24
    assert (diff == 0).mean() > 0.999


def test_fp32_angle_rows_far_out_match_numpy_float32():
    positions = sample_positions(n=64, seed=9)
    ours = rotary._C.rope_freqs_at(128, torch.tensor(positions), angle_dtype="float32").numpy()
    ref = fp32_angle_table(positions, 128)
    assert np.maximum(np.abs(ours.real - ref.real), np.abs(ours.imag - ref.imag)).max() <= 2.0**-24
    # and it is not the exact table: at 2^22 the fp32 angle is off by ~0.1 rad
    exact = rotary._C.rope_freqs_at(128, torch.tensor(positions)).numpy()
    assert np.abs(ours - exact).max() > 1e-2


def test_fp32_angle_table_matches_torch_outer_formula():
    """The formula the mode reproduces, in torch (Meta / HF):
    torch.outer(t.float(), inv_freq.float()) then cos/sin in float32. Same
    angle bits; torch's float32 cos/sin are within ~1 ulp of the correctly
    rounded values we store."""
    dim = 128
    t = torch.tensor(sample_positions(n=256, seed=4, top=2**20))
    inv = torch.from_numpy(ref_inv_freq(dim))
    angles = torch.outer(t.float(), inv.float())
    hf = torch.polar(torch.ones_like(angles), angles)
    ours = rotary._C.rope_freqs_at(dim, t, angle_dtype=torch.float32)
    assert (ours - hf).abs().max() <= 3e-7
    assert (rotary._C.rope_freqs_at(dim, t) - hf).abs().max() > 1e-3  # the default is not that formula


def test_fp32_angle_scaled_rule():
    scaling = {"rope_type": "linear", "factor": 2.0}
    inv, scale = rotary.inv_frequencies(16, 10000.0, scaling)
    ours = rotary.freqs_table(16, 300, scaling=scaling, angle_dtype="float32").numpy()
    inv32 = inv.numpy().astype(np.float32)
    a = (np.arange(300, dtype=np.float32)[:, None] * inv32[None, :]).astype(np.float64)
    ref = np.cos(a).astype(np.float32) + 1j * np.sin(a).astype(np.float32)
    assert np.abs(ours - ref).max() <= 2.0**-23


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["py", "cpp"])
def test_fp32_angle_modules(make):
    m = make(32, 512, 10000.0, False, angle_dtype="float32")
    assert m.angle_dtype == "float32"
    assert torch.equal(m.freqs, rotary.freqs_table(32, 512, angle_dtype="float32"))
    assert m.inv_freq.dtype == torch.float64  # the rule's exact frequencies
    x = torch.randn(1, 2, 8, 32)
    out = m(x, start_pos=504)
    f = rotary.freqs_table(32, 512, angle_dtype="float32")
    assert torch.equal(out, rotary.apply_rope(x, f, 504, False))
    # past the table: no float64 on-the-fly path for float32 tables
    with pytest.raises(IndexError, match=r"float32.*exceeds max_seq_len 512"):
        m(x, start_pos=505)
    with pytest.raises(IndexError, match=r"outside the freqs table"):
        m(x, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 600]]))
    # the default module computes those positions exactly on the fly
    d = make(32, 512, 10000.0, False)
    assert d(x, start_pos=505).shape == x.shape


def test_fp32_angle_python_and_cpp_modules_agree():
    a = rotary.RotaryEmbedding(64, 1024, 500000.0, angle_dtype=torch.float32)
    b = rotary.CppRotaryEmbedding(64, 1024, 500000.0, angle_dtype="float32")
    assert torch.equal(a.freqs, b.freqs)
    q, k = torch.randn(2, 4, 16, 64), torch.randn(2, 1, 16, 64)
    for x, y in zip(a(q, k, start_pos=1000), b(q, k, start_pos=1000)):
        assert torch.equal(x, y)


def test_fp32_angle_from_hf_config():
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0, "max_position_embeddings": 128}
    m = rotary.RotaryEmbedding.from_hf_config(cfg, angle_dtype="float32")
    assert m.angle_dtype == "float32" and not m.interleaved
    assert torch.equal(m.freqs, rotary.freqs_table(64, 128, angle_dtype="float32"))


def test_phase_error_grows_only_in_fp32_mode():
    """The headline numbers of README "Precision", as bounds: the phase of
    the stored entry against the exact one, over all 64 pairs of dim 128."""
    positions = [131072 - 1, 2**20 - 1, TWO22]
    exact = exact_entries(positions, ref_inv_freq(128))
    for mode, bound in (("float64", 1e-7), ("float32", None)):
        rows = rotary._C.rope_freqs_at(128, torch.tensor(positions), angle_dtype=mode).numpy()
        phase = np.abs(np.angle(rows.astype(np.complex128) * np.conj(exact)))
        if bound is not None:
            assert phase.max() <= bound
        else:
            assert phase[1].max() > 1e-3  # 1M: the fp32 angle is visibly off


def test_angles_past_2_62_rad_are_refused_past_the_table():
    """The table refuses rows whose angle passes 2^62 rad; a position past the
    table turned by a large inv_freq is refused the same way (it lost its
    phase: 2.3e-6 off at 9e26 rad), in every position form and both modules."""
    f, x = rotary.freqs_table(2, 1), torch.randn(1, 1, 2, 2, dtype=torch.float64)
    inv = torch.tensor([1.7e12], dtype=torch.float64)
    match = r"past the table, where inv_freq up to 1.7e\+12 turns it by .* rad; float64 angles keep their phase below 2\^62 rad"
    with pytest.raises(IndexError, match=r"the last token has position 3000000001, " + match):
        rotary.apply_rope(x, f, 3 * 10**9, inv_freq=inv)
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 1\) has position 3000000000, " + match):
        rotary.apply_rope(x, f, inv_freq=inv, position_ids=torch.tensor([[5, 3 * 10**9]]))
    with pytest.raises(IndexError, match=match):
        rotary.apply_rope(x, f, 0, inv_freq=inv, offsets=torch.tensor([3 * 10**9]))
    assert torch.isfinite(rotary.apply_rope(x, f, 10**6, inv_freq=inv)).all()  # 1.7e18 rad: below 2^62
    m = rotary.RotaryEmbedding(2, 16, scaling={"rope_type": "linear", "factor": 1e-9})
    with pytest.raises(IndexError, match=r"inv_freq up to 1e\+09"):
        m(x, 930429270644776107)


@pytest.mark.parametrize("form", ["negated", "neg_view", "scaled", "neg_conj_view"])
def test_rows_past_the_table_keep_its_first_entry_sign_and_scale(form):
    """Rows past the table are the first entry times e^{i p w}: a negated
    table (materialised or a negative-bit view) stays negated past its end,
    where it turned positive before; a scaled one keeps its scaling. A view
    with both bits turns by -angle past its end too (it turned by +angle)."""
    f = rotary.freqs_table(4, 4)
    table = {"negated": -f, "neg_view": torch._neg_view(f), "scaled": f * 0.5,
             "neg_conj_view": torch._neg_view(f.conj())}[form]
    first = {"negated": -1.0, "neg_view": -1.0, "scaled": 0.5, "neg_conj_view": -1.0}[form]
    inv = rotary.inv_frequencies(4)[0]
    x = torch.randn(1, 1, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    angle = exact_angle(np.arange(8), inv.numpy()) * (-1 if form == "neg_conj_view" else 1)
    want = first * rotate_pairs_nd(x.numpy(), angle, True)
    torch.testing.assert_close(rotary.apply_rope(x, table, inv_freq=inv), torch.from_numpy(want),
                               rtol=1e-6, atol=1e-6)
