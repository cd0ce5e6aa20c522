"""rotary.sinusoidal_table / alibi_slopes / alibi_bias against the seed
formulas, re-implemented here in plain Python math exactly as seed 001
("Positional encoding -- sinusoidal, RoPE, ALiBi") writes them, plus the
float32 torch version of seed 000 and the numpy version of seed 004."""

import math

import numpy as np
import pytest
import torch

import rotary


# ---------------------------------------------------------------------------
# Seed 001, verbatim in plain Python (float64)
# ---------------------------------------------------------------------------
def seed_sinusoidal_pe(n, d, base=10000.0):
    pe = [[0.0] * d for _ in range(n)]
    for pos in range(n):
        for i in range(d // 2):
            theta = pos / (base ** (2 * i / d))
            pe[pos][2 * i] = math.sin(theta)
            pe[pos][2 * i + 1] = math.cos(theta)
    return pe


def seed_alibi_slopes(n_heads):
    return [2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)]


def seed_alibi_bias(n_heads, seq_len, causal=True):
    slopes = seed_alibi_slopes(n_heads)
    out = []
    for m in slopes:
        head_bias = []
        for i in range(seq_len):
            row = []
            for j in range(seq_len):
                if causal and j > i:
                    row.append(float("-inf"))
                else:
                    row.append(-m * abs(i - j))
            head_bias.append(row)
        out.append(head_bias)
    return out


# Seed 000: float32 torch, one position at a time.
def seed000_sinusoidal(pos, d, base):
    i = torch.arange(0, d, 2, dtype=torch.float32)
    theta = base ** (-i / d)
    ang = pos * theta
    pe = torch.zeros(d)
    pe[0::2] = torch.sin(ang)
    pe[1::2] = torch.cos(ang)
    return pe


