"""DTensor rules for the rotary ops: tensor parallel (Shard(heads)), context
parallel (Shard(seq)), data parallel (Shard(batch)) and Replicate.

Every rotary op (``apply_rope``, ``apply_rope_qk`` and their in-place forms;
the backward pass is the same op with ``inverse=True``) gets one DTensor
handler. It runs the op on each rank's local shard with no communication:

* ``Replicate`` / ``Shard(batch)`` / ``Shard(heads)`` on q, x, k: local call;
  the output keeps the input's placements. q and k placed differently are
  served out of place only (``apply_rope_qk``: each by its own ``apply_rope``
  call; the backward pass gets such gradients).
* ``Shard(seq)`` without position ids: the shard's global offset along the
  sequence (known from the DTensor spec) is added to ``start_pos``.
* ``Shard(seq)`` with position ids: each rank uses the ids of its own tokens,
  either sliced from replicated ids or taken from ids sharded like the
  sequence (head-tail load-balanced context parallel). N-D ids (pair_axes)
  are cut the same way, their axis dim whole.
* freqs, inv_freq, cu_seqlens: plain tensors count as replicated; DTensors
  must be replicated. So must ``apply_rope_cos_sin``'s tables (_cos_sin_rule).

Where ranks rotate different tokens (batch or sequence shards), the values
of the whole call (start_pos + seq_len, the positions every rank holds
whole) go through the op's own checks before any rank rotates
(``check_values``), so every rank refuses alike and none writes.

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

from . import _C, _dtensor_plans as _plans
from ._dtensor_shards import (
    _refuse_heads_norm,
    _refuse_plain_data,
    _bind,
    check_global,
    check_values,
    _call,
    _check_placements,
    _fmt,
    _local_range,
    _localize_positions,
    layout_dims,
    out_spec,
    sharded_dims,
    _position_kind,
    _refuse,
    _Refuse,
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
    global _registered, _LIB
    if _registered:
        return
    from torch.distributed.tensor import DTensor

    from ._distributed_kv import kv_handler

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _ops():
        handlers[op] = _handler
    handlers[torch.ops.rotary.apply_rope_with_kv_cache_.default] = kv_handler
    handlers[torch.ops.rotary.apply_qk_norm_rope_with_kv_cache_.default] = kv_handler
    _LIB = torch.library.Library("rotary", "IMPL")  # a composite op's rule: see _cos_sin_rule
    _LIB.impl("apply_rope_cos_sin", _cos_sin_rule, "PythonTLSSnapshot", with_keyset=True)
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
        # (offset, length, whether size 1 broadcasts), as the op reads each form:
        # a size-1 dim broadcasts over a data dim of another size, and is that
        # dim (sharded like it) where the data's is 1 too.
        whole = bound[data[0]].shape
        rows = None if batch is None else (x_offset[batch], x_local.shape[batch], whole[batch] != 1)
        if kinds[n] == "offsets":
            want = [rows] * p.dim()  # [] or [batch]
        elif packed:
            want = [None] * p.dim()  # [total_tokens]; tokens are never sharded here
        elif rest == 1:  # [seq]: one id per token, no broadcast
            want = lead + [(x_offset[seq], x_local.shape[seq], False)]
        else:  # [batch, seq]: either dim of size 1 broadcasts
            want = lead + [rows, (x_offset[seq], x_local.shape[seq], whole[seq] != 1)]
        local[n] = _localize_positions(op, n, p, kinds[n], want, mesh, data, data_name, placements, packed)
    if seq_sharded and "ids" not in kinds.values():
        # No ids: token s of this shard is token seq_offset + s of the sequence.
        local["start_pos"] = bound.get("start_pos", 0) + x_offset[seq]


def _one_by_one(op, bound):
    """apply_rope_qk with q and k placed differently (the backward gets such
    gradients: a .sum() gives a Replicate one, an elementwise op a Shard one):
    out of place nothing is written, so each is rotated by its own apply_rope
    call under its own placements, after the pair's own checks."""
    check_global(op, bound)
    # The pair's values (start_pos, whole positions) in its own words, before either is rotated alone.
    dims = layout_dims(bound, bound["q"])
    if dims is not None:
        mesh = bound["q"].device_mesh
        whole = {n: _whole(op, n, bound[n], mesh) for n in _REPLICATED_ARGS if bound.get(n) is not None}
        check_values(op, bound, dict(bound, **whole), ("q", "k"), dims, _POSITION_ARGS)
    x_op = torch.ops.rotary.apply_rope.default
    rest = {n: v for n, v in bound.items() if n not in ("q", "k")}
    out = []
    for n in ("q", "k"):
        try:
            out.append(_handler(x_op, (), dict(rest, x=bound[n])))
        except _Refuse as e:
            why = str(e).split(": ", 1)[-1]
            _refuse(op, f"{n}, placed {_fmt(bound[n].placements)} unlike the other, is rotated alone (as x): {why}")
    return tuple(out)


def _handler(op, args, kwargs):
    key = _plans.plan_key(op, args, kwargs)
    out = _plans.run(op, args, kwargs, key)
    return _rule(op, args, kwargs, key) if out is _plans.MISS else out


