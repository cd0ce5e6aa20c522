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

``apply_rope_with_kv_cache_`` has its own rule, tensor parallel only
(``_distributed_kv.py``).

Importing ``rotary`` installs these rules as soon as
``torch.distributed.tensor`` is imported (a one-shot import hook), so
``import rotary`` does not pay for importing DTensor.
"""

import importlib.machinery
import sys

import torch

__all__ = ["register"]

OP_NAMES = ("apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_")
_DATA_ARGS = ("x", "q", "k")  # the rotated tensors; everything else is an option
_REPLICATED_ARGS = ("freqs", "inv_freq", "cu_seqlens")
# Position arguments, by schema name: what each one holds.
#   offsets:      []/[batch], added to start_pos + s
#   position_ids: absolute ids [seq] / [batch, seq] ([total_tokens] packed)
#   positions:    either, told apart by rank (the older single argument)
_POSITION_ARGS = ("positions", "offsets", "position_ids")
_DIMS = {  # layout -> (batch, heads, seq, head_dim) tensor dims
    "BHSD": (0, 1, 2, 3),
    "BSHD": (0, 2, 1, 3),
    "SBHD": (1, 2, 0, 3),
}

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


_SCHEMAS = {}  # op -> ((name, kwarg_only, has_default, default), ...)


def _schema(op):
    s = _SCHEMAS.get(op)
    if s is None:
        s = _SCHEMAS[op] = tuple(
            (a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
            for a in op._schema.arguments
        )
    return s


def _bind(op, args, kwargs):
    """Schema argument name -> value (defaults filled in)."""
    bound = {}
    n = len(args)
    for i, (name, _, has_default, default) in enumerate(_schema(op)):
        if i < n:
            bound[name] = args[i]
        elif name in kwargs:
            bound[name] = kwargs[name]
        elif has_default:
            bound[name] = default
    return bound


def _call(op, bound):
    args, kwargs = [], {}
    for name, kwarg_only, _, _ in _schema(op):
        if name in bound:
            if kwarg_only:
                kwargs[name] = bound[name]
            else:
                args.append(bound[name])
    return op(*args, **kwargs)


# Per-spec caches: the DTensor machinery that answers these is slow next to a
# decode-sized kernel. Specs are hashable and immutable.
_RANGES = {}  # spec -> (local shape, global offset) on this rank
_OUT_SPECS = {}  # (spec, stride, dtype) -> output DTensorSpec
_CACHE_MAX = 4096


def _cached(cache, key, make):
    v = cache.get(key)
    if v is None:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        v = cache[key] = make()
    return v


def _fmt(placements):
    return "(" + ", ".join(repr(p) for p in placements) + ")"


class _Refuse(ValueError):
    pass


def _refuse(op, msg):
    raise _Refuse(f"rotary.{op._schema.name.split('::')[-1]} on DTensor: {msg}")


def _whole(op, name, t, mesh, why="every rank needs all of it"):
    """A tensor every rank reads whole: a plain one as it is, a replicated
    DTensor as its local tensor; any other placement is refused."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device_mesh != mesh or not all(p.is_replicate() for p in t.placements):
        _refuse(
            op,
            f"{name} has placements {_fmt(t.placements)}; {why}: replicate it "
            "(distribute_tensor(t, mesh, [Replicate()] * mesh.ndim)) or pass a plain tensor",
        )
    return t._local_tensor


def _local_range(t, op, name):
    """(local tensor, per-dim global offsets) of a DTensor, checked against
    its spec: a local shard of another size means the spec cannot say where
    the shard lies (DTensor.from_local of uneven shards without shape=)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t._local_tensor
    shape, offset = _cached(
        _RANGES, t._spec, lambda: compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    )
    if local.shape != shape:
        _refuse(
            op,
            f"{name} has a local shard of shape {tuple(local.shape)} but its spec (global shape "
            f"{tuple(t.shape)}, placements {_fmt(t.placements)}) gives this rank shape {tuple(shape)}, so its "
            "global offset cannot be derived; build it with DTensor.from_local(..., shape=, stride=) or "
            "distribute_tensor",
        )
    return local, offset


def _check_placements(op, name, t, dims, packed):
    """Refuse the placements of a rotated tensor that have no local rule."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    batch, heads, seq, head_dim = dims
    ok_hint = (
        f"shard heads (Shard(dim={heads})) or replicate"
        if packed
        else f"shard batch (Shard(dim={batch})), heads (Shard(dim={heads})) or sequence "
        f"(Shard(dim={seq})), or replicate"
    )
    for i, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            _refuse(
                op,
                f"{name} has placement {p!r} on mesh dim {i}; the rotary ops take whole values: reduce it "
                f"first, then {ok_hint}",
            )
        if not isinstance(p, Shard):
            _refuse(
                op,
                f"{name} has placement {p!r} on mesh dim {i}, which has no rotary rule (only Replicate and "
                f"Shard are computed locally): {ok_hint}",
            )
        d = p.dim % t.ndim
        if d == head_dim:
            _refuse(
                op,
                f"{name} has placement {p!r} on mesh dim {i}, which splits head_dim; every rotation pair "
                f"needs the whole head: {ok_hint}",
            )
        if packed and d == seq:
            _refuse(
                op,
                f"{name} has placement {p!r} on mesh dim {i}, which splits packed tokens [total_tokens] with "
                f"cu_seqlens; their positions depend on sequence boundaries across ranks: {ok_hint}, or use "
                "a padded layout (BSHD) with Shard(seq)",
            )


