"""Calls whose values are read on the host, under torch.func transforms that
leave no single value to read (per-sample tables or positions under vmap),
and module calls with positions of a form the module has no meaning for:
each refused by name, never vmap's or the op's error about another API."""

import pytest
import torch
from torch.func import grad, jvp, vmap

import rotary
from rotary_testing.reference import inv_freq, rope_reference, rope_reference_nd
from rotary_testing.rope_testing import assert_close_ref, randn

R, S, N = 8, 3, 4


def _tables(pos):
    inv = torch.tensor([10000.0 ** (-2 * j / R) for j in range(R // 2)], dtype=torch.float64)
    ang = pos[..., None].double() * inv
    return torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()


def test_cos_sin_per_sample_tables_under_vmap_of_grad_are_refused_by_name():
    q, k = randn((N, 1, 2, S, R), seed=1), randn((1, 1, S, R), seed=2)
    pos = torch.randint(0, 50, (N, 1, S), generator=torch.Generator().manual_seed(3))
    cos, sin = _tables(pos)
    cache = torch.cat([t[:, : R // 2] for t in _tables(torch.arange(50))], -1)

    def loss(a, c, s):
        return rotary.apply_rope_cos_sin(a, k, c, s)[0].sum()

    shared = vmap(grad(loss), in_dims=(0, None, None))(q, cos[0], sin[0])  # served: one table for all
    ones = torch.ones(q.shape[1:])  # d(sum)/dq: the inverse rotation of ones, per sample
    for i in range(N):
        assert_close_ref(shared[i], rope_reference(ones, 0, False, pos[0], inverse=True), torch.float32)
    why = r"differ per sample under torch.func.vmap of grad or jvp, where their values cannot be checked"
    with pytest.raises(ValueError, match=r"apply_rope_cos_sin: cos and sin " + why):
        vmap(grad(loss))(q, cos, sin)
    with pytest.raises(ValueError, match=r"apply_rope_cos_sin: position_ids " + why):
        vmap(grad(lambda a, p: rotary.apply_rope_cos_sin(a, k, cache, None, position_ids=p)[0].sum()))(q, pos)
    with pytest.raises(ValueError, match=r"apply_rope_cos_sin: cos and sin " + why):
        vmap(lambda a, c, s: jvp(lambda t: rotary.apply_rope_cos_sin(t, k, c, s)[0], (a,), (a,)))(q, cos, sin)
    # vmap alone runs one call per slice, each with its own positions.
    out = vmap(lambda a, c, s: rotary.apply_rope_cos_sin(a, k, c, s)[0])(q, cos, sin)
    for i in range(N):
        assert_close_ref(out[i], rope_reference(q[i], 0, False, pos[i]), torch.float32)


@pytest.mark.parametrize("mrope", [None, [2, 1, 1]])
def test_host_driven_module_refuses_per_sample_positions_under_vmap(mrope):
    sc = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 32}
    kw = dict(mrope_section=mrope) if mrope else {}
    rope = rotary.RotaryEmbedding(R, 32, interleaved=False, scaling=sc, **kw)
    q = randn((N, 1, 2, 4, R), seed=4)
    shape = (N, 3, 1, 4) if mrope else (N, 1, 4)
    ids = torch.randint(0, 60, shape, generator=torch.Generator().manual_seed(5))
    shared = vmap(lambda a: rope(a, position_ids=ids[0]))(q)  # one largest position: served
    seen = int(ids[0].max()) + 1  # dynamic NTK: the base grows with the largest position seen
    base = 10000.0 * max(1.0, 2.0 * seen / 32 - 1.0) ** (R / (R - 2))
    axes = [0, 0, 1, 2] if mrope else [0] * (R // 2)
    pos = ids[0].numpy() if mrope else ids[0].numpy()[None]
    for i in range(N):
        ref = rope_reference_nd(q[i], pos, axes, R, interleaved=False, inv=inv_freq(R, base))
        assert_close_ref(shared[i], ref, torch.float32)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: a host-driven rule \(dynamic, longrope\) sizes its "
                                         r"table by the call's largest position.*per-sample position_ids"):
        vmap(lambda a, p: rope(a, position_ids=p))(q, ids)


@pytest.mark.parametrize("module", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_a_one_axis_module_names_n_d_positions(module):
    """[n_axes, batch, seq] ids to a module with no pair -> axis map: the
    module's words (the op's hint, pass pair_axes, is not a module argument)."""
    q = randn((2, 2, 5, R), seed=6)
    ids = torch.randint(0, 64, (3, 2, 5), generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(dim=8\): position_ids of shape \[3, 2, 5\] are N-D "
                                         r"positions \[n_axes, batch, seq\].*mrope_section=.*axes_dim="):
        module(R, 64)(q, position_ids=ids)