# Seed 004: numpy float64, angles pos * base^(-2i/d).
def seed004_sinusoidal_pe(pos, d, base=10000.0):
    angles = pos * base ** (-2.0 * np.arange(d // 2) / d)
    pe = np.empty(d)
    pe[0::2] = np.sin(angles)
    pe[1::2] = np.cos(angles)
    return pe


def as_f32(nested):
    return torch.tensor(nested, dtype=torch.float64).to(torch.float32)


# ---------------------------------------------------------------------------
# sinusoidal_table
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("base", [10000.0, 500.0, 2.5])
@pytest.mark.parametrize("n,d", [(1, 2), (8, 8), (50, 16), (130, 64), (7, 6)])
def test_sinusoidal_table_is_seed_001(n, d, base):
    pe = rotary.sinusoidal_table(n, d, base)
    assert pe.dtype == torch.float32 and pe.shape == (n, d) and pe.is_contiguous()
    # float64 math rounded once: bit for bit the seed's values rounded to float32.
    assert torch.equal(pe, as_f32(seed_sinusoidal_pe(n, d, base)))


def test_sinusoidal_table_defaults_and_keywords():
    assert torch.equal(rotary.sinusoidal_table(10, 8), rotary.sinusoidal_table(n=10, d=8, base=10000.0))
    assert rotary.sinusoidal_table(0, 8).shape == (0, 8)
    assert torch.equal(rotary.sinusoidal_table(1, 4), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


def test_sinusoidal_table_matches_seed_000_and_004():
    n, d, base = 64, 16, 10000.0
    pe = rotary.sinusoidal_table(n, d, base)
    for pos in range(n):
        # seed 000 computes its angles in float32: close, not equal.
        torch.testing.assert_close(pe[pos], seed000_sinusoidal(pos, d, base), rtol=0, atol=2e-5)
        # seed 004 multiplies by base^(-2i/d) instead of dividing: an ulp apart at most.
        torch.testing.assert_close(pe[pos].double(), torch.from_numpy(seed004_sinusoidal_pe(pos, d, base)), rtol=0, atol=1e-7)


def test_sinusoidal_table_shares_rope_frequencies():
    """Same tick rates as RoPE: (sin, cos) of the table are (imag, real) of rope_freqs."""
    n, d = 100, 32
    pe = rotary.sinusoidal_table(n, d).view(n, d // 2, 2)
    f = torch.view_as_real(rotary.freqs_table(d, n))  # [n, d/2, (cos, sin)]
    torch.testing.assert_close(pe, f.flip(-1), rtol=0, atol=1e-6)


def test_sinusoidal_add_leaks_absolute_position():
    """Seed 000's point: with the additive table, q.k at a fixed offset drifts."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    pe = rotary.sinusoidal_table(32, 8)
    scores = [float((q + pe[m]) @ (k + pe[m - 2])) for m in (2, 5, 9, 14, 20)]
    assert max(scores) - min(scores) > 1e-3


# ---------------------------------------------------------------------------
# ALiBi
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 8, 12, 16, 32, 40])
def test_alibi_slopes_is_seed_001(n_heads):
    m = rotary.alibi_slopes(n_heads)
    assert m.dtype == torch.float32 and m.shape == (n_heads,)
    assert torch.equal(m, as_f32(seed_alibi_slopes(n_heads)))


def test_alibi_slopes_powers_of_two():
    assert rotary.alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    assert rotary.alibi_slopes(8).tolist() == [2.0 ** -(h + 1) for h in range(8)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n_heads,seq_len", [(1, 1), (4, 6), (3, 9), (8, 17)])
def test_alibi_bias_is_seed_001(n_heads, seq_len, causal):
    b = rotary.alibi_bias(n_heads, seq_len, causal)
    assert b.dtype == torch.float32 and b.shape == (n_heads, seq_len, seq_len)
    want = as_f32(seed_alibi_bias(n_heads, seq_len, causal))
    assert torch.equal(b, want)  # -inf == -inf
    if causal:
        assert torch.isneginf(b).sum() == n_heads * seq_len * (seq_len - 1) // 2


def test_alibi_bias_defaults_and_structure():
    assert torch.equal(rotary.alibi_bias(4, 6), rotary.alibi_bias(n_heads=4, seq_len=6, causal=True))
    full = rotary.alibi_bias(4, 6, False)
    causal = rotary.alibi_bias(4, 6)
    lower = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(causal[:, lower], full[:, lower])
    assert torch.equal(full, full.transpose(1, 2))  # |i - j| is symmetric
    assert (full.diagonal(dim1=1, dim2=2) == 0).all()
    # One row of head h is -slope[h] * distance.
    m = rotary.alibi_slopes(4)
    assert torch.equal(full[:, 5], -(m[:, None].double() * torch.tensor([5.0, 4, 3, 2, 1, 0])).float())
    # softmax over a causal row gives no weight to future keys.
    w = torch.softmax(causal, dim=-1)
    assert (w[:, ~lower] == 0).all()
    assert rotary.alibi_bias(3, 0).shape == (3, 0, 0)


# ---------------------------------------------------------------------------
# Errors and exports
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda: rotary.sinusoidal_table(-1, 8), r"sinusoidal_table: n \(the number of positions\) must be >= 0, got -1"),
        (lambda: rotary.sinusoidal_table(4, 7), r"sinusoidal_table: d \(the model dim\) must be even and > 0, got 7"),
        (lambda: rotary.sinusoidal_table(4, 0), r"sinusoidal_table: d .*got 0"),
        (lambda: rotary.sinusoidal_table(4, 8, 0.0), r"sinusoidal_table: base must be finite and > 0, got 0"),
        (lambda: rotary.sinusoidal_table(4, 8, -2.0), r"base must be finite and > 0, got -2"),
        (lambda: rotary.sinusoidal_table(4, 8, float("nan")), r"base must be finite and > 0, got nan"),
        (lambda: rotary.sinusoidal_table(4, 8, float("inf")), r"base must be finite and > 0, got inf"),
        (lambda: rotary.alibi_slopes(0), r"alibi_slopes: n_heads must be > 0, got 0"),
        (lambda: rotary.alibi_bias(0, 4), r"alibi_bias: n_heads must be > 0, got 0"),
        (lambda: rotary.alibi_bias(2, -3), r"alibi_bias: seq_len must be >= 0, got -3"),
    ],
    ids=["n-neg", "d-odd", "d-zero", "base-zero", "base-neg", "base-nan", "base-inf", "slopes-0", "bias-heads", "bias-seq"],
)
def test_invalid_arguments(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_exported():
    for name in ("sinusoidal_table", "alibi_slopes", "alibi_bias"):
        assert name in rotary.__all__ and callable(getattr(rotary, name))


def test_flags_and_bases_are_checked():
    with pytest.raises(TypeError, match=r"alibi_bias: causal must be a bool, got None"):
        rotary.alibi_bias(2, 3, None)
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'yes'"):
        rotary.alibi_bias(2, 3, "yes")
    with pytest.raises(ValueError, match=r"sinusoidal_table: base = 4.94066e-324 gives the divisor"):
        rotary.sinusoidal_table(64, 64, 5e-324)
    assert torch.isfinite(rotary.sinusoidal_table(64, 64, 1e-300)).all()  # small but representable: finite


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        # pybind took a bool as an int (a 1-row table, base 1.0) and named no argument for a float.
        (lambda: rotary.sinusoidal_table(True, 4), TypeError, r"sinusoidal_table: n must be an int, got True"),
        (lambda: rotary.sinusoidal_table(4, 4, True), TypeError, r"sinusoidal_table: base must be a number, got True"),
        (lambda: rotary.sinusoidal_table(4.0, 4), TypeError, r"sinusoidal_table: n must be an int, got 4.0"),
        (lambda: rotary.sinusoidal_table(2**64, 4), ValueError, r"sinusoidal_table: n must fit in int64"),
        (lambda: rotary.alibi_slopes(True), TypeError, r"alibi_slopes: n_heads must be an int, got True"),
        (lambda: rotary.alibi_bias(2, True), TypeError, r"alibi_bias: seq_len must be an int, got True"),
        # Past the machine's memory: named, before any allocation.
        (lambda: rotary.sinusoidal_table(2**40, 4), ValueError,
         r"sinusoidal_table: a table of n=1099511627776 rows x d=4 needs 17592186044416 bytes \(float32\), more than "
         r"this machine's memory .*pass a smaller n"),
        (lambda: rotary.alibi_slopes(2**62), ValueError,
         r"alibi_slopes: n_heads=4611686018427387904 slopes needs more than 2\^64 bytes.*pass a smaller n_heads"),
        (lambda: rotary.alibi_bias(1, 2**20), ValueError,
         r"alibi_bias: a bias of n_heads=1 x seq_len=1048576 x seq_len needs 4398046511104 bytes \(float32\)"),
        (lambda: rotary.alibi_bias(2**40, 2**20), ValueError, r"alibi_bias: n_heads=1099511627776 slopes needs"),
    ],
    ids=["n-bool", "base-bool", "n-float", "n-past-int64", "slopes-bool", "seq-bool", "table-bytes", "slopes-bytes",
         "bias-bytes", "bias-slopes-bytes"],
)
def test_arguments_are_named(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_any_integer_type_is_an_int():
    """numpy's integers and floats, and 0-d integer tensors, as pybind's int64
    and double take them (and freqs_table does)."""
    want = rotary.sinusoidal_table(10, 64, 100.0)
    assert torch.equal(rotary.sinusoidal_table(np.int64(10), np.int32(64), np.float32(100.0)), want)
    assert torch.equal(rotary.sinusoidal_table(torch.tensor(10), 64, base=100), want)
    assert torch.equal(rotary.alibi_slopes(np.int64(8)), rotary.alibi_slopes(8))
    assert torch.equal(rotary.alibi_bias(np.int64(8), torch.tensor(16), causal=False), rotary.alibi_bias(8, 16, False))
