"""The pieces of the DTensor rules (distributed.py, _distributed_kv.py): schema
binding, placement checks, local ranges and position localizing, each rank
computing from its own spec with no communication (but whole_positions, the
modules' all-gather for their host-driven rules)."""

import torch

_DIMS = {  # layout -> (batch, heads, seq, head_dim) tensor dims
    "BHSD": (0, 1, 2, 3),
    "BSHD": (0, 2, 1, 3),
    "SBHD": (1, 2, 0, 3),
}

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
_CHECKED = {}  # (op, the call's shapes, dtypes and options) -> True: the global call passed the op's checks
_CACHE_MAX = 4096


def _cached(cache, key, make):
    v = cache.get(key)
    if v is None:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        v = cache[key] = make()
    return v


def _signature(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.dtype)
    return tuple(v) if isinstance(v, list) else v


def check_global(op, bound):
    """The op's own checks on the call as a whole: the global shapes, dtypes
    and options, run by the op's Meta kernel (so a position tensor, scale or
    start_pos the plain call refuses is refused in its words, on every rank,
    before anything is sliced per rank). Values: check_values."""
    key = (op,) + tuple((n, _signature(v)) for n, v in bound.items())
    try:
        if key in _CHECKED:
            return
    except TypeError:  # an unhashable option: check, do not remember
        key = None

    def meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")

    _call(op, {n: meta(v) for n, v in bound.items()})
    if key is not None:
        _cached(_CHECKED, key, lambda: True)


def check_values(op, bound, local, data, dims, positions):
    """The op's own value checks on the whole call (positions against the
    table, start_pos + seq_len), before any rank rotates: a rank's local call
    sees only its tokens, so alone it would refuse on the rank holding a bad
    position while the others write. The call runs on stand-ins of the
    rotated tensors with no heads (every check, nothing rotated) and the
    positions every rank holds whole. [B] offsets cut like the batch are this
    rank's rows over the whole sequence (alike on the ranks that split their
    tokens); sharded ids stay each rank's to check."""
    from torch.distributed.tensor import DTensor

    call = dict(local, start_pos=bound["start_pos"])  # local: the replicated arguments, whole
    rows = None  # the batch rows checked: all, or this rank's
    for n in positions:
        p = bound.get(n)
        if isinstance(p, DTensor):
            if not all(pl.is_replicate() for pl in p.placements):
                mine = local.get(n)
                if n != "offsets" or dims[0] is None or isinstance(mine, DTensor) or mine.dim() != 1:
                    return
                p, rows = mine, mine.shape[0]
            else:
                p = p._local_tensor
        call[n] = p
    for n in data:
        shape = list(bound[n].shape)
        shape[dims[1]] = 0
        if rows is not None:
            shape[dims[0]] = rows
        call[n] = bound[n]._local_tensor.new_empty(shape)
    # What is sized by the heads follows them to none (each rank's call checks its values).
    for n in ("q_weight", "k_weight") if bound.get("norm") == "heads" else ():
        if call.get(n) is not None:
            call[n] = call[n][:0]
    scale = call.get("q_fp8_scale")
    if scale is not None and scale.dim() == 1 and scale.shape[0] > 1:
        call["q_fp8_scale"] = scale[:0]
    _call(op, call)


def _fmt(placements):
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def sharded_dims(placements, ndim):
    """The tensor dims a DTensor's placements shard (on any mesh dim)."""
    return {p.dim % ndim for p in placements if p.is_shard()}


class _Refuse(ValueError):
    pass


def _refuse(op, msg):
    raise _Refuse(f"rotary.{op._schema.name.split('::')[-1]} on DTensor: {msg}")


def _refuse_plain_data(op, some, data):
    """An option (a table, positions) is a DTensor, the rotated tensors are not."""
    names = " and ".join(data)
    plain = "are plain tensors" if len(data) > 1 else "is a plain tensor"
    _refuse(op, f"{some} is a DTensor but {names} {plain}; pass {some}.to_local() (or .full_tensor()), or make "
                f"{names} DTensors")


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
    the shard lies (DTensor.from_local with a shape= its shards do not
    follow; without shape= the spec follows the local shard, even or not)."""
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


def _check_placements(op, name, t, dims, packed, linear):
    """Refuse the placements of a rotated tensor that have no local rule. A
    rotation is linear: Partial(sum / avg) rotates term by term (the backward
    of a replicated output feeding a sharded matmul gets one); a norm is not."""
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
        if isinstance(p, Partial) and linear and p.reduce_op in ("sum", "avg"):
            continue
        if isinstance(p, Partial):
            _refuse(
                op,
                f"{name} has placement {p!r} on mesh dim {i}; "
                + ("a norm needs whole values" if linear is False and p.reduce_op in ("sum", "avg")
                   else "only Partial(sum) or Partial(avg) rotates term by term")
                + f": reduce it first, then {ok_hint}",
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


def _check_position_placements(who, arg, p, data):
    """Positions are read as whole values: Replicate or Shard only."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    for i, pl in enumerate(p.placements):
        if type(pl) not in (Replicate, Shard):  # Partial, _StridedShard: no local reading
            raise _Refuse(f"{who} on DTensor: {arg} has placement {pl!r} on mesh dim {i}; each rank reads its "
                          f"positions as whole values: replicate {arg}, or shard it as the sequence/batch of {data}")


