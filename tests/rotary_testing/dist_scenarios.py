"""Scenarios for test_distributed.py, run inside every rank of a gloo group
(CPU) on a 1-D mesh of all ranks. Each raises on a mismatch. Inputs are
random and built identically on every rank (same seed); shards are cut from
them with no communication, so a failing scenario cannot hang the others."""

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.debug import CommDebugMode

import rotary
from rotary_testing.reference import rope_reference

OPS = torch.ops.rotary
_ARGS = {a.name for a in OPS.apply_rope_qk.default._schema.arguments}
OFFSETS = "offsets" if "offsets" in _ARGS else "positions"  # [] / [batch]
IDS = "position_ids" if "position_ids" in _ARGS else "positions"  # [batch, seq]
HEADS_DIM = {"BHSD": 1, "BSHD": 2, "SBHD": 2}
SEQ_DIM = {"BHSD": 2, "BSHD": 1, "SBHD": 0}
D, L = 16, 64


def local_part(t, mesh, placements):
    shape, off = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    for d, (o, n) in enumerate(zip(off, shape)):
        t = t.narrow(d, o, n)
    return t


def dshard(t, mesh, placements, requires_grad=False):
    """(DTensor, its local leaf) of the global ``t`` placed as given."""
    local = local_part(t, mesh, placements).detach().clone().requires_grad_(requires_grad)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    return dt, local


def _to_bhsd(t, layout):
    return {"BHSD": t, "BSHD": t.transpose(1, 2), "SBHD": t.permute(1, 2, 0, 3)}[layout]


def _from_bhsd(t, layout):
    return {"BHSD": t, "BSHD": t.transpose(1, 2), "SBHD": t.permute(2, 0, 1, 3)}[layout]


def reference(t, layout, start_pos, interleaved, positions, inverse=False):
    out = rope_reference(_to_bhsd(t, layout), start_pos, interleaved, positions, inverse)
    return _from_bhsd(out, layout)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_case(mesh, op, data, placements, *, start_pos, interleaved, layout, ref_pos, full_kw, dist_kw, tag,
             freqs=None):
    """Sharded call (and its backward) vs the unsharded call, bit for bit, and
    vs the float64 reference; no collective inside the op either way."""
    f = rotary.rope_freqs(D, L) if freqs is None else freqs
    f_plain = f.full_tensor() if isinstance(f, DTensor) else f
    grads = [_rand(*t.shape, seed=77 + i) for i, t in enumerate(data)]
    leaves = [t.detach().clone().requires_grad_() for t in data]
    full = op(*leaves, f_plain, start_pos, interleaved, layout=layout, **full_kw)
    full = full if isinstance(full, tuple) else (full,)
    sum((o * g).sum() for o, g in zip(full, grads)).backward()

    shards = [dshard(t, mesh, placements, requires_grad=True) for t in data]
    with CommDebugMode() as comm:
        out = op(*[s for s, _ in shards], f, start_pos, interleaved, layout=layout, **dist_kw)
        out = out if isinstance(out, tuple) else (out,)
        sum((o.to_local() * local_part(g, mesh, placements)).sum() for o, g in zip(out, grads)).backward()
    assert comm.get_total_counts() == 0, f"{tag}: collectives inside the rotary op: {comm.get_comm_counts()}"
    for i, (o, (_, leaf)) in enumerate(zip(out, shards)):
        t = f"{tag}, output {i}"
        assert isinstance(o, DTensor) and tuple(o.placements) == tuple(placements), f"{t}: placements {o}"
        assert o.shape == data[i].shape, t
        got = o.to_local()
        assert torch.equal(got, local_part(full[i].detach(), mesh, placements)), f"{t}: differs from one process"
        ref = local_part(reference(data[i], layout, start_pos, interleaved, ref_pos), mesh, placements)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0, msg=f"{t}: vs float64 reference")
        assert torch.equal(leaf.grad, local_part(leaves[i].grad, mesh, placements)), f"{t}: grad differs"
        ref_g = local_part(reference(grads[i], layout, start_pos, interleaved, ref_pos, True), mesh, placements)
        torch.testing.assert_close(leaf.grad.double(), ref_g, atol=1e-5, rtol=0, msg=f"{t}: grad vs reference")
    return shards


