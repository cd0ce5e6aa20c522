"""DTensor calls that must act as the plain call does, on every rank alike
(2 gloo ranks, CPU, one spawn through test_distributed.py's machinery):

* a value the plain call refuses (start_pos + seq past the table, an id past
  it or negative, in another rank's tokens) is refused in its words on every
  rank before any rank writes;
* a one-token sequence shard (an empty shard) with [seq] ids, and size-1
  ids that broadcast;
* apply_rope_qk (and the prologue) whose two gradients arrive placed
  differently in the backward pass;
* apply_rope_cos_sin with its tables as DTensors;
* N-D positions (pair_axes, M-RoPE) under every placement.

Results are compared with the float64 references of rotary_testing, never
with rotary's own output. Shards are cut with no communication (a rank that
fails a check cannot leave the other waiting in a collective)."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import rotary
from rotary_testing.dist_scenarios import dshard, local_part, reference
from rotary_testing.prologue_reference import ref_norm_rope
from rotary_testing.reference import hf_cos_sin, rope_reference, rope_reference_nd
from test_distributed import assert_scenario

D, L = 16, 64
OPS = torch.ops.rotary

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _d(t, mesh, placement):
    """The DTensor of global t placed as given (on its own copy), cut locally."""
    return dshard(t, mesh, [placement])[0]


def _close(got, want, msg):
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5, msg=msg)


def values_refused_alike(mesh):
    """Every rank raises the plain call's error, and no rank writes."""
    f = rotary.freqs_table(D, L)
    q, k = _rand(2, 2, 6, D, seed=1), _rand(2, 1, 6, D, seed=2)
    past = torch.arange(6).expand(2, 6).clone()
    past[1, 5] = L  # token 5: in the last rank's half of the sequence
    neg = torch.arange(6).expand(2, 6).clone()
    neg[0, 4] = -1
    ids_rep = _d(past, mesh, Replicate())
    cases = [  # (what, placement, op, kwargs)
        ("start_pos past the table, sequence shards", Shard(2), OPS.apply_rope_qk_, dict(start_pos=60)),
        ("start_pos past the table, one tensor", Shard(2), OPS.apply_rope_, dict(start_pos=60)),
        ("start_pos past the table, prologue", Shard(2), OPS.apply_qk_norm_rope_, dict(start_pos=60)),
        ("an id past the table", Shard(2), OPS.apply_rope_qk_, dict(position_ids=past)),
        ("an id past the table, replicated DTensor", Shard(2), OPS.apply_rope_qk_, dict(position_ids=ids_rep)),
        ("a negative id", Shard(2), OPS.apply_rope_qk_, dict(position_ids=neg)),
        ("[B] offsets past the table in the last batch row", Shard(0), OPS.apply_rope_qk_,
         dict(offsets=torch.tensor([0, 59]))),
    ]
    for what, placement, op, kw in cases:
        tensors = (q,) if op is OPS.apply_rope_ else (q, k)
        plain_kw = {n: past if v is ids_rep else v for n, v in kw.items()}
        with pytest.raises((IndexError, ValueError)) as plain:
            op(*(t.clone() for t in tensors), f, **plain_kw)
        shards = [_d(t, mesh, placement) for t in tensors]
        before = [s.to_local().clone() for s in shards]
        with pytest.raises(type(plain.value), match=re.escape(str(plain.value))):
            op(*shards, f, **kw)
        assert all(torch.equal(s.to_local(), b) for s, b in zip(shards, before)), f"{what}: a shard was written"
    # With inv_freq the positions past the table are computed: served, not refused.
    inv = rotary.inv_frequencies(D)[0]
    dq, dk = (_d(t, mesh, Shard(2)) for t in (q, k))
    OPS.apply_rope_qk_(dq, dk, f, 60, inv_freq=inv)
    for t, d in ((q, dq), (k, dk)):
        _close(d.to_local(), local_part(rope_reference(t, 60), mesh, [Shard(2)]), "inv_freq past the table")


def size_one_ids_on_sequence_shards(mesh):
    """Decode under context parallel: one token, so the last rank's shard is
    empty; [seq] ids are cut to it (they do not broadcast). [batch, 1] ids
    do broadcast (every token at one position), on any shard."""
    f = rotary.freqs_table(D, L)
    for S, ids, whole in (
            (1, torch.tensor([7]), torch.tensor([7])),
            (1, torch.tensor([[7], [3]]), torch.tensor([[7], [3]])),
            (1, _d(torch.tensor([7]), mesh, Shard(0)), torch.tensor([7])),
            (3, torch.tensor([[7], [3]]), torch.tensor([[7], [3]])),
            (3, torch.tensor([[5]]), torch.tensor([[5]]))):
        q, k = _rand(2, 2, S, D, seed=3), _rand(2, 1, S, D, seed=4)
        want = [rope_reference(t, positions=whole.expand(2, S)) for t in (q, k)]
        dq, dk = (_d(t, mesh, Shard(2)) for t in (q, k))
        oq, ok = rotary.apply_rope_qk(dq, dk, f, position_ids=ids)
        OPS.apply_rope_(dq, f, position_ids=ids)
        for got, w in ((oq, want[0]), (ok, want[1]), (dq, want[0])):
            assert tuple(got.placements) == (Shard(2),)
            _close(got.to_local(), local_part(w, mesh, [Shard(2)]), f"S={S}, ids {tuple(whole.shape)}")


