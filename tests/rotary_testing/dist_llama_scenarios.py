"""A tiny Llama-style attention block for test_distributed.py (run in every
rank of 2, through dist_scenarios.scenarios), parallelised two ways: tensor
parallel (column / row-wise projections, attention on the local heads) and
context parallel (every parameter and the rope tables replicated, the
sequence sharded); outputs and gradients match the unsharded block. Split
from dist_scenarios.py."""

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import rotary
from rotary_testing.dist_scenarios import _rand, dshard, local_part


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
