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


def dynamic_inv(seq):
    """transformers' dynamic NTK inverse frequencies at seq positions: the base grows past
    max_position_embeddings (32), theta below it."""
    base = 10000.0 * (2.0 * seq / 32 - 1) ** (DIM / (DIM - 2)) if seq > 32 else 10000.0
    return 1.0 / base ** (np.arange(0, DIM, 2) / DIM)


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
    held = short.freqs.data_ptr()
    short(x)  # rebuilt once: a later call with no write keeps the tables
    assert short.freqs.data_ptr() == held


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_grown_inv_freq_written_beside_a_plain_freqs_is_rebuilt(kind):
    """A grown float64 dynamic table keeps one row: a write of a grown
    inv_freq alone (DDP cannot copy a one-row freqs into a plain one) left it
    beside a plain freqs."""
    grown = MODULES[kind](DIM, 16, scaling=DYNAMIC)
    grown(torch.randn(1, 1, 40, DIM, generator=gen(3)))
    assert list(grown.freqs.shape) == [1, DIM // 2]
    for seq, seed in ((40, 4), (24, 5)):  # the written state's reach (its freqs of one row), then a plain one
        plain = MODULES[kind](DIM, 16, scaling=DYNAMIC)
        with torch.no_grad():
            plain.inv_freq.copy_(grown.inv_freq)
        x = torch.randn(1, 2, seq, DIM, generator=gen(seed))
        want = rule_reference(x, range(seq), dynamic_inv(seq))
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
    held = b.freqs.data_ptr()
    assert torch.equal(b(x), want)
    assert b.freqs.data_ptr() == held  # not rebuilt


def grown_pair_written(kind):
    """Two ranks grown past max_position_embeddings (float64 angles: one-row
    tables, the same shapes, which DDP's broadcast copies): rank 0 to 100
    positions, this one to 60; rank 0's pair written over this one's."""
    r0, r1 = MODULES[kind](DIM, 16, scaling=DYNAMIC), MODULES[kind](DIM, 16, scaling=DYNAMIC)
    r0(torch.randn(1, 1, 100, DIM, generator=gen(8)))
    r1(torch.randn(1, 1, 60, DIM, generator=gen(9)))
    with torch.no_grad():
        r1.freqs.copy_(r0.freqs)
        r1.inv_freq.copy_(r0.inv_freq)
    x = torch.randn(2, 2, 50, DIM, generator=gen(10))
    want = rule_reference(x, range(50), dynamic_inv(60))  # its own history: a dynamic table does not shrink
    assert not torch.allclose(want, rule_reference(x, range(50), dynamic_inv(100)), atol=1e-2)
    return r1, x, want


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_dynamic_rank_keeps_its_own_history_under_a_written_pair(kind):
    """Rank 0's pair was taken for this rank's history: a later call turned by
    rank 0's grown base."""
    r1, x, want = grown_pair_written(kind)
    torch.testing.assert_close(r1(x).double(), want, rtol=0, atol=2e-6)
    assert r1.rope_state == 60


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_written_pair_first_met_under_a_transform_is_not_served(kind):
    """Met first under vmap (its values not read there), the written pair was
    noted as the module's own: that call and every later one turned by it."""
    r1, x, want = grown_pair_written(kind)
    got = torch.func.vmap(lambda t: r1(t[None])[0])(x)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(r1(x).double(), want, rtol=0, atol=2e-6)
    assert r1.rope_state == 60


def test_tables_without_a_version_counter_serve_their_state():
    """Buffers that are inference tensors (a module copied under
    inference_mode; the C++ module's copies are normal tensors) keep no
    version counter and show no write (docs/distributed.md): they are not
    read again at each call (on CUDA a device sync), and the module still
    switches between its states."""
    import copy

    with torch.inference_mode():
        m = copy.deepcopy(rotary.RotaryEmbedding(DIM, 256, scaling=LONGROPE))
        assert m.freqs.is_inference()
        for seq in (8, 100, 8):
            y = torch.randn(1, 2, seq, DIM, generator=gen(seq))
            inv = longrope_inv(LONGROPE["long_factor"] if seq > ORIG else LONGROPE["short_factor"])
            torch.testing.assert_close(m(y).double(), rule_reference(y, range(seq), inv, LONGROPE_SCALE),
                                       rtol=0, atol=2e-6)
        assert m.rope_state == 0


def test_tables_passed_under_a_transform_serve_every_call_alike():
    """Tables that functional_call passes under vmap cannot be read there:
    noted unread at the first call, they were taken for a write at the
    second and rebuilt, so the two calls rotated by other tables."""
    long = rotary.RotaryEmbedding(DIM, 256, scaling=LONGROPE)
    long(torch.randn(1, 1, 100, DIM, generator=gen(11)))
    passed = {name: t.clone() for name, t in long.named_buffers()}
    m = rotary.RotaryEmbedding(DIM, 256, scaling=LONGROPE)
    x = torch.randn(3, 2, 8, DIM, generator=gen(12))
    call = torch.func.vmap(lambda t: torch.func.functional_call(m, passed, (t[None],))[0])
    first, second = call(x), call(x)
    assert torch.equal(first, second)
    # the tables passed, served as the current state (docs/api.md): the long factors
    want = rule_reference(x, range(8), longrope_inv(LONGROPE["long_factor"]), LONGROPE_SCALE)
    torch.testing.assert_close(first.double(), want, rtol=0, atol=2e-6)
    assert m.rope_state == 0


def test_a_write_after_functional_call_keeps_the_modules_own_history():
    """functional_call with tables of another state left the state machine at
    theirs; a write over the module's own pair then kept that state, not the
    module's own (grown to 60), and the next call turned by a base of 50."""
    m = rotary.RotaryEmbedding(DIM, 16, scaling=DYNAMIC)
    m(torch.randn(1, 1, 60, DIM, generator=gen(13)))
    other = rotary.RotaryEmbedding(DIM, 16, scaling=DYNAMIC)
    other(torch.randn(1, 1, 100, DIM, generator=gen(14)))
    passed = {name: t.clone() for name, t in other.named_buffers()}
    torch.func.functional_call(m, passed, (torch.randn(1, 1, 8, DIM, generator=gen(15)),))  # resets theirs to 0
    with torch.no_grad():
        m.freqs.copy_(other.freqs)
        m.inv_freq.copy_(other.inv_freq)
    x = torch.randn(1, 2, 50, DIM, generator=gen(16))
    want = rule_reference(x, range(50), dynamic_inv(60))
    assert not torch.allclose(want, rule_reference(x, range(50), dynamic_inv(50)), atol=1e-2)
    torch.testing.assert_close(m(x).double(), want, rtol=0, atol=2e-6)
    assert m.rope_state == 60