def gradients_placed_unlike(mesh):
    """The backward pass gets q's gradient Replicate and k's sharded (as from
    loss = oq.sum() + ok.square().sum()): it rotates each under its own
    placement. The gradients are fed directly (no collective)."""
    f = rotary.freqs_table(D, L)
    q, k = _rand(2, 4, 6, D, seed=5), _rand(2, 2, 6, D, seed=6)
    gq, gk = _rand(*q.shape, seed=7), _rand(*k.shape, seed=8)
    w = 1.0 + 0.5 * _rand(D, seed=9)
    q64, k64 = (t.double().requires_grad_() for t in (q, k))
    torch.autograd.backward([ref_norm_rope(q64, w.double(), 3), ref_norm_rope(k64, w.double(), 3)],
                            [gq.double(), gk.double()])
    for pl in (Shard(2), Shard(1)):
        for prologue in (False, True):
            (dq, lq), (dk, lk) = (dshard(t, mesh, [pl], requires_grad=True) for t in (q, k))
            if prologue:  # its backward rotates the gradients by apply_rope_qk too
                dw = _d(w, mesh, Replicate())
                oq, ok = rotary.apply_qk_norm_rope(dq, dk, f, 3, q_weight=dw, k_weight=dw)
                want = (q64.grad, k64.grad)
            else:
                oq, ok = rotary.apply_rope_qk(dq, dk, f, 3)
                want = (rope_reference(gq, 3, inverse=True), rope_reference(gk, 3, inverse=True))
            torch.autograd.backward([oq, ok], [_d(gq, mesh, Replicate()), _d(gk, mesh, pl)])
            for leaf, w_, n in ((lq, want[0], "q"), (lk, want[1], "k")):
                torch.testing.assert_close(leaf.grad.double(), local_part(w_, mesh, [pl]), rtol=1e-4, atol=1e-5,
                                           msg=f"{pl}, prologue={prologue}: {n}.grad")
    # Out of place, forward: each placed its own way.
    dq, dk = _d(q, mesh, Shard(2)), _d(k, mesh, Replicate())
    oq, ok = rotary.apply_rope_qk(dq, dk, f, 3)
    assert tuple(oq.placements) == (Shard(2),) and tuple(ok.placements) == (Replicate(),)
    _close(oq.to_local(), local_part(rope_reference(q, 3), mesh, [Shard(2)]), "q placed Shard(2)")
    _close(ok.to_local(), rope_reference(k, 3), "k placed Replicate")
    # Rotated alone, a refusal still names the tensor; the prologue has no single-tensor form.
    ids = _d(torch.arange(6).expand(2, 6).contiguous(), mesh, Shard(1))
    with pytest.raises(ValueError, match=r"apply_rope_qk on DTensor: k, placed \(Replicate\(\)\) unlike the other, "
                                         r"is rotated alone \(as x\): position_ids has placements \(Shard\(dim=1\)\)"):
        rotary.apply_rope_qk(dq, dk, f, position_ids=ids)
    with pytest.raises(ValueError, match=r"sharded alike .*: the prologue normalizes and rotates them in one call"):
        rotary.apply_qk_norm_rope(dq, dk, f, 3)
    # In place, refused before anything is written: one at a time, q could be written and k refused.
    dk = _d(k, mesh, Shard(1))
    before = (dq.to_local().clone(), dk.to_local().clone())
    with pytest.raises(ValueError, match=r"q has placements \(Shard\(dim=2\)\) but k has \(Shard\(dim=1\)\); q and k "
                                         r"must be sharded alike .*: in place, both are written in one call"):
        OPS.apply_rope_qk_(dq, dk, f, 3)
    assert torch.equal(dq.to_local(), before[0]) and torch.equal(dk.to_local(), before[1])