# ----------------------------------------------------------------------------
# Op scenarios


def tp_heads(mesh):
    W = mesh.size()
    for layout in ("BHSD", "BSHD", "SBHD"):
        for interleaved in (True, False):
            B, Hq, Hk, S = 2, 2 * W, W, 5
            shape = {"BHSD": (B, "H", S, D), "BSHD": (B, S, "H", D), "SBHD": (S, B, "H", D)}[layout]
            q = _rand(*[Hq if s == "H" else s for s in shape], seed=1)
            k = _rand(*[Hk if s == "H" else s for s in shape], seed=2)
            run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(HEADS_DIM[layout])], start_pos=3,
                     interleaved=interleaved, layout=layout, ref_pos=None, full_kw={}, dist_kw={},
                     tag=f"TP {layout} interleaved={interleaved}")
    # one tensor, and freqs as a replicated DTensor instead of a plain tensor
    x = _rand(2, 2 * W, 4, D, seed=3)
    f = DTensor.from_local(rotary.rope_freqs(D, L), mesh, [Replicate()], run_check=False)
    run_case(mesh, OPS.apply_rope, [x], [Shard(1)], start_pos=0, interleaved=True, layout="BHSD", ref_pos=None,
             full_kw={}, dist_kw={}, tag="TP apply_rope, replicated DTensor freqs", freqs=f)


def dp_batch(mesh):
    W = mesh.size()
    q, k = _rand(2 * W, 2, 5, D, seed=4), _rand(2 * W, 1, 5, D, seed=5)
    offsets = torch.arange(2 * W) * 7 + 1
    ids = torch.randint(0, L - 8, (2 * W, 5), generator=torch.Generator().manual_seed(6))
    for name, pos, placed in (
        ("plain [B] offsets", offsets, offsets),
        ("[B] offsets sharded like batch", offsets, dshard(offsets, mesh, [Shard(0)])[0]),
        ("[B, S] ids sharded like batch", ids, dshard(ids, mesh, [Shard(0)])[0]),
    ):
        arg = OFFSETS if pos.dim() == 1 else IDS
        start = 2 if pos.dim() == 1 else 0  # ids are absolute (start_pos must be 0 with position_ids)
        run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(0)], start_pos=start, interleaved=False, layout="BHSD",
                 ref_pos=pos, full_kw={arg: pos}, dist_kw={arg: placed}, tag=f"DP {name}")


def cp_offsets_derived(mesh):
    W = mesh.size()
    rank = mesh.get_local_rank()
    # 2W + 1 tokens: uneven shards (torch.chunk sizes), offsets still derived from the spec
    for layout in ("BHSD", "SBHD", "BSHD"):
        S = 2 * W + 1
        shape = {"BHSD": (2, 3, S, D), "BSHD": (2, S, 3, D), "SBHD": (S, 2, 3, D)}[layout]
        q, k = _rand(*shape, seed=7), _rand(*shape, seed=8)
        placements = [Shard(SEQ_DIM[layout])]
        shards = run_case(mesh, OPS.apply_rope_qk, [q, k], placements, start_pos=5, interleaved=True,
                          layout=layout, ref_pos=None, full_kw={}, dist_kw={}, tag=f"CP derived {layout}")
        # The offset matters: the shard rotated at start_pos alone is wrong on ranks past 0.
        off = compute_local_shape_and_global_offset(q.shape, mesh, placements)[1][SEQ_DIM[layout]]
        if off > 0 and shards[0][1].numel() > 0:  # (4 ranks, 9 tokens: the last shard is empty)
            plain = OPS.apply_rope(shards[0][1].detach(), rotary.rope_freqs(D, L), 5, True, layout=layout)
            want = local_part(OPS.apply_rope(q, rotary.rope_freqs(D, L), 5, True, layout=layout), mesh, placements)
            assert not torch.equal(plain, want), f"rank {rank}: the check cannot see a missing offset"
    offsets = torch.tensor([0, 11])
    q, k = _rand(2, 3, 3 * W, D, seed=9), _rand(2, 1, 3 * W, D, seed=10)
    run_case(mesh, OPS.apply_rope_qk, [q, k], [Shard(2)], start_pos=1, interleaved=False, layout="BHSD",
             ref_pos=offsets, full_kw={OFFSETS: offsets}, dist_kw={OFFSETS: offsets}, tag="CP derived + offsets")


