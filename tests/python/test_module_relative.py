"""rotary.RotaryEmbedding and rotary.CppRotaryEmbedding: the relative-position
property (q . k depends on the offset only; attention is shift invariant),
with the seeds' controls (additive sinusoidal encoding, mixed pairings).
Split from test_module.py (construction, forward, casts, state_dict)."""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_half_vec, rope_vec, sinusoidal_pe
from rotary_testing.rope_testing import PAIRING_IDS, PAIRINGS, make_heads
from test_module import MODULES, make_module


# ---------------------------------------------------------------------------
# The relative-position property (seeds 000 and 004)
# ---------------------------------------------------------------------------
D_REL = 8
STARTS = [2, 5, 9, 14, 20, 100, 777, 2048, 4000]


def _vecs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(D_REL, generator=g, dtype=torch.float64)
    k = torch.randn(D_REL, generator=g, dtype=torch.float64)
    return q, k


def _score(m, q, k, pos_q, pos_k):
    """q . k after rotating q at pos_q and k at pos_k with module m."""
    qr = m(q.view(1, 1, 1, -1), start_pos=pos_q)
    kr = m(k.view(1, 1, 1, -1), start_pos=pos_k)
    return float((qr * kr).sum())


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_relative_position_property(kind, interleaved):
    m = make_module(kind, D_REL, 4096, 10000.0, interleaved)
    q, k = _vecs(7)
    vec = rope_vec if interleaved else rope_half_vec
    for offset in (0, 2, 3, 17):
        scores = [_score(m, q, k, p, p - offset) for p in STARTS if p >= offset]
        spread = max(scores) - min(scores)
        assert spread < 1e-5, f"offset {offset}: RoPE score moved by {spread} with absolute position"
        # ... and equals the exact score of q at `offset`, k at 0 (seed formula)
        exact = float(vec(q.numpy(), offset) @ vec(k.numpy(), 0))
        assert abs(scores[0] - exact) < 1e-5
    # The score is a real function of the offset, not a constant.
    by_offset = [_score(m, q, k, 12, 12 - off) for off in (0, 1, 3, 6)]
    assert max(by_offset) - min(by_offset) > 1e-3


def test_sinusoidal_add_leaks_absolute_position():
    """Control from the seeds: the 2017 additive encoding is not relative."""
    q, k = (t.numpy() for t in _vecs(7))
    scores = [(q + sinusoidal_pe(p, D_REL)) @ (k + sinusoidal_pe(p - 2, D_REL)) for p in STARTS]
    assert max(scores) - min(scores) > 1e-3


def test_mixed_pairings_scramble():
    """Interleaved q with half-split k loses the relative property (seed demo 6)."""
    inter = rotary.RotaryEmbedding(D_REL, 4096, interleaved=True)
    half = rotary.RotaryEmbedding(D_REL, 4096, interleaved=False)
    q, k = _vecs(3)
    scores = []
    for p in STARTS:
        qr = inter(q.view(1, 1, 1, -1), start_pos=p)
        kr = half(k.view(1, 1, 1, -1), start_pos=p - 2)
        scores.append(float((qr * kr).sum()))
    assert max(scores) - min(scores) > 1e-3


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_attention_is_shift_invariant(interleaved):
    """Same 6 tokens at positions 0..5 and 1000..1005: identical attention
    weights (seed demo 4), using the one-call q/k form."""
    m = rotary.RotaryEmbedding(32, 2048, interleaved=interleaved)
    q = make_heads(1, 4, 6, 32, torch.float64, seed=64)
    k = make_heads(1, 4, 6, 32, torch.float64, seed=65)

    def weights(start):
        qr, kr = m(q, k, start_pos=start)
        return torch.softmax(qr @ kr.transpose(-1, -2) / 32**0.5, dim=-1)

    w0, w1 = weights(0), weights(1000)
    torch.testing.assert_close(w0, w1, rtol=1e-5, atol=1e-6)
    plain = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1)
    assert (w0 - plain).abs().max() > 1e-3  # and position did matter


def test_attention_relative_with_position_ids():
    """Per-row position ids: each row shifted by a different amount gives
    the same q.k scores as the unshifted row."""
    m = rotary.RotaryEmbedding(16, 512)
    row_q = make_heads(1, 2, 5, 16, torch.float64, seed=66)
    row_k = make_heads(1, 2, 5, 16, torch.float64, seed=67)
    q, k = row_q.expand(3, 2, 5, 16), row_k.expand(3, 2, 5, 16)
    ids = torch.arange(5) + torch.tensor([[0], [37], [400]])
    qr, kr = m(q, k, position_ids=ids)
    scores = qr @ kr.transpose(-1, -2)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[2], scores[0], rtol=1e-5, atol=1e-5)
