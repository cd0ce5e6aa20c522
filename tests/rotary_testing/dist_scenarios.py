"""Scenarios for test_distributed.py, run inside every rank of a gloo group
(CPU) on a 1-D mesh of all ranks. Each raises on a mismatch. Inputs are
random and built identically on every rank (same seed); shards are cut from
them with no communication, so a failing scenario cannot hang the others.

This module holds what every scenario shares (shards, the float64
reference, the sharded-vs-unsharded check) and the list of scenarios; the
op scenarios are in dist_op_scenarios.py, the Llama-style block in
dist_llama_scenarios.py, the refused placements in dist_refusal_scenarios.py,
and the KV-cache, module, norm and trial ones in their dist_*_scenarios.py."""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
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


def scenarios(world):
    from rotary_testing.dist_llama_scenarios import llama_cp, llama_tp  # they import this module
    from rotary_testing.dist_op_scenarios import (comm_mode_sees_collectives, cp_head_tail_ids, cp_offsets_derived,
                                                  dp_batch, in_place, mesh_2d, tp_heads)
    from rotary_testing.dist_refusal_scenarios import refusals

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
    from rotary_testing.dist_plan_scenarios import scenarios as plan_scenarios
    from rotary_testing.dist_alike_scenarios import scenarios as alike_scenarios
    from rotary_testing.dist_trial_scenarios import scenarios as trial_scenarios

    return out + kv_scenarios() + norm_scenarios() + module_scenarios() + trial_scenarios() + plan_scenarios() + alike_scenarios()