def whole_positions(t, arg="position_ids"):
    """A sharded positions DTensor as every rank's values (an all-gather):
    the modules' host-driven rules (dynamic, longrope) size the table by the
    largest position of the call, on every rank alike. Anything else as is."""
    full = getattr(t, "full_tensor", None) if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor else None
    if full is None:
        return t
    _check_position_placements("RotaryEmbedding", arg, t, "q")
    return full()


def _position_kind(arg, p, packed):
    if arg == "offsets":
        return "offsets"
    if arg == "position_ids":
        return "ids"
    return "offsets" if p.dim() <= (0 if packed else 1) else "ids"


def _localize_positions(op, arg, p, kind, want, mesh, data, data_name, data_placements, packed=False):
    """This rank's slice of a position tensor. ``want`` maps each dim of p to
    the (offset, length, broadcasts) of the tokens/rows this rank rotates
    (None: whole; packed: every dim, as packed tokens are never split)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        if p.device_mesh != mesh:
            _refuse(op, f"{arg} is on mesh {p.device_mesh} but {data[0]} is on mesh {mesh}; use one mesh")
        _check_position_placements(f"rotary.{op._schema.name.split('::')[-1]}", arg, p, data[0])
        local, have = _local_range(p, op, arg)
        placed = f"{arg} has placements {_fmt(p.placements)}"
        # By placement, not by this rank's shard: a sharded size-1 dim is whole
        # on one rank and empty on the others, which must refuse alike.
        sharded = sharded_dims(p.placements, p.dim())
    else:
        local, have = p, (0,) * p.dim()
        placed = f"{arg} is a plain tensor (read as replicated)"
        sharded = set()
    for d in range(p.dim()):
        # Whole, or a size-1 dim that broadcasts.
        if want[d] is None or (want[d][2] and p.shape[d] == 1):
            if d in sharded or local.shape[d] != p.shape[d]:
                why = (f"{arg} dim {d} has size 1 and broadcasts, so every rank reads it whole; replicate {arg}"
                       if want[d] is not None else
                       f"{arg} dim {d} is sharded, but with cu_seqlens every rank reads {arg} whole (packed "
                       f"tokens are never split across ranks); replicate {arg}" if packed else
                       f"{arg} dim {d} is sharded while {data[0]} keeps that dim whole; replicate {arg}, or "
                       f"shard it exactly as {data[0]}")
                _refuse(op, f"{placed} but {data_name} {_fmt(data_placements)}: {why}")
            continue
        off, n, _ = want[d]
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


def layout_dims(bound, x):
    """(batch, heads, seq, head_dim) dims of the rotated tensor x in the
    call's layout (packed [tokens, heads, head_dim]: no batch dim), or None
    for a shape the op does not take (its own validator then says why)."""
    packed = bound.get("cu_seqlens") is not None
    dims = (None, 1, 0, 2) if packed else _DIMS.get(bound.get("layout", "BHSD"))
    return dims if dims is not None and x.ndim == (3 if packed else 4) else None


def out_spec(like, t):
    """The spec of a local output t whose input had spec ``like``: like's
    mesh, placements and global shape, t's dtype, contiguous global strides
    in t's dim order."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = _global_stride(t, like)
    return _cached(_OUT_SPECS, (like, stride, t.dtype),
                   lambda: DTensorSpec(like.mesh, like.placements, tensor_meta=TensorMeta(like.shape, stride, t.dtype)))


def _global_stride(local, like):
    """Contiguous strides over ``like``'s global shape in the dim order of
    ``local``'s strides. A shard's size-1 dim ties with its neighbour: ties
    go by ``like``'s global strides, which every rank shares (each rank must
    build the same spec, or the next collective waits for ever)."""
    shape, n = like.shape, local.dim()
    rank = {d: i for i, d in enumerate(sorted(range(n), key=lambda d: (-like.stride[d], d)))}
    order = sorted(range(n), key=lambda d: (-local.stride(d), rank[d]))
    stride, acc = [0] * n, 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def _refuse_heads_norm(op, placements, ndim, heads_dim):
    """norm="heads" reduces over every head of a token: not on head shards."""
    for i, p in enumerate(placements):
        if p.is_shard() and p.dim % ndim == heads_dim:
            _refuse(op, f"norm='heads' normalizes over all heads of a token, but q and k are Shard({heads_dim}) "
                        f"(heads) on mesh dim {i}: each rank holds part of the variance. Use norm='head', "
                        "replicate the heads, or all-reduce the sum of squares before a per-rank call")