def _rule(op, args, kwargs, key):
    from torch.distributed.tensor import DTensor  # already imported: DTensor called us

    bound = _bind(op, args, kwargs)
    data = [n for n in _DATA_ARGS if n in bound]
    first = next((bound[n] for n in data if isinstance(bound[n], DTensor)), None)
    if first is None:
        _refuse_plain_data(op, next(n for n in bound if isinstance(bound[n], DTensor)), data)
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
            if op == torch.ops.rotary.apply_rope_qk.default:
                return _one_by_one(op, bound)
            why = ("in place, both are written in one call, and one at a time q could be written before k is "
                   "refused" if op._schema.is_mutable else
                   "the prologue normalizes and rotates them in one call, with no single-tensor form")
            if op == torch.ops.rotary.apply_rope_qk_.default:
                why += " (the out-of-place apply_rope_qk takes them placed differently)"
            _refuse(
                op,
                f"{data[0]} has placements {_fmt(placements)} but {n} has {_fmt(t.placements)}; q and k "
                f"must be sharded alike (the same placement on every mesh dim): {why}",
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
    dims = layout_dims(bound, x)  # None: not a shape the op accepts, its own validator says why
    sharded = dims is not None and not all(p.is_replicate() for p in placements)
    if sharded:
        for n in data:
            _check_placements(op, n, bound[n], dims, packed, linear="norm" not in op._schema.name)

    if sharded and bound.get("norm") == "heads":
        _refuse_heads_norm(op, placements, x.ndim, dims[1])
    # Below autograd grad mode is off, under no_grad or not: the flags are all there is to read.
    grad = any(bound[n].requires_grad for n in data)
    for n in ("q_weight", "k_weight"):
        w = bound.get(n)
        if w is not None and not isinstance(w, DTensor) and (grad or w.requires_grad):
            who = "q and k require grad" if grad else f"{n} requires grad"
            _refuse(op, f"{who}: pass {n} as a replicated DTensor (the backward pass runs on DTensors, and its "
                        f"gradient is a sum over the ranks), or detach every input ({n}.detach())")

    for n in data:
        if sharded:
            local[n], offset = _local_range(bound[n], op, n)
        else:
            local[n], offset = bound[n]._local_tensor, (0,) * x.ndim
        if n == data[0]:
            x_offset, x_local = offset, local[n]

    scale = local.get("q_fp8_scale")
    if sharded and scale is not None and scale.dim() == 1 and scale.shape[0] > 1:  # per q head: this rank's heads
        # Whole first, in the op's words: alone, a bad head's rank would refuse while the others return.
        _C.check_scale_values(op._schema.name.split("::")[-1], "q_fp8_scale", scale, "q is returned as")
        local["q_fp8_scale"] = scale.narrow(0, x_offset[dims[1]], x_local.shape[dims[1]])
    if dims is not None:
        _localize_all_positions(
            op, bound, local, dims, packed, x_offset, x_local, mesh, data, data_name, placements)
        cut = sharded_dims(placements, x.ndim)
        positions = any(bound.get(n) is not None for n in _POSITION_ARGS)
        empty = dims[0] is not None and x_local.shape[dims[0]] == 0  # no rows here: no start_pos check either
        if not packed and (dims[2] in cut or (dims[0] in cut and (positions or empty))):
            # Each rank's positions are its own (shifted or cut): the whole call's values first, alike on every rank.
            check_values(op, bound, local, data, dims, _POSITION_ARGS)
        if dims[0] in cut or dims[2] in cut or not _plans.is_trivial(bound, local):
            key = None  # ranks rotate different tokens: the rule runs every call
    else:
        key = None
        for n in _POSITION_ARGS:
            if isinstance(bound.get(n), DTensor):
                local[n] = bound[n]._local_tensor

    out = _call(op, local)
    if out is None:  # in-place ops: the local shards were rotated in place
        _plans.remember(key, None)
        return None

    def wrap(t, like):
        return DTensor(t, out_spec(like._spec, t), requires_grad=False)

    out = wrap(out, bound[data[0]]) if isinstance(out, torch.Tensor) else tuple(
        wrap(t, bound[n]) for t, n in zip(out, data))
    _plans.remember(key, out)
    return out


# ----------------------------------------------------------------------------
# apply_rope_cos_sin


_LIB = None
_KEY = torch._C.DispatchKey
_AFTER_SNAPSHOT = torch._C._dispatch_keyset_full_after(_KEY.PythonTLSSnapshot)


def _cos_sin_rule(keyset, *args, **kwargs):
    """apply_rope_cos_sin on DTensors. A composite op decomposes above
    DTensor's dispatch, so DTensor tables would reach the aten ops inside it
    (torch's errors, naming no argument). This kernel sits on
    PythonTLSSnapshot, the one key above Autograd that DTensors (and other
    subclasses and dispatch modes) carry and plain tensors do not: replicated
    tables are read as their local tensors, as freqs is, other placements are
    refused by name; q and k then take apply_rope_qk's rule."""
    from torch.distributed.tensor import DTensor

    op = torch.ops.rotary.apply_rope_cos_sin.default
    bound = _bind(op, args, kwargs)
    tables = [n for n in ("cos", "sin", "position_ids") if isinstance(bound.get(n), DTensor)]
    if tables:
        first = next((bound[n] for n in ("q", "k") if isinstance(bound[n], DTensor)), None)
        if first is None:
            _refuse_plain_data(op, tables[0], ["q", "k"])
        for n in tables:
            bound[n] = _whole(op, n, bound[n], first.device_mesh)
        return _call(op, bound)
    if torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY.AutogradFunctionality):
        # Below autograd (inference mode) the op itself would reach the Python
        # key, which needs the TLS this key snapshots: decompose it, as DTensor does.
        return op.decompose(*args, **kwargs)
    return op.redispatch(keyset & _AFTER_SNAPSHOT, *args, **kwargs)  # Autograd decomposes it
