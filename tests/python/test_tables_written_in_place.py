"""A host-driven rule's tables written in place from outside: DDP's
broadcast_buffers (the default) copies rank 0's freqs and inv_freq into
every rank's buffers before each forward. The state machine knew the
buffers by their storage and kept its own state, so a rank in another
state (longrope's long factors, a grown dynamic base) rotated with rank
0's tables, silently. It now notes the pair's version counters and meets a
pair written since afresh: its state read from its inv_freq, and a freqs of
another length than that state's rebuilt."""

import math

import numpy as np
import pytest
import torch

import rotary
from test_state import LONGROPE, MODULES, gen

DIM, ORIG = 8, 64
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 32}


def rule_reference(x, positions, inv_freq, scale=1.0):
    """Float64 interleaved RoPE of x [B, H, S, D] at `positions` [S], turned by inv_freq, scaled."""
    X = x.double().numpy()
    angle = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None, :]
    c, s = np.cos(angle) * scale, np.sin(angle) * scale
    out = X.copy()
    out[..., 0::2] = X[..., 0::2] * c - X[..., 1::2] * s
    out[..., 1::2] = X[..., 0::2] * s + X[..., 1::2] * c
    return torch.from_numpy(out)


def longrope_inv(factors):
    return 1.0 / (np.asarray(factors) * 10000.0 ** (np.arange(0, DIM, 2) / DIM))


LONGROPE_SCALE = math.sqrt(1 + math.log(LONGROPE["factor"]) / math.log(ORIG))


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_longrope_pair_written_from_another_state_is_met_afresh(kind):
    long = MODULES[kind](DIM, 256, scaling=LONGROPE)
    long(torch.randn(1, 1, 100, DIM, generator=gen(1)))  # past original_max_position_embeddings: the long factors
    short = MODULES[kind](DIM, 256, scaling=LONGROPE)
    x = torch.randn(1, 2, 8, DIM, generator=gen(2))
    short(x)
    with torch.no_grad():  # what DDP's broadcast does on a rank in the short state
        short.freqs.copy_(long.freqs)
        short.inv_freq.copy_(long.inv_freq)
    want = rule_reference(x, range(8), longrope_inv(LONGROPE["short_factor"]), LONGROPE_SCALE)
    wrong = rule_reference(x, range(8), longrope_inv(LONGROPE["long_factor"]), LONGROPE_SCALE)
    assert not torch.allclose(want, wrong, atol=1e-2)  # the check below can fail
    torch.testing.assert_close(short(x).double(), want, rtol=0, atol=2e-6)
    assert short.rope_state == 0
    freqs = short.freqs
    short(x)  # rebuilt once: a later call with no write keeps the tables
    assert short.freqs is freqs or kind == "cpp"


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_grown_inv_freq_written_beside_a_plain_freqs_is_rebuilt(kind):
    """A grown float64 dynamic table keeps one row: DDP's broadcast between
    ranks in other states wrote the grown inv_freq beside a plain freqs."""
    grown = MODULES[kind](DIM, 16, scaling=DYNAMIC)
    grown(torch.randn(1, 1, 40, DIM, generator=gen(3)))
    assert list(grown.freqs.shape) == [1, DIM // 2]
    for seq, seed in ((40, 4), (24, 5)):  # the written state's reach (its freqs of one row), then a plain one
        plain = MODULES[kind](DIM, 16, scaling=DYNAMIC)
        with torch.no_grad():
            plain.inv_freq.copy_(grown.inv_freq)
        x = torch.randn(1, 2, seq, DIM, generator=gen(seed))
        # transformers' dynamic NTK base past max_position_embeddings (32), theta below it
        base = 10000.0 * (2.0 * seq / 32 - 1) ** (DIM / (DIM - 2)) if seq > 32 else 10000.0
        want = rule_reference(x, range(seq), 1.0 / base ** (np.arange(0, DIM, 2) / DIM))
        torch.testing.assert_close(plain(x).double(), want, rtol=0, atol=2e-6)
        assert plain.rope_state == (seq if seq > 32 else 0)


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_write_of_the_same_state_keeps_the_tables(kind):
    """Rank 0's tables in the same state (the usual step): nothing rebuilt."""
    a, b = MODULES[kind](DIM, 256, scaling=LONGROPE), MODULES[kind](DIM, 256, scaling=LONGROPE)
    x = torch.randn(1, 2, 8, DIM, generator=gen(5))
    want = b(x)
    with torch.no_grad():
        b.freqs.copy_(a.freqs)
        b.inv_freq.copy_(a.inv_freq)
    freqs = b.freqs
    assert torch.equal(b(x), want)
    assert b.freqs is freqs


@pytest.mark.parametrize("kind", list(MODULES))
def test_tables_without_a_version_counter_are_met_afresh(kind):
    """Buffers that are inference tensors (a module copied under
    inference_mode) keep no version counter: no write to them can be seen,
    so they are read again at every call."""
    import copy

    long = MODULES[kind](DIM, 256, scaling=LONGROPE)
    long(torch.randn(1, 1, 100, DIM, generator=gen(6)))
    x = torch.randn(1, 2, 8, DIM, generator=gen(7))
    want = rule_reference(x, range(8), longrope_inv(LONGROPE["short_factor"]), LONGROPE_SCALE)
    with torch.inference_mode():
        short = copy.deepcopy(MODULES[kind](DIM, 256, scaling=LONGROPE))
        short(x)
        short.freqs.copy_(long.freqs)
        short.inv_freq.copy_(long.inv_freq)
        torch.testing.assert_close(short(x).double(), want, rtol=0, atol=2e-6)