def _head_tail(S, W):
    """Load-balanced order: rank r holds chunks r and 2W-1-r of the sequence."""
    chunks = torch.arange(S).chunk(2 * W)
    return torch.cat([torch.cat([chunks[r], chunks[2 * W - 1 - r]]) for r in range(W)])


def cp_head_tail_ids(mesh):
    W = mesh.size()
    B, S = 2, 4 * W
    perm = _head_tail(S, W)
    q, k = _rand(B, 4, S, D, seed=11), _rand(B, 2, S, D, seed=12)
    qp, kp = q[:, :, perm].contiguous(), k[:, :, perm].contiguous()
    ids = (perm[None, :] + torch.tensor([[0], [9]])).contiguous()  # [B, S]: batch 1 starts at 9
    for name, placed in (
        ("ids sharded like the sequence", dshard(ids, mesh, [Shard(1)])[0]),
        ("replicated plain ids", ids),
        ("replicated DTensor ids", DTensor.from_local(ids, mesh, [Replicate()], run_check=False)),
    ):
        for interleaved in (True, False):
            run_case(mesh, OPS.apply_rope_qk, [qp, kp], [Shard(2)], start_pos=0, interleaved=interleaved,
                     layout="BHSD", ref_pos=ids, full_kw={IDS: ids}, dist_kw={IDS: placed},
                     tag=f"CP head-tail, {name}, interleaved={interleaved}")
    # The head-tail ids are the natural positions: same as rotating in order, then reordering.
    natural = OPS.apply_rope_qk(q, k, rotary.rope_freqs(D, L), 0, True, **{OFFSETS: torch.tensor([0, 9])})
    balanced = OPS.apply_rope_qk(qp, kp, rotary.rope_freqs(D, L), 0, True, **{IDS: ids})
    assert torch.equal(natural[0][:, :, perm], balanced[0]) and torch.equal(natural[1][:, :, perm], balanced[1])
    if IDS == "position_ids":  # [seq] ids, shared by the batch
        run_case(mesh, OPS.apply_rope_qk, [qp, kp], [Shard(2)], start_pos=0, interleaved=True, layout="BHSD",
                 ref_pos=perm.expand(B, S), full_kw={IDS: perm}, dist_kw={IDS: dshard(perm, mesh, [Shard(0)])[0]},
                 tag="CP head-tail, [S] ids")


def in_place(mesh):
    W = mesh.size()
    f = rotary.rope_freqs(D, L)
    x = _rand(2, 2 * W, 2 * W, D, seed=13)
    q, k = _rand(2, 2 * W, 2 * W, D, seed=14), _rand(2, W, 2 * W, D, seed=15)
    for placements in ([Shard(1)], [Shard(2)]):
        dx, lx = dshard(x, mesh, placements)
        dq, lq = dshard(q, mesh, placements)
        dk, lk = dshard(k, mesh, placements)
        with CommDebugMode() as comm:
            OPS.apply_rope_(dx, f, 4, False)
            OPS.apply_rope_qk_(dq, dk, f, 4, True)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert torch.equal(lx, local_part(OPS.apply_rope(x, f, 4, False), mesh, placements)), placements
        fq, fk = OPS.apply_rope_qk(q, k, f, 4, True)
        assert torch.equal(lq, local_part(fq, mesh, placements)) and torch.equal(lk, local_part(fk, mesh, placements))
        torch.testing.assert_close(lq.double(), local_part(reference(q, "BHSD", 4, True, None), mesh, placements),
                                   atol=1e-5, rtol=0)


