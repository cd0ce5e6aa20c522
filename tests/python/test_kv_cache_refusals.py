"""apply_rope_with_kv_cache_'s refused calls: a clear error, every tensor
bit-identical afterwards; q that requires grad; empty calls write nothing;
the version counters of what it writes. (Split from the old
test_kv_cache.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.kv_testing import FP8, KVCase, build
from rotary_testing.rope_testing import DTYPE_IDS, DTYPES, Snapshot

pytestmark = pytest.mark.usefixtures("reset_dynamo")


# ---------------------------------------------------------------------------
# Refused calls: a clear error, every tensor bit-identical afterwards.
# ---------------------------------------------------------------------------
def _bad(c=None, **changes):
    c = c or KVCase()
    args, kw, _, _ = build(c)
    args = list(args)
    for name, val in changes.items():
        if name in ("q", "k", "v", "kc", "vc", "f"):
            args[["q", "k", "v", "kc", "vc", "f"].index(name)] = val(args) if callable(val) else val
        elif val is None:
            kw.pop(name, None)
        else:
            kw[name] = val(args) if callable(val) else val
    return args, kw


def _paged(**kw):
    return KVCase(kv_layout="NHD", block=4, **kw)


ERRORS = {
    "position-past-cache": (lambda: _bad(KVCase(start=37, inv_freq=True)), IndexError, "max_seq_len 40"),
    "cache-position-past": (lambda: _bad(KVCase(pos="cache_positions"), cache_positions=lambda a: torch.full((2, 5), 40)), IndexError, "cache position 40"),
    "cache-position-negative": (lambda: _bad(KVCase(pos="cache_positions"), cache_positions=lambda a: torch.full((2, 5), -1)), IndexError, "cache position -1"),
    "slot-past-pool": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.full((2, 5), a[3].shape[0] * 4)), IndexError, "outside the paged cache"),
    "slot-below-minus-one": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.full((2, 5), -2)), IndexError, "-1 skips"),
    "no-slot-mapping": (lambda: _bad(_paged(), slot_mapping=None), ValueError, "needs slot_mapping"),
    "slot-mapping-contiguous": (lambda: _bad(KVCase(), slot_mapping=torch.zeros(2, 5, dtype=torch.long)), ValueError, "slot_mapping is for paged"),
    "cache-positions-paged": (lambda: _bad(_paged(), cache_positions=torch.zeros(2, 5, dtype=torch.long)), ValueError, "cache_positions is for contiguous"),
    "slot-mapping-shape": (lambda: _bad(_paged(), slot_mapping=torch.zeros(3, dtype=torch.long)), ValueError, "one entry per token"),
    # [batch, seq'] with the right batch: tokens past seq' would read past the destinations.
    "slot-mapping-short-seq": (lambda: _bad(_paged(), slot_mapping=torch.zeros(2, 4, dtype=torch.long)), ValueError, "got [2, 4]"),
    "cache-positions-short-seq": (lambda: _bad(KVCase(pos="cache_positions"), cache_positions=torch.zeros(2, 4, dtype=torch.long)), ValueError, "one entry per token, shape [batch, seq_len] = [2, 5]"),
    "slot-mapping-dtype": (lambda: _bad(_paged(), slot_mapping=lambda a: torch.zeros(2, 5)), TypeError, "slot_mapping must be int32 or int64"),
    "bad-kv-layout": (lambda: _bad(kv_layout="HSD"), ValueError, "kv_layout must be"),
    "cache-heads": (lambda: _bad(kc=lambda a: a[3][:, :1].clone(), vc=lambda a: a[4][:, :1].clone()), ValueError, "kv_heads = 2"),
    "cache-head-dim": (lambda: _bad(kc=lambda a: a[3][..., :8].clone(), vc=lambda a: a[4][..., :8].clone()), ValueError, "head_dim = 16"),
    "cache-batch": (lambda: _bad(kc=lambda a: a[3][:1].clone(), vc=lambda a: a[4][:1].clone()), ValueError, "one row per sequence"),
    "cache-shapes-differ": (lambda: _bad(vc=lambda a: a[4][:, :, :20].clone()), ValueError, "k_cache and v_cache must have one shape"),
    "cache-dtype": (lambda: _bad(kc=lambda a: a[3].double(), vc=lambda a: a[4].double()), TypeError, "float8_e4m3fn, got Double"),
    "cache-dtypes-differ": (lambda: _bad(vc=lambda a: a[4].to(FP8)), TypeError, "the two caches must share one dtype"),
    "cache-int8": (lambda: _bad(kc=lambda a: a[3].to(torch.int8), vc=lambda a: a[4].to(torch.int8)), TypeError, "got Char"),
    "cache-3d": (lambda: _bad(kc=lambda a: a[3][0], vc=lambda a: a[4][0]), ValueError, "k_cache must be 4-D"),
    "v-dtype": (lambda: _bad(v=lambda a: a[2].double()), TypeError, "k and v must share one dtype"),
    "v-shape": (lambda: _bad(v=lambda a: a[2][:, :1].clone()), ValueError, "v must have the shape of k"),
    "k-heads-vs-q": (lambda: _bad(k=lambda a: a[1][..., :8].clone()), ValueError, "k must match q"),
    "k-aliases-cache": (lambda: _bad(k=lambda a: a[3][:, :, :5]), ValueError, "overlap in memory"),
    "v-aliases-cache": (lambda: _bad(v=lambda a: a[4][:, :, 10:15]), ValueError, "overlap in memory"),
    "v-is-k": (lambda: _bad(v=lambda a: a[1]), ValueError, "v would be read after k is rotated"),
    "caches-alias": (lambda: _bad(vc=lambda a: a[3]), ValueError, "k_cache and v_cache overlap"),
    "cache-expanded": (lambda: _bad(kc=lambda a: a[3][:, :1].expand(2, 2, 40, 16)), ValueError, "elements sharing memory"),
    "scale-without-fp8": (lambda: _bad(k_scale=torch.tensor(1.0)), ValueError, "only for float8_e4m3fn"),
    "scale-dtype": (lambda: _bad(KVCase(fp8="tensor"), k_scale=torch.tensor(1.0, dtype=torch.float64)), TypeError, "k_scale must be float32"),
    "scale-shape": (lambda: _bad(KVCase(fp8="tensor"), v_scale=torch.ones(3)), ValueError, "[kv_heads] = [2]"),
    "position-ids-with-start": (lambda: _bad(KVCase(pos="ids"), start_pos=2), ValueError, "start_pos must be 0 with position_ids"),
    "past-table": (lambda: _bad(KVCase(start=30)), IndexError, "exceeds the freqs table length"),
    "cu-seqlens-bad": (lambda: _bad(KVCase(lens=[2, 3]), cu_seqlens=torch.tensor([0, 3, 4])), ValueError, "cu_seqlens must start at 0"),
    # Packed: the op's batch of 1 is not the caller's; [total_tokens] is asked for.
    "varlen-cache-positions-shape": (lambda: _bad(KVCase(lens=[2, 3], pos="cache_positions"), cache_positions=torch.zeros(2, 3, dtype=torch.long)), ValueError, "cache_positions must have one entry per token, shape [total_tokens] = [5] (with cu_seqlens), got [2, 3]"),
    "varlen-cache-rows": (lambda: _bad(KVCase(lens=[2, 3]), kc=lambda a: torch.zeros(3, 2, 40, 16), vc=lambda a: torch.zeros(3, 2, 40, 16)), ValueError, "num_seqs of cu_seqlens"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_refused_calls_write_nothing(case):
    make, exc, text = ERRORS[case]
    args, kw = make()
    snap = Snapshot(*args)
    with pytest.raises(exc, match=pytest.importorskip("re").escape(text)):
        rotary.apply_rope_with_kv_cache_(*args, **kw)
    snap.check()


def test_requires_grad_refused():
    args, kw, _, _ = build(KVCase())
    args[0].requires_grad_(True)
    with pytest.raises(ValueError, match="q requires grad"):
        rotary.apply_rope_with_kv_cache_(*args, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty(dtype):
    c = KVCase(dtype=dtype, S=0)
    args, kw, _, _ = build(c)
    snap = Snapshot(*args)
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    snap.check()


def test_version_counters_bumped():
    args, kw, _, _ = build(KVCase())
    before = [t._version for t in args]
    rotary.apply_rope_with_kv_cache_(*args, **kw)
    after = [t._version for t in args]
    assert [a > b for a, b in zip(after, before)] == [True, True, False, True, True, False]


@pytest.mark.parametrize("call,match", [
    (lambda: rotary.KVCache(1, 2, 4, 8, dtype="float32"), r"KVCache: dtype must be a torch.dtype, got 'float32'"),
    (lambda: rotary.KVCache(1, 2, 4, 8, dtype=None), r"KVCache: dtype must be a torch.dtype, got None"),
    (lambda: rotary.KVCache(1, 2, 4, 8, layout=None), r"KVCache: layout must be a str, got None"),
    (lambda: rotary.KVCache(1, 2, 4, 8).keys_values("float64"),
     r"KVCache.keys_values: dtype must be a torch.dtype, got 'float64'"),
    (lambda: rotary.KVCache(1, 2, 4, 8).truncate(None), r"KVCache.truncate: length must be an int, got None"),
])
def test_argument_types_are_named(call, match):
    # pybind's own errors ("Expected dtype", "incompatible constructor arguments") named neither.
    with pytest.raises(TypeError, match=match):
        call()


def test_aliasing_the_fused_op_refuses_by_name_and_writes_nothing():
    """A v that is a view of q (read after q is rotated), positions or
    inv_freq inside a cache, cache_positions or a scale inside q: refused,
    every tensor untouched. A mutation run found no test that sent them."""
    f = rotary.freqs_table(8, 32)

    def fresh():
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(2, h, 3, 8, generator=g) for h in (4, 2, 2))
        return q, k, v, torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)

    def ids_in(t, dtype, n, fill):  # n elements of `dtype` over t's last row
        view = t.view(dtype)[1, 1, -1, :n]
        view.copy_(fill)
        return view

    inv = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cases = [
        (lambda q, k, v, kc, vc: dict(v=q[:, :2]), "q and v overlap in memory; in place, v would be read after q"),
        (lambda q, k, v, kc, vc: dict(position_ids=ids_in(kc, torch.int64, 3, torch.arange(3))),
         "k_cache and position_ids overlap in memory"),
        (lambda q, k, v, kc, vc: dict(inv_freq=ids_in(vc, torch.float64, 4, inv)), "v_cache and inv_freq overlap"),
        (lambda q, k, v, kc, vc: dict(cache_positions=ids_in(q, torch.int64, 3, torch.arange(3)).expand(2, 3)),
         "q and cache_positions overlap in memory"),
    ]
    for op in (torch.ops.rotary.apply_rope_with_kv_cache_, rotary.apply_rope_with_kv_cache_):
        for make, words in cases:
            q, k, v, kc, vc = fresh()
            kw = make(q, k, v, kc, vc)
            snap = Snapshot(q, k, v, kc, vc)
            with pytest.raises(ValueError, match=pytest.importorskip("re").escape(words)):
                op(q, k, kw.pop("v", v), kc, vc, f, **kw)
            snap.check()
        q, k, v, kc, vc = fresh()
        q[0, 0, 0, 0] = 1.0
        kc8, vc8 = kc.to(FP8), vc.to(FP8)
        snap = Snapshot(q, k, v, kc8, vc8)
        with pytest.raises(ValueError, match=r"q and k_scale overlap in memory"):
            op(q, k, v, kc8, vc8, f, k_scale=q[0, 0, 0, 0])
        snap.check()