def cos_sin_tables_as_dtensors(mesh):
    """Replicated tables are read whole; other placements are refused by name."""
    q, k = _rand(2, 2, 4, D, seed=8), _rand(2, 2, 4, D, seed=9)
    cos, sin = (t.float()[None] for t in hf_cos_sin(4, D))  # [1, S, D] rotate_half tables
    c8, s8 = hf_cos_sin(8, D)
    cache = torch.cat([c8[:, :D // 2], s8[:, :D // 2]], -1).float()  # [max_pos, D]: cos then sin
    ids = torch.tensor([[5, 1, 7, 2], [0, 6, 3, 3]])

    def rep(t):
        return _d(t, mesh, Replicate())

    for pl in (Shard(1), Shard(2), Replicate()):
        dq, dk = (_d(t, mesh, pl) for t in (q, k))
        for what, (tables, kw, pos) in {
            "HF cos/sin": ((rep(cos), rep(sin)), {}, None),
            "cos_sin_cache": ((rep(cache), None), {"position_ids": ids}, ids),
            "cos_sin_cache, replicated ids": ((rep(cache), None), {"position_ids": rep(ids)}, ids),
        }.items():
            for inference in (False, True):  # inference mode: the composite reaches DTensor's dispatch itself
                with torch.inference_mode(inference):
                    oq, ok = rotary.apply_rope_cos_sin(dq, dk, *tables, **kw)
                for o, t in ((oq, q), (ok, k)):
                    assert tuple(o.placements) == (pl,), what
                    _close(o.to_local(), local_part(rope_reference(t, 0, False, pos), mesh, [pl]),
                           f"{what}, {pl}, inference_mode={inference}")
    dq, dk = (_d(t, mesh, Shard(1)) for t in (q, k))
    for pattern, call in (
        (r"apply_rope_cos_sin on DTensor: cos has placements \(Shard\(dim=1\)\); every rank needs all of it",
         lambda: rotary.apply_rope_cos_sin(dq, dk, _d(cos, mesh, Shard(1)), rep(sin))),
        (r"sin has placements \(Shard\(dim=2\)\)",
         lambda: rotary.apply_rope_cos_sin(dq, dk, rep(cos), _d(sin, mesh, Shard(2)))),
        (r"position_ids has placements \(Shard\(dim=1\)\)",
         lambda: rotary.apply_rope_cos_sin(dq, dk, cache, None, position_ids=_d(ids, mesh, Shard(1)))),
        (r"cos is a DTensor but q and k are plain tensors; pass cos.to_local\(\)",
         lambda: rotary.apply_rope_cos_sin(q, k, rep(cos), rep(sin))),
    ):
        with pytest.raises(ValueError, match=pattern):
            call()


def nd_positions_sharded(mesh):
    """pair_axes under tensor, data and context parallel: heads are
    independent, [n_axes, batch, seq] ids are cut like any ids."""
    f = rotary.freqs_table(D, L)
    axes = [0, 0, 0, 0, 1, 1, 2, 2]
    q, k = _rand(2, 4, 6, D, seed=10), _rand(2, 2, 6, D, seed=11)
    g = torch.Generator().manual_seed(12)
    ids3, ids2 = torch.randint(0, L, (3, 2, 6), generator=g), torch.randint(0, L, (3, 6), generator=g)
    for pl in (Shard(1), Shard(0), Shard(2), Replicate()):
        sharded_ids = {Shard(0): Shard(1), Shard(2): Shard(2)}.get(pl)  # [n_axes, B, S] cut like q
        for ids, whole in [(ids3, ids3), (ids2, ids2)] + ([(_d(ids3, mesh, sharded_ids), ids3)] if sharded_ids else []):
            pos = (whole if whole.dim() == 3 else whole[:, None].expand(3, 2, 6)).numpy()
            dq, dk = (_d(t.clone(), mesh, pl) for t in (q, k))  # Replicate: q's own storage
            oq, ok = rotary.apply_rope_qk(dq, dk, f, position_ids=ids, pair_axes=axes)
            OPS.apply_rope_qk_(dq, dk, f, position_ids=ids, pair_axes=axes)
            tag = f"{pl}, ids {tuple(whole.shape)}{' sharded' if isinstance(ids, DTensor) else ''}"
            for got in ((oq, ok), (dq, dk)):
                for o, t in zip(got, (q, k)):
                    assert tuple(o.placements) == (pl,), tag
                    _close(o.to_local(), local_part(rope_reference_nd(t, pos, axes, D), mesh, [pl]), tag)
    # A position past the table in another rank's tokens: refused alike, nothing written.
    past = ids3.clone()
    past[2, 1, 5] = L
    dq, dk = (_d(t, mesh, Shard(2)) for t in (q, k))
    with pytest.raises(IndexError) as plain:
        OPS.apply_rope_qk_(q.clone(), k.clone(), f, position_ids=past, pair_axes=axes)
    before = dq.to_local().clone()
    with pytest.raises(IndexError, match=re.escape(str(plain.value))):
        OPS.apply_rope_qk_(dq, dk, f, position_ids=past, pair_axes=axes)
    assert torch.equal(dq.to_local(), before)
    # The M-RoPE module (Qwen2-VL's mrope_section) under tensor parallel.
    m = rotary.RotaryEmbedding(D, L, mrope_section=[4, 2, 2])
    dq, dk = (_d(t, mesh, Shard(1)) for t in (q, k))
    oq, ok = m(dq, dk, position_ids=ids3)
    for o, t in ((oq, q), (ok, k)):
        _close(o.to_local(), local_part(rope_reference_nd(t, ids3.numpy(), axes, D), mesh, [Shard(1)]), "module")


def uneven_shards_give_every_rank_one_spec(mesh):
    """A shard of size 1 on the cut dim (3 tokens or 3 kv heads on 2 ranks)
    ties its stride with a neighbour's: the output's global strides were
    built in another dim order on that rank, so the ranks' specs differed and
    the next collective (a backward's all-gather) waited for ever. Every
    rank's output now has the input's global strides (no collective here)."""
    f = rotary.freqs_table(D, L)
    for layout, seq, heads in (("BHSD", 2, 1), ("BSHD", 1, 2), ("SBHD", 0, 2)):
        for cut, name in ((seq, "3 tokens"), (heads, "3 kv heads")):
            shape = {"BHSD": (2, 3, 3, D), "BSHD": (2, 3, 3, D), "SBHD": (3, 1, 3, D)}[layout]
            q, k = _rand(*shape, seed=11), _rand(*shape, seed=12)
            dq, dk = (_d(t, mesh, Shard(cut)) for t in (q, k))
            outs = (rotary.apply_rope(dq, f, layout=layout),) + rotary.apply_rope_qk(dq, dk, f, layout=layout)
            for out in outs:
                assert out.stride() == q.stride(), f"{layout}, {name}: global strides {out.stride()}"
            want = reference(q, layout, 0, True, None)
            _close(outs[0].to_local(), local_part(want, mesh, [Shard(cut)]), f"{layout}, {name}")


def offsets_cut_like_the_batch_under_context_parallel(mesh):
    """DP x CP (a 1 x 2 mesh): [B] offsets cut like the batch, the sequence
    split over the ranks. start_pos + offsets + the global sequence past the
    table was checked only for each rank's own tokens: the rank holding the
    first half wrote, the other refused. Both refuse now, nothing written."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
    f = rotary.freqs_table(D, L)
    x = _rand(1, 4, 6, D, seed=13)
    d = dshard(x, grid, [Shard(0), Shard(2)])[0]
    offsets = dshard(torch.tensor([0]), grid, [Shard(0), Replicate()])[0]
    with pytest.raises(IndexError) as plain:
        OPS.apply_rope_(x.clone(), f, 60, offsets=torch.tensor([0]))
    before = d.to_local().clone()
    with pytest.raises(IndexError, match=re.escape(str(plain.value))):
        OPS.apply_rope_(d, f, 60, offsets=offsets)
    assert torch.equal(d.to_local(), before), "a shard was written"
    served = dshard(torch.tensor([-10]), grid, [Shard(0), Replicate()])[0]  # positions 50..55: served
    OPS.apply_rope_(d, f, 60, offsets=served)
    _close(d.to_local(), local_part(rope_reference(x, 50), grid, [Shard(0), Shard(2)]), "offsets -10")
    # DP over the ranks (a 2 x 1 mesh): each rank checks its own row, over the whole sequence.
    rows = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp2", "cp2"))
    x2 = _rand(2, 4, 6, D, seed=14)
    d2 = dshard(x2, rows, [Shard(0), Shard(2)])[0]
    starts = torch.tensor([3, 59])  # row 1 reaches position 64, past the table
    mine = dshard(starts, rows, [Shard(0), Replicate()])[0]
    if dist.get_rank() == 1:
        before = d2.to_local().clone()
        with pytest.raises(IndexError, match=r"has position 64"):
            OPS.apply_rope_(d2, f, 0, offsets=mine)
        assert torch.equal(d2.to_local(), before)
    else:  # its row is served (a sharded position is each rank's own: docs/distributed.md)
        OPS.apply_rope_(d2, f, 0, offsets=mine)
        _close(d2.to_local(), rope_reference(x2[:1], 3), "row 0 at offset 3")


_SCENARIOS = [values_refused_alike, size_one_ids_on_sequence_shards, gradients_placed_unlike,
              cos_sin_tables_as_dtensors, nd_positions_sharded, uneven_shards_give_every_rank_one_spec,
              offsets_cut_like_the_batch_under_context_parallel]


def scenarios(world):
    return [(fn.__name__, fn) for fn in _SCENARIOS]


@pytest.mark.parametrize("name", [fn.__name__ for fn in _SCENARIOS])
def test_dtensor_consistency(name, tmp_path_factory):
    assert_scenario(2, name, tmp_path_factory, source=__name__)
