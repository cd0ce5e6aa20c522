"""DTensor rules for the rotary ops: tensor parallel (Shard(heads)), context
parallel (Shard(seq)), data parallel (Shard(batch)) and Replicate.

Every rotary op (``apply_rope``, ``apply_rope_qk`` and their in-place forms;
the backward pass is the same op with ``inverse=True``) gets one DTensor
handler. It runs the op on each rank's local shard with no communication:

* ``Replicate`` / ``Shard(batch)`` / ``Shard(heads)`` on q, x, k: local call;
  the output keeps the input's placements. q and k must be placed alike.
* ``Shard(seq)`` without position ids: the shard's global offset along the
  sequence (known from the DTensor spec) is added to ``start_pos``.
* ``Shard(seq)`` with position ids: each rank uses the ids of its own tokens,
  either sliced from replicated ids or taken from ids sharded like the
  sequence (head-tail load-balanced context parallel).
* freqs, inv_freq, cu_seqlens: plain tensors count as replicated; DTensors
  must be replicated.

A placement that cannot be computed locally (Shard(head_dim), Partial, ids
sharded unlike the sequence, sequence sharding of packed tokens, _StridedShard,
shards whose global offset the spec cannot give) raises ``ValueError`` naming the
placement and what would make it valid; nothing is computed.

The prologue ops (``apply_qk_norm_rope`` and its in-place form) take the
same rule, their weights replicated. A per-head norm (``norm="head"``) is
local under every placement above; a norm over all heads of a token
(``norm="heads"``) is refused on head shards, whose ranks each hold part of
its variance.

``apply_rope_with_kv_cache_`` and ``apply_qk_norm_rope_with_kv_cache_`` have
their own rule, tensor parallel only (``_distributed_kv.py``).

Importing ``rotary`` installs these rules as soon as
``torch.distributed.tensor`` is imported (a one-shot import hook), so
``import rotary`` does not pay for importing DTensor.
"""

import importlib.machinery
import sys

import torch

from ._dtensor_shards import (
    _refuse_heads_norm,
    _bind,
    _cached,
    check_global,
    _call,
    _check_placements,
    _DIMS,
    _fmt,
    _global_stride,
    _local_range,
    _localize_positions,
    _OUT_SPECS,
    _position_kind,
    _refuse,
    _whole,
)

__all__ = ["register"]

OP_NAMES = ("apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_", "apply_qk_norm_rope",
            "apply_qk_norm_rope_")
_DATA_ARGS = ("x", "q", "k")  # the rotated tensors; everything else is an option
_REPLICATED_ARGS = ("freqs", "inv_freq", "cu_seqlens", "q_weight", "k_weight", "q_fp8_scale")
# Position arguments, by schema name: what each one holds.
#   offsets:      []/[batch], added to start_pos + s
#   position_ids: absolute ids [seq] / [batch, seq] ([total_tokens] packed)
#   positions:    either, told apart by rank (the older single argument)
_POSITION_ARGS = ("positions", "offsets", "position_ids")

_registered = False


def _ops():
    return [getattr(torch.ops.rotary, n).default for n in OP_NAMES]