def mesh_2d(mesh):
    """DP x CP on a 2 x (W/2) mesh: Shard(batch) and Shard(seq) together, [B] offsets."""
    from torch.distributed.device_mesh import init_device_mesh

    m2 = init_device_mesh("cpu", (2, mesh.size() // 2), mesh_dim_names=("dp", "cp"))
    offsets = torch.tensor([3, 0, 8, 1])
    q, k = _rand(4, 2, 6, D, seed=16), _rand(4, 2, 6, D, seed=17)
    run_case(m2, OPS.apply_rope_qk, [q, k], [Shard(0), Shard(2)], start_pos=2, interleaved=True, layout="BHSD",
             ref_pos=offsets, full_kw={OFFSETS: offsets}, dist_kw={OFFSETS: offsets}, tag="DP x CP")


def comm_mode_sees_collectives(mesh):
    """CommDebugMode counts a gloo all-gather here, so a zero count means something."""
    t = dshard(_rand(2, mesh.size() * 2, 3, D, seed=18), mesh, [Shard(1)])[0]
    with CommDebugMode() as comm:
        t.full_tensor()
    assert comm.get_total_counts() > 0


# ----------------------------------------------------------------------------
# A tiny Llama-style attention block


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.hd = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.rope = rotary.RotaryEmbedding(self.hd, max_seq_len=64, interleaved=False)

    def forward(self, x, attend):
        # x: [seq, batch, dim] (sequence first, as Megatron: a sequence-sharded
        # x stays a leading-dim shard through the projections' flatten)
        S, B, _ = x.shape
        q, k, v = (w(x).view(S, B, -1, self.hd).permute(1, 2, 0, 3) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q, k)  # [B, H, S, hd]
        o = attend(q, k, v)
        return self.wo(o.permute(2, 0, 1, 3).reshape(S, B, -1))


def causal_attention(q, k, v, q_offset=0):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    rows = q_offset + torch.arange(q.shape[2])
    mask = torch.arange(k.shape[2])[None, :] > rows[:, None]
    return F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def _block_inputs():
    torch.manual_seed(0)
    model = Block()
    x = _rand(8, 2, 32, seed=20)  # [seq, batch, dim]
    g = _rand(8, 2, 32, seed=21)
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr, causal_attention)
    (y_ref * g).sum().backward()
    return model, ref, x, g, xr, y_ref


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: {m}")


def llama_tp(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, ref, x, g, xr, y_ref = _block_inputs()
    plan = {n: ColwiseParallel(use_local_output=False) for n in ("wq", "wk", "wv")}
    plan["wo"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)  # the rope module's buffers stay plain tensors: read as replicated

    def attend(q, k, v):  # heads are independent: attention on the local heads
        assert tuple(q.placements) == (Shard(1),), q.placements
        o = causal_attention(q.to_local(), k.to_local(), v.to_local())
        return DTensor.from_local(o, mesh, [Shard(1)], run_check=False)

    xl = x.clone().requires_grad_()
    y = model(xl, attend)
    _close(y, y_ref.detach(), "TP=2 output")
    (y * g).sum().backward()
    _close(xl.grad, xr.grad, "TP=2 input grad")
    for n in ("wq", "wk", "wv", "wo"):
        _close(getattr(model, n).weight.grad.full_tensor(), getattr(ref, n).weight.grad, f"TP=2 {n} grad")


def llama_cp(mesh):
    from torch.distributed.tensor import distribute_module

    model, ref, x, g, xr, y_ref = _block_inputs()
    distribute_module(model, mesh)  # every parameter and buffer (rope tables too) a replicated DTensor
    assert isinstance(model.rope.freqs, DTensor), type(model.rope.freqs)

    def attend(q, k, v):  # queries stay local; keys/values gathered (outside the rotary op)
        assert tuple(q.placements) == (Shard(2),), q.placements
        off = compute_local_shape_and_global_offset(q.shape, mesh, q.placements)[1][2]
        kl, vl = (t.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]) for t in (k, v))
        o = causal_attention(q.to_local(), kl, vl, off)
        return DTensor.from_local(o, mesh, [Shard(2)], run_check=False)  # even shards

    xs, xl = dshard(x, mesh, [Shard(0)], requires_grad=True)
    y = model(xs, attend)
    assert tuple(y.placements) == (Shard(0),), y.placements
    _close(y.to_local(), local_part(y_ref.detach(), mesh, [Shard(0)]), "CP=2 output")
    (y.to_local() * local_part(g, mesh, [Shard(0)])).sum().backward()
    _close(xl.grad, local_part(xr.grad, mesh, [Shard(0)]), "CP=2 input grad")
    for n in ("wq", "wk", "wv", "wo"):
        _close(getattr(model, n).weight.grad.full_tensor(), getattr(ref, n).weight.grad, f"CP=2 {n} grad")


