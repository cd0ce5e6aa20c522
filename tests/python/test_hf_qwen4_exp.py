"""Qwen4-Exp against transformers' own rotary code: Qwen3.5's M-RoPE
((11, 11, 10) interleaved) over the whole position history, whose pair the
attention and the sparse-attention indexer index (cos[:, -n:, :] for the
current tokens, cos[b].index_select(0, block_starts) for one sequence's
blocks) and whose indexer rotates q alone. The patched handle stands for
that [batch, tokens, dim] pair: those forms give the positions they pick,
every other indexing raises. The same tolerance as test_hf_config.py; the
sweep checks the whole model (hf_sweep)."""

import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config
from rotary.integrations._rope_state import _RopeState
from rotary.integrations.transformers import RotaryPositions
from test_hf_config import ATOL, gen, make_config, modeling, randn

pytestmark = pytest.mark.filterwarnings("ignore")
B, T, H, D = 2, 9, 3, 64
CONFIG = dict(hidden_size=64, num_attention_heads=H, num_key_value_heads=1, head_dim=D, num_hidden_layers=1,
              vocab_size=32, max_position_embeddings=128)
# The families tested here (test_hf_config.test_every_family_is_tested reads it).
TESTED = {"qwen4_exp_text"}


def grid_positions(seed):
    """[3, B, T] t / h / w positions that differ, as an image's do."""
    t = torch.randint(0, 60, (B, T), generator=gen(seed))
    return torch.stack([t, t + torch.randint(0, 3, (B, T), generator=gen(seed + 1)),
                        t + torch.randint(0, 3, (B, T), generator=gen(seed + 2))])


def setup(seed=0):
    cfg = make_config("Qwen4ExpTextConfig", **CONFIG)
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    hf_rope = modeling("qwen4_exp").Qwen4ExpTextRotaryEmbedding(cfg)
    pos = grid_positions(seed)
    return cfg, rope, hf_rope, pos, RotaryPositions(pos, _RopeState(rope))