def _position_kind(arg, p, packed):
    if arg == "offsets":
        return "offsets"
    if arg == "position_ids":
        return "ids"
    return "offsets" if p.dim() <= (0 if packed else 1) else "ids"


def _localize_positions(op, arg, p, kind, want, mesh, data, data_name, data_placements):
    """This rank's slice of a position tensor. ``want`` maps each dim of p to
    the (offset, length) of the tokens/rows this rank rotates (None: whole)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        if p.device_mesh != mesh:
            _refuse(op, f"{arg} is on mesh {p.device_mesh} but {data[0]} is on mesh {mesh}; use one mesh")
        local, have = _local_range(p, op, arg)
        placed = f"{arg} has placements {_fmt(p.placements)}"
    else:
        local, have = p, (0,) * p.dim()
        placed = f"{arg} is a plain tensor (read as replicated)"
    for d in range(p.dim()):
        if want[d] is None or p.shape[d] == 1:
            if local.shape[d] != p.shape[d]:
                _refuse(
                    op,
                    f"{placed} but {data_name} {_fmt(data_placements)}: {arg} dim {d} is "
                    f"sharded while {data[0]} keeps that dim whole; replicate {arg}, or shard it exactly "
                    f"as {data[0]}",
                )
            continue
        off, n = want[d]
        lo = off - have[d]
        if lo < 0 or lo + n > local.shape[d]:
            _refuse(
                op,
                f"{placed} but {data_name} {_fmt(data_placements)}: this rank rotates "
                f"{arg}[{off}:{off + n}] along dim {d} and holds only [{have[d]}:{have[d] + local.shape[d]}]. "
                f"Shard {arg} ({kind}) the same way as the sequence/batch of {data[0]}, or replicate it",
            )
        if lo != 0 or n != local.shape[d]:
            local = local.narrow(d, lo, n)
    return local


def _global_stride(local, shape):
    """Contiguous strides over ``shape`` in the dim order of ``local``'s strides."""
    order = sorted(range(local.dim()), key=lambda d: (local.stride(d), d), reverse=True)
    stride, acc = [0] * local.dim(), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


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
        if t.device_mesh != mesh or tuple(t.placements) != placements:
            _refuse(
                op,
                f"{data[0]} has placements {_fmt(placements)} but {n} has {_fmt(t.placements)}; q and k "
                "must be sharded alike (the same placement on every mesh dim)",
            )

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
            _check_placements(op, n, bound[n], dims, packed)

    for n in data:
        if sharded:
            local[n], offset = _local_range(bound[n], op, n)
        else:
            local[n], offset = bound[n]._local_tensor, (0,) * x.ndim
        if n == data[0]:
            x_offset, x_local = offset, local[n]

    if sharded and bound.get("pair_axes") is not None:
        _refuse(op, "pair_axes (N-D positions) with sharded DTensor inputs is not supported; replicate q and k")
    if dims is not None:
        batch, _, seq, _ = dims
        seq_sharded = local[data[0]].shape[seq] != x.shape[seq]
        pos_args = [n for n in _POSITION_ARGS if bound.get(n) is not None]
        kinds = {n: _position_kind(n, bound[n], packed) for n in pos_args}
        for n in pos_args:
            p = bound[n]
            if kinds[n] == "offsets":
                # [] or [batch] (size 1 broadcasts)
                want = [None if batch is None else (x_offset[batch], x_local.shape[batch])] * p.dim()
            elif packed:
                want = [None] * p.dim()  # [total_tokens]; tokens are never sharded here
            elif p.dim() == 1:  # [seq]
                want = [(x_offset[seq], x_local.shape[seq])]
            else:  # [batch, seq]
                want = [(x_offset[batch], x_local.shape[batch]), (x_offset[seq], x_local.shape[seq])]
            local[n] = _localize_positions(op, n, p, kinds[n], want, mesh, data, data_name, placements)
        if seq_sharded and "ids" not in kinds.values():
            # No ids: token s of this shard is token seq_offset + s of the sequence.
            local["start_pos"] = bound.get("start_pos", 0) + x_offset[seq]
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