def register():
    """Install the DTensor handler for every rotary op (idempotent). Called
    for you when ``torch.distributed.tensor`` is imported after ``rotary``."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import DTensor

    from ._distributed_kv import kv_handler

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _ops():
        handlers[op] = _handler
    handlers[torch.ops.rotary.apply_rope_with_kv_cache_.default] = kv_handler
    handlers[torch.ops.rotary.apply_qk_norm_rope_with_kv_cache_.default] = kv_handler
    _registered = True


class _RegisterOnImport:
    """One-shot meta-path finder: when ``torch.distributed.tensor`` is first
    imported, run it, then :func:`register`."""

    _TARGET = "torch.distributed.tensor"

    def find_spec(self, name, path, target=None):
        if name != self._TARGET:
            return None
        _remove_hook()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()

        spec.loader.exec_module = exec_then_register
        return spec


_HOOK = _RegisterOnImport()


def _remove_hook():
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def _install():
    """Register now if DTensor is already imported, else when it is."""
    if "torch.distributed.tensor" in sys.modules:
        register()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


# ----------------------------------------------------------------------------
# The handler


def _localize_all_positions(op, bound, local, dims, packed, x_offset, x_local, mesh, data, data_name, placements):
    """Each position argument as this rank's tokens see it, into local; and,
    for a sequence shard without ids, its global offset added to start_pos."""
    batch, _, seq, _ = dims
    seq_sharded = x_local.shape[seq] != bound[data[0]].shape[seq]
    pos_args = [n for n in _POSITION_ARGS if bound.get(n) is not None]
    kinds = {n: _position_kind(n, bound[n], packed) for n in pos_args}
    for n in pos_args:
        p = bound[n]
        # N-D ids (pair_axes) lead with their axis dim, always whole.
        lead = [None] if kinds[n] == "ids" and bound.get("pair_axes") is not None else []
        rest = p.dim() - len(lead)
        if kinds[n] == "offsets":
            # [] or [batch] (size 1 broadcasts)
            want = [None if batch is None else (x_offset[batch], x_local.shape[batch])] * p.dim()
        elif packed:
            want = [None] * p.dim()  # [total_tokens]; tokens are never sharded here
        elif rest == 1:  # [seq]
            want = lead + [(x_offset[seq], x_local.shape[seq])]
        else:  # [batch, seq]
            want = lead + [(x_offset[batch], x_local.shape[batch]), (x_offset[seq], x_local.shape[seq])]
        local[n] = _localize_positions(op, n, p, kinds[n], want, mesh, data, data_name, placements)
    if seq_sharded and "ids" not in kinds.values():
        # No ids: token s of this shard is token seq_offset + s of the sequence.
        local["start_pos"] = bound.get("start_pos", 0) + x_offset[seq]


def _handler(op, args, kwargs):
    from torch.distributed.tensor import DTensor  # already imported: DTensor called us
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    bound = _bind(op, args, kwargs)
    data = [n for n in _DATA_ARGS if n in bound]
    first = next((bound[n] for n in data if isinstance(bound[n], DTensor)), None)
    if first is None:
        some = next(n for n in bound if isinstance(bound[n], DTensor))
        names = " and ".join(data)
        plain = "are plain tensors" if len(data) > 1 else "is a plain tensor"
        _refuse(
            op,
            f"{some} is a DTensor but {names} {plain}; pass {some}.to_local() (or .full_tensor()), or make "
            f"{names} DTensors",
        )
    mesh, placements = first.device_mesh, tuple(first.placements)
    data_name = " and ".join(data) + (" are placed" if len(data) > 1 else " is placed")

    for n in data:
        t = bound[n]
        if not isinstance(t, DTensor):
            _refuse(
                op,
                f"{n} is a plain tensor but {data[0] if n != data[0] else data[-1]} is a DTensor; pass both as "
                "DTensors placed alike (DTensor.from_local or distribute_tensor)",
            )
        if t.device_mesh != mesh:
            _refuse(op, f"{data[0]} is on mesh {mesh} but {n} is on mesh {t.device_mesh}; use one mesh")
        if tuple(t.placements) != placements:
            _refuse(
                op,
                f"{data[0]} has placements {_fmt(placements)} but {n} has {_fmt(t.placements)}; q and k "
                "must be sharded alike (the same placement on every mesh dim)",
            )
    # The plain op's checks on the whole call (global shapes, options): a
    # position tensor or scale of the wrong size is refused, not sliced.
    check_global(op, bound)

    local = dict(bound)
    for n in _REPLICATED_ARGS:
        if bound.get(n) is not None:
            local[n] = _whole(op, n, bound[n], mesh)

    packed = bound.get("cu_seqlens") is not None
    x = bound[data[0]]
    layout = "THD" if packed else bound.get("layout", "BHSD")
    dims = (None, 1, 0, 2) if packed else _DIMS.get(layout)
    if dims is None or x.ndim != (3 if packed else 4):
        # Not a shape the op accepts: let the op's own validator say why.
        dims = None
    sharded = dims is not None and not all(p.is_replicate() for p in placements)
    if sharded:
        for n in data:
            _check_placements(op, n, bound[n], dims, packed, linear="norm" not in op._schema.name)

    if sharded and bound.get("norm") == "heads":
        _refuse_heads_norm(op, placements, x.ndim, dims[1])
    # (Below autograd grad mode is off: the inputs' flag tells a graph is recorded.)
    if any(bound[n].requires_grad for n in data):
        for n in ("q_weight", "k_weight"):
            if bound.get(n) is not None and not isinstance(bound[n], DTensor):
                _refuse(op, f"q and k require grad: pass {n} as a replicated DTensor (the backward pass runs on "
                            "DTensors, and its gradient is a sum over the ranks), or run under torch.no_grad()")

    for n in data:
        if sharded:
            local[n], offset = _local_range(bound[n], op, n)
        else:
            local[n], offset = bound[n]._local_tensor, (0,) * x.ndim
        if n == data[0]:
            x_offset, x_local = offset, local[n]

    scale = local.get("q_fp8_scale")
    if sharded and scale is not None and scale.dim() == 1 and scale.shape[0] > 1:  # per q head: this rank's heads
        local["q_fp8_scale"] = scale.narrow(0, x_offset[dims[1]], x_local.shape[dims[1]])
    if sharded and bound.get("pair_axes") is not None:
        _refuse(op, "pair_axes (N-D positions) with sharded DTensor inputs is not supported; replicate q and k")
    if dims is not None:
        _localize_all_positions(
            op, bound, local, dims, packed, x_offset, x_local, mesh, data, data_name, placements)
    else:
        for n in _POSITION_ARGS:
            if isinstance(bound.get(n), DTensor):
                local[n] = bound[n]._local_tensor

    out = _call(op, local)
    if out is None:  # in-place ops: the local shards were rotated in place
        return None

    def wrap(t, like):
        stride = _global_stride(t, like.shape)
        spec = _cached(
            _OUT_SPECS,
            (like._spec, stride, t.dtype),
            lambda: DTensorSpec(mesh, placements, tensor_meta=TensorMeta(like.shape, stride, t.dtype)),
        )
        return DTensor(t, spec, requires_grad=False)

    if isinstance(out, torch.Tensor):
        return wrap(out, bound[data[0]])
    return tuple(wrap(t, bound[n]) for t, n in zip(out, data))