def test_matches_transformers():
    cfg, rope, hf_rope, pos, _ = setup()
    assert (rope.dim, rope.interleaved, rope.pair_axes is not None) == (D, False, True)
    q, k = randn((B, H, T, D), seed=1), randn((B, 1, T, D), seed=2)
    cos, sin = hf_rope(q, pos)
    want = modeling("qwen4_exp").apply_rotary_pos_emb(q, k, cos, sin)
    for g, w in zip(rope(q, k, position_ids=pos), want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert rope_kwargs_from_hf_config(cfg.to_dict()) == rope_kwargs_from_hf_config(cfg)


def test_indexed_pair_rotates_as_transformers():
    """The handle indexed as Qwen4-Exp indexes its pair rotates what
    transformers' indexed cos / sin rotate: the last n tokens (q alone, BSHD),
    and one sequence's chosen tokens ([tokens, 1, dim])."""
    cfg, _, hf_rope, pos, h = setup(3)
    m = modeling("qwen4_exp")
    cos, sin = hf_rope(randn((1,), 0), pos)
    n = 4
    q = randn((B, n, H, D), seed=4)  # [batch, tokens, heads, dim], as the indexer's q
    want = m.apply_rotary_pos_emb(q, cos=cos[:, -n:, :], sin=sin[:, -n:, :], unsqueeze_dim=2)
    got = h[:, -n:, :].apply_one(q, 2, sin=h[:, -n:, :])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(h[:, -n:].apply_one(q, 2, sin=h[:, -n:]), got, atol=0, rtol=0)
    starts = torch.tensor([0, 2, 6])
    keys = randn((3, 1, D), seed=5)  # one sequence's pooled block keys, unsqueezed at 1
    for b in range(B):
        want = m.apply_rotary_pos_emb(keys, cos=cos[b].index_select(0, starts), sin=sin[b].index_select(0, starts))
        got = h[b].index_select(0, starts).apply_one(keys, 1, sin=h[b].index_select(0, starts))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_other_indexing_raises():
    _, _, _, pos, h = setup(6)
    for index in (0.5, (slice(None), 2), (slice(None), slice(0, 4, 2)), (0, slice(None)), (Ellipsis, slice(0, 8)),
                  torch.tensor([0]), (slice(None), slice(-2, None), slice(0, 4))):
        with pytest.raises(TypeError, match=r"cannot be indexed by"):
            h[index]
    with pytest.raises(TypeError, match=r"cannot be indexed by"):
        h[0][1]
    with pytest.raises(TypeError, match=r"only index_select\(0, tokens\) of one sequence's pair"):
        h.index_select(0, torch.tensor([0]))
    with pytest.raises(TypeError, match=r"only index_select\(0, tokens\) of one sequence's pair"):
        h[0].index_select(1, torch.tensor([0]))
    x = randn((3, 1, D), seed=7)
    rows = h[0].index_select(0, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"rotates \[tokens, heads, head_dim\] with unsqueeze_dim=1, got shape "
                                         r"\(1, 3, 1, 64\) and unsqueeze_dim=1"):
        rows.apply_one(x.unsqueeze(0), 1, sin=rows)
    with pytest.raises(ValueError, match=r"cos\[b\], rotates one tensor at a time"):
        rows.apply(x, x, 1, sin=rows)


def test_pairs_must_be_indexed_alike():
    """cos and sin indexed differently (other tokens, another sequence, other
    block starts) are no pair: refused, never a rotation by the wrong one."""
    _, _, _, _, h = setup(8)
    x = randn((B, 4, H, D), seed=9)
    starts = torch.tensor([0, 2])
    y = randn((2, 1, D), seed=10)
    for cos, sin, t in ((h[:, -4:], h[:, -5:-1], x), (h[:, -4:], h, x),
                        (h[0].index_select(0, starts), h[1].index_select(0, starts), y),
                        (h[0].index_select(0, starts), h[0].index_select(0, starts.clone()), y)):
        with pytest.raises(TypeError, match=r"takes the \(cos, sin\) pair of one patched rotary embedding call"):
            cos.apply_one(t, 2 if t is x else 1, sin=sin)


def test_any_indexing_is_exact_or_refused():
    """Each index expression either raises or gives the rotation of the real
    pair indexed the same way: never a rotation at other positions."""
    cfg, _, hf_rope, pos, h = setup(11)
    m = modeling("qwen4_exp")
    cos, sin = hf_rope(randn((1,), 0), pos)
    exprs = [(slice(None), slice(-3, None)), (slice(None), slice(2, 5), slice(None)), (slice(None), slice(None)),
             (slice(None), slice(0, 0)), (slice(None), slice(-3, None, 2)), (slice(None), slice(1, 4), slice(0, 8)),
             (Ellipsis, slice(0, D)), (Ellipsis, slice(0, 8)), 1, -1, -2, (0,), (slice(0, 1), slice(2, 5)),
             (slice(None), 3), (1, slice(2, 5)), [0, 1], True]
    for index in exprs:
        try:
            hc, hs = h[index], h[index]
        except TypeError:
            continue
        c, s = cos[index], sin[index]
        if c.dim() == 3:  # [batch, tokens, dim]: q as the indexer's, [batch, tokens, heads, dim]
            x = randn((B, c.shape[1], H, D), seed=12)
            want = m.apply_rotary_pos_emb(x, cos=c, sin=s, unsqueeze_dim=2)
            got = hc.apply_one(x, 2, sin=hs)
        else:  # one sequence, [tokens, dim]: keys [tokens, 1, dim]
            x = randn((c.shape[0], 1, D), seed=13)
            want = m.apply_rotary_pos_emb(x, cos=c, sin=s)
            got = hc.apply_one(x, 1, sin=hs)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda e, i=index: f"{i!r}: {e}")