# ----------------------------------------------------------------------------
# Refused placements: a clear error, nothing computed, nothing written


def refusals(mesh):
    f = rotary.rope_freqs(D, L)
    q, k = _rand(2, 4, 6, D, seed=30), _rand(2, 2, 6, D, seed=31)
    ids = torch.randint(0, L - 8, (2, 6), generator=torch.Generator().manual_seed(32))

    def refused(pattern, fn):
        with pytest.raises(ValueError, match=pattern):
            fn()

    dq3, _ = dshard(q, mesh, [Shard(3)])
    dk3, _ = dshard(k, mesh, [Shard(3)])
    refused(re.escape(repr(Shard(3))) + r".*splits head_dim.*shard batch \(Shard\(dim=0\)\), heads \(Shard\(dim=1\)\)",
            lambda: OPS.apply_rope_qk(dq3, dk3, f))
    # in place: refused before anything is written
    before = (dq3.to_local().clone(), dk3.to_local().clone())
    refused("splits head_dim", lambda: OPS.apply_rope_qk_(dq3, dk3, f))
    assert torch.equal(dq3.to_local(), before[0]) and torch.equal(dk3.to_local(), before[1])

    dq2, _ = dshard(q, mesh, [Shard(2)])
    dk2, _ = dshard(k, mesh, [Shard(2)])
    dk1, _ = dshard(k, mesh, [Shard(1)])
    refused(r"q has placements \(Shard\(dim=2\)\) but k has \(Shard\(dim=1\)\).*sharded alike",
            lambda: OPS.apply_rope_qk(dq2, dk1, f))
    refused(r"k is a plain tensor but q is a DTensor", lambda: OPS.apply_rope_qk(dq2, k, f))
    f_rep = DTensor.from_local(f, mesh, [Replicate()], run_check=False)
    refused(r"freqs is a DTensor but q and k are plain tensors; pass freqs.to_local\(\)",
            lambda: OPS.apply_rope_qk(q, k, f_rep))

    # position ids sharded unlike the sequence
    ids_b, _ = dshard(ids, mesh, [Shard(0)])
    refused(rf"{IDS} has placements \(Shard\(dim=0\)\) but q and k are placed \(Shard\(dim=2\)\): this rank "
            rf"rotates {IDS}\[.*Shard {IDS} \(ids\) the same way as the sequence/batch of q, or replicate it",
            lambda: OPS.apply_rope_qk(dq2, dk2, f, **{IDS: ids_b}))
    ids_s, _ = dshard(ids, mesh, [Shard(1)])
    dqr = DTensor.from_local(q, mesh, [Replicate()], run_check=False)
    dkr = DTensor.from_local(k, mesh, [Replicate()], run_check=False)
    refused(rf"{IDS} has placements \(Shard\(dim=1\)\) but q and k are placed \(Replicate\(\)\): this rank rotates "
            rf"{IDS}\[0:6\] along dim 1 and holds only \[\d:\d\]",
            lambda: OPS.apply_rope_qk(dqr, dkr, f, **{IDS: ids_s}))

    # shards whose spec does not say where they lie (uneven, against torch.chunk sizes)
    rank = mesh.get_local_rank()
    q7 = _rand(2, 4, 7, D, seed=33)
    n = 3 if rank == 0 else 4  # the spec of a 7-token Shard(2) says 4 then 3
    lo = 0 if rank == 0 else 3
    local = q7[:, :, lo:lo + n].contiguous()
    bad = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=q7.shape, stride=q7.stride())
    refused(r"x has a local shard of shape .* global offset cannot be derived.*shape=, stride=",
            lambda: OPS.apply_rope(bad, f))

    strided = DTensor.from_local(q[:, :2].contiguous(), mesh, [_StridedShard(1, split_factor=2)], run_check=False,
                                 shape=q.shape, stride=q.stride())
    refused(r"x has placement _StridedShard\(dim=1, sf=2\) on mesh dim 0, which has no rotary rule",
            lambda: OPS.apply_rope(strided, f))

    part = DTensor.from_local(q, mesh, [Partial("max")], run_check=False)
    refused(r"x has placement Partial\(max\) on mesh dim 0; only Partial\(sum\) or Partial\(avg\) rotates term "
            r"by term: reduce it first", lambda: OPS.apply_rope(part, f))

    fs, _ = dshard(f, mesh, [Shard(0)])
    refused(r"freqs has placements \(Shard\(dim=0\)\); every rank needs all of it: replicate it",
            lambda: OPS.apply_rope(dq2, fs))

    # packed tokens: no sequence sharding
    tokens = _rand(8, 4, D, seed=34)
    cu = torch.tensor([0, 3, 8])
    dt, _ = dshard(tokens, mesh, [Shard(0)])
    refused(r"Shard\(dim=0\) on mesh dim 0, which splits packed tokens.*shard heads \(Shard\(dim=1\)\)",
            lambda: OPS.apply_rope(dt, f, cu_seqlens=cu))
    # ... but heads may be sharded
    dth, lth = dshard(tokens, mesh, [Shard(1)])
    out = OPS.apply_rope(dth, f, cu_seqlens=cu)
    assert torch.equal(out.to_local(), local_part(OPS.apply_rope(tokens, f, cu_seqlens=cu), mesh, [Shard(1)]))

    # bad input that is not about placement: the op's own validator answers, as on plain tensors
    with pytest.raises(ValueError, match="layout must be 'BHSD', 'BSHD' or 'SBHD', got 'XYZ'"):
        OPS.apply_rope(dq2, f, layout="XYZ")


def scenarios(world):
    out = [
        ("tp_heads", tp_heads),
        ("dp_batch", dp_batch),
        ("cp_offsets_derived", cp_offsets_derived),
        ("cp_head_tail_ids", cp_head_tail_ids),
        ("in_place", in_place),
        ("comm_mode_sees_collectives", comm_mode_sees_collectives),
    ]
    if world == 2:
        out += [("llama_tp2", llama_tp), ("llama_cp2", llama_cp), ("refusals", refusals)]
    if world == 4:
        out += [("mesh_2d", mesh_2d)]
    from rotary_testing.dist_kv_scenarios import scenarios as kv_scenarios  # it imports this module
    from rotary_testing.dist_module_scenarios import scenarios as module_scenarios
    from rotary_testing.dist_norm_scenarios import scenarios as norm_scenarios
    from rotary_testing.dist_trial_scenarios import scenarios as trial_scenarios

    return out + kv_scenarios() + norm_scenarios() + module_scenarios() + trial_scenarios()

