"""The DTensor rule of ``apply_rope_with_kv_cache_`` (and of
``apply_qk_norm_rope_with_kv_cache_``, whose weights are replicated and
whose norm over all heads is refused on head shards): tensor parallel only.

q, k, v and both caches are Replicate or Shard(heads) on every mesh dim, the
caches sharded on their own heads dim (kv_layout BHSD / HND: 1, BSHD / NHD:
2) wherever q is. Each rank rotates its heads and writes them into its cache
shard: slots and cache positions name tokens, not heads, so they stay whole.
A per-head scale is cut to the rank's heads. Other placements (batch or
sequence shards, which would need slots renumbered per rank) are refused;
positions, slots, scales and tables are plain tensors or replicated DTensors.
"""

from . import _C, _dtensor_plans as _plans
from ._dtensor_shards import (_bind, _call, _fmt, _local_range, _refuse, _whole, _refuse_heads_norm, check_global,
                              layout_dims)

_DATA = ("q", "k", "v")
_CACHES = ("k_cache", "v_cache")
_WHOLE = ("freqs", "inv_freq", "cu_seqlens", "offsets", "position_ids", "cache_positions", "slot_mapping",
          "q_weight", "k_weight", "q_fp8_scale")
_CACHE_HEADS = {"BHSD": 1, "HND": 1, "BSHD": 2, "NHD": 2}
_WHY = "tensor-parallel cache writes need all of it on every rank"


def kv_handler(op, args, kwargs):
    key = _plans.plan_key(op, args, kwargs)
    if _plans.run(op, args, kwargs, key) is _plans.MISS:
        _rule(op, args, kwargs, key)


def _rule(op, args, kwargs, key):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Replicate, Shard

    bound = _bind(op, args, kwargs)
    names = _DATA + _CACHES
    plain = [n for n in names if not isinstance(bound[n], DTensor)]
    if plain:
        _refuse(
            op,
            f"{', '.join(plain)} {'is a plain tensor' if len(plain) == 1 else 'are plain tensors'}; pass q, k, v, "
            "k_cache and v_cache all as DTensors on one mesh (DTensor.from_local or distribute_tensor)",
        )
    check_global(op, bound)  # the plain op's checks on the whole call
    q = bound["q"]
    mesh, placements = q.device_mesh, tuple(q.placements)
    dims = layout_dims(bound, q)
    cache_heads = _CACHE_HEADS.get(bound.get("kv_layout", "BHSD"))
    if dims is None or cache_heads is None:
        dims = None  # not a shape the op takes: its own validator says why
    heads = None if dims is None else dims[1]
    want_cache = []
    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            want_cache.append(p)
            continue
        if dims is None or not isinstance(p, Shard) or p.dim % q.ndim != heads:
            _refuse(
                op,
                f"q has placement {p!r} on mesh dim {i}; the fused KV-cache write is computed locally for "
                f"Replicate and Shard(dim={heads}) (heads, tensor parallel) only: replicate or shard heads",
            )
        want_cache.append(Shard(cache_heads))
    for n in _DATA[1:]:
        t = bound[n]
        if t.device_mesh != mesh or tuple(t.placements) != placements:
            _refuse(op, f"q has placements {_fmt(placements)} but {n} has {_fmt(t.placements)}; place them alike")
    for n in _CACHES:
        t = bound[n]
        if t.device_mesh != mesh or tuple(t.placements) != tuple(want_cache):
            _refuse(
                op,
                f"q has placements {_fmt(placements)}, so {n} must have {_fmt(want_cache)} (its heads dim "
                f"{cache_heads} for kv_layout {bound.get('kv_layout', 'BHSD')}), got {_fmt(t.placements)}",
            )

    local = dict(bound)
    sharded = any(isinstance(p, Shard) for p in placements)
    if sharded and bound.get("norm") == "heads":
        _refuse_heads_norm(op, placements, q.ndim, heads)
    for n in names:
        if sharded:
            local[n], offset = _local_range(bound[n], op, n)
            if n == "k":
                lo, n_heads = offset[heads], local[n].shape[heads]
        else:
            local[n] = bound[n]._local_tensor
    for n in _WHOLE:
        if bound.get(n) is not None:
            local[n] = _whole(op, n, bound[n], mesh, _WHY)
    for n in ("k_scale", "v_scale"):
        s = bound.get(n)
        if s is None:
            continue
        s = local[n] = _whole(op, n, s, mesh, _WHY)
        if sharded and s.dim() == 1 and s.shape[0] > 1:  # per head: this rank's heads
            if s.shape[0] != bound["k"].shape[heads]:
                _refuse(op, f"{n} has {s.shape[0]} entries but k has {bound['k'].shape[heads]} kv heads")
            # Whole first: a bad head's rank alone would refuse while the others write.
            _C.check_scale_values(op._schema.name.split("::")[-1], n, s, "the cache stores")
            local[n] = s.narrow(0, lo, n_heads)
    _call(op, local)
    _plans.remember(key if _plans.is_trivial(bound, local) else None, None)
