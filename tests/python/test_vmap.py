"""torch.func.vmap of the ops (python/rotary/_vmap.py): one call with the
vmapped dim folded into the heads where only q / k / x are batched, one call
per slice elsewhere; in place written where the caller's tensors lie; a
written tensor that is not batched refused, untouched. Every result against
the float64 reference of each slice."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import rotary
from rotary_testing.prologue_reference import ref_prologue
from rotary_testing.reference import hf_cos_sin, rope_reference
from rotary_testing.rope_testing import TOL, cu_from_lens, layout_shape, randn, ref_rope4, ref_varlen

D, S, B, H, HK, V = 16, 5, 2, 3, 2, 4
FREQS = rotary.freqs_table(D, 64)
LENS = [3, 0, 2]


def vmapped(shape, dtype, seed, in_dim, device="cpu"):
    """V slices of `shape`, the vmapped dim at in_dim of the physical tensor."""
    t = randn((V,) + tuple(shape), dtype, seed, device)
    return t.movedim(0, in_dim).contiguous() if in_dim else t


def slices(t, in_dim):
    return t.movedim(in_dim, 0)


def rotary_calls(fn):
    """How many rotary ops the dispatcher ran: the vmapped call, then the
    rule's (apply_rope_cos_sin's add the op it is a composite of)."""
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return sum(1 for e in p.events() if e.name.startswith("rotary::"))


def shape_of(layout, h):
    return (sum(LENS), h, D) if layout == "THD" else layout_shape(layout, B, h, S, D)


def ref(x, layout, start, **kw):
    x = x.double()
    if layout == "THD":
        return ref_varlen(x, cu_from_lens(LENS), start=start, **kw)
    return ref_rope4(x, start=start, layout=layout, **kw)


def tol(dtype):
    return dict(zip(("rtol", "atol"), TOL[dtype]))


def layout_kw(layout, device="cpu"):
    return dict(layout="BHSD", cu_seqlens=cu_from_lens(LENS).to(device)) if layout == "THD" else dict(layout=layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BHSD", "BSHD", "SBHD", "THD"])
@pytest.mark.parametrize("in_dim", [0, 2, -1])
def test_shared_positions_make_one_call(device, layout, in_dim, dtype):
    """apply_rope, apply_rope_qk (k batched or shared), apply_rope_cos_sin and
    apply_qk_norm_rope with the vmapped dim anywhere: one call each, every
    slice its reference."""
    qs = vmapped(shape_of(layout, H), dtype, 1, in_dim, device)
    ks = vmapped(shape_of(layout, HK), dtype, 2, in_dim, device)
    k1, freqs = randn(shape_of(layout, HK), dtype, 3, device), FREQS.to(device)
    kw = layout_kw(layout, device)
    cases = {
        "apply_rope": (lambda q: rotary.apply_rope(q, freqs, 3, **kw), (qs,), lambda q: (ref(q, layout, 3),)),
        "apply_rope_qk": (lambda q, k: rotary.apply_rope_qk(q, k, freqs, 3, **kw), (qs, ks),
                          lambda q, k: (ref(q, layout, 3), ref(k, layout, 3))),
        "apply_rope_qk shared k": (lambda q: rotary.apply_rope_qk(q, k1, freqs, 3, **kw), (qs,),
                                   lambda q: (ref(q, layout, 3), ref(k1, layout, 3))),
    }
    if layout != "THD":
        cos, sin = (t.float().to(device) for t in hf_cos_sin(S, D, 3))
        cases["apply_rope_cos_sin"] = (
            lambda q, k: rotary.apply_rope_cos_sin(q, k, cos, sin, **kw), (qs, ks),
            lambda q, k: tuple(ref(t, layout, 3, interleaved=False) for t in (q, k)))
        w = 1.0 + 0.5 * randn((D,), torch.float32, 4, device)
        cases["apply_qk_norm_rope"] = (
            lambda q, k: rotary.apply_qk_norm_rope(q, k, freqs, 3, q_weight=w, k_weight=w, **kw), (qs, ks),
            lambda q, k: tuple(ref_prologue(t.double(), w, D, start=3, layout=layout) for t in (q, k)))
    for name, (fn, args, want) in cases.items():
        got = torch.func.vmap(fn, in_dims=in_dim)(*args)
        got = got if isinstance(got, tuple) else (got,)
        for i in range(V):
            for g, w_ in zip(got, want(*(slices(a, in_dim)[i] for a in args))):
                torch.testing.assert_close(g[i].cpu().double(), w_, **tol(dtype), msg=f"{name} slice {i}")
        one = 3 if name == "apply_rope_cos_sin" else 2  # per slice: 1 + 2 V, 1 + V
        assert rotary_calls(lambda: torch.func.vmap(fn, in_dims=in_dim)(*args)) == one, name


@pytest.mark.parametrize("in_dim", [0, -1])
def test_in_place_writes_the_callers_tensors(device, in_dim):
    """apply_rope_ and apply_rope_qk_ (q and k views of one packed qkv) under
    vmap: the vmapped tensors hold each slice's rotation. in_dim -1 puts the
    vmapped dim innermost, where the fold would be a copy: it runs per slice."""
    x, freqs = vmapped((B, S, H, D), torch.float64, 5, in_dim, device), FREQS.to(device)
    want = [ref_rope4(t, start=2, layout="BSHD") for t in slices(x, in_dim)]
    torch.func.vmap(lambda t: rotary.apply_rope_(t, freqs, 2, layout="BSHD"), in_dims=in_dim)(x)
    for i in range(V):
        torch.testing.assert_close(slices(x, in_dim)[i].cpu(), want[i])
    qkv = vmapped((B, S, H + 2 * HK, D), torch.float64, 6, in_dim, device)
    before = slices(qkv, in_dim).to("cpu", copy=True)

    def rotate(t):
        rotary.apply_rope_qk_(t[:, :, :H], t[:, :, H:H + HK], freqs, 1, layout="BSHD")
        return t
    torch.func.vmap(rotate, in_dims=in_dim)(qkv)
    after = slices(qkv, in_dim).cpu()
    for i in range(V):
        want = ref_rope4(before[i][:, :, :H + HK], start=1, layout="BSHD")
        torch.testing.assert_close(after[i][:, :, :H + HK], want)
        assert torch.equal(after[i][:, :, H + HK:], before[i][:, :, H + HK:])  # v untouched


def test_batched_positions_weights_and_heads_norm_run_per_slice():
    """A batched position_ids, norm weight or norm over all heads: one call
    per slice, each its reference."""
    x = randn((V, B, H, S, D), torch.float32, 7)
    ids = torch.randint(0, 60, (V, B, S), generator=torch.Generator().manual_seed(8))
    got = torch.func.vmap(lambda t, i: rotary.apply_rope(t, FREQS, position_ids=i))(x, ids)
    for i in range(V):
        torch.testing.assert_close(got[i].double(), ref_rope4(x[i], positions=ids[i]), **tol(torch.float32))
    calls = rotary_calls(lambda: torch.func.vmap(lambda t, i: rotary.apply_rope(t, FREQS, position_ids=i))(x, ids))
    assert calls == V + 1
    k, w = randn((V, B, HK, S, D), torch.float32, 9), 1.0 + 0.5 * randn((V, D), torch.float32, 10)
    wh = 1.0 + 0.5 * randn((H * D,), torch.float32, 11)
    SLICE = torch.logspace(0, 2, V).view(V, 1, 1, 1, 1)  # slices of other scales: a norm over all of them shows
    calls = {
        "batched weight": (lambda q, k, w: rotary.apply_qk_norm_rope(q, k, FREQS, q_weight=w, k_weight=w), (x, k, w),
                           lambda q, k, w: tuple(ref_prologue(t.double(), w, D) for t in (q, k))),
        "norm heads": (lambda q: rotary.apply_qk_norm_rope(q, k[0], FREQS, q_weight=wh, norm="heads"), (x,),
                       lambda q: (ref_prologue(q.double(), wh, D, norm="heads"),
                                  ref_prologue(k[0].double(), None, D, norm="heads"))),
        # No weight: the vmapped dim is not folded into the heads, each slice's heads are normed alone.
        "norm heads, no weight": (lambda q, k: rotary.apply_qk_norm_rope(q, k, FREQS, norm="heads"), (x * SLICE, k),
                                  lambda q, k: tuple(ref_prologue(t.double(), None, D, norm="heads") for t in (q, k))),
    }
    for name, (fn, args, want) in calls.items():
        got = torch.func.vmap(fn)(*args)
        for i in range(V):
            for g, w_ in zip(got, want(*(a[i] for a in args))):
                torch.testing.assert_close(g[i].double(), w_, **tol(torch.float32), msg=name)


def test_a_refused_slice_leaves_every_slice_untouched():
    """In place per slice (batched positions): the last slice's positions
    are past the table, so the call is refused and no slice is written, nor
    the packed qkv that q and k view."""
    x, qkv = randn((V, B, H, S, D), torch.float32, 22), randn((V, B, S, H + HK, D), torch.float32, 23)
    ids = torch.randint(0, 60, (V, B, S), generator=torch.Generator().manual_seed(24))
    ids[-1, 0, 0] = 64  # the table has 64 rows and no inv_freq
    x0, qkv0 = x.clone(), qkv.clone()
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 0\) has position 64"):
        torch.func.vmap(lambda t, i: rotary.apply_rope_(t, FREQS, position_ids=i))(x, ids)
    with pytest.raises(IndexError, match=r"token \(batch 0, seq 0\) has position 64"):
        torch.func.vmap(lambda t, i: rotary.apply_rope_qk_(t[:, :, :H], t[:, :, H:], FREQS, position_ids=i,
                                                           layout="BSHD"))(qkv, ids)
    assert torch.equal(x, x0) and torch.equal(qkv, qkv0)


def test_nested_vmap_and_an_empty_vmapped_dim():
    x = randn((3, V, B, H, S, D), torch.float64, 12)
    got = torch.func.vmap(torch.func.vmap(lambda t: rotary.apply_rope(t, FREQS, 4)))(x)
    torch.testing.assert_close(got, ref_rope4(x.reshape(3 * V * B, H, S, D), start=4).reshape(x.shape))
    ids = torch.zeros((0, B, S), dtype=torch.int64)
    for fn, args in ((lambda t: rotary.apply_rope(t, FREQS), (x[0, :0],)),
                     (lambda t, i: rotary.apply_rope(t, FREQS, position_ids=i), (x[0, :0], ids))):
        assert torch.func.vmap(fn)(*args).shape == (0, B, H, S, D)


def test_cache_write_per_slice():
    """apply_rope_with_kv_cache_ with every written tensor batched: each
    slice's cache holds its rotated k and its v at the rows written."""
    q, k, v = (randn((V, B, h, S, D), torch.float64, s) for s, h in ((13, H), (14, HK), (15, HK)))
    kc, vc = (torch.full((V, B, HK, 12, D), float("nan"), dtype=torch.float64) for _ in range(2))
    k0 = k.clone()
    torch.func.vmap(lambda *t: rotary.apply_rope_with_kv_cache_(*t, FREQS, 6))(q, k, v, kc, vc)
    for i in range(V):
        torch.testing.assert_close(kc[i][:, :, 6:6 + S], ref_rope4(k0[i], start=6))
        assert torch.equal(vc[i][:, :, 6:6 + S], v[i]) and kc[i][:, :, :6].isnan().all()


def test_a_shared_written_tensor_is_refused_untouched():
    """Every slice would write the same k (or cache): refused by name, and
    nothing is written."""
    q, k = randn((V, B, H, S, D), torch.float32, 16), randn((B, HK, S, D), torch.float32, 17)
    kc, vc = torch.zeros(B, HK, 8, D), torch.zeros(B, HK, 8, D)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RuntimeError, match=r"vmap: rotary::apply_rope_qk_ writes k in place, but k is not batched "
                                           r"while q is: every slice would write the same k"):
        torch.func.vmap(lambda t: rotary.apply_rope_qk_(t, k, FREQS))(q)
    with pytest.raises(RuntimeError, match=r"apply_rope_with_kv_cache_ writes k in place, but k is not batched "
                                           r"while q is"):
        torch.func.vmap(lambda t: rotary.apply_rope_with_kv_cache_(t, k, k, kc, vc, FREQS))(q)
    assert torch.equal(q, q0) and torch.equal(k, k0) and not kc.any() and not vc.any()


def test_memory_shared_across_slices_is_refused_untouched():
    """Each slice alone is a valid call, but together a slice would write
    what another reads or writes: x expanded on the vmapped dim, slice i of
    v inside slice i + 1 of k, an unbatched q_weight inside one slice of k.
    Refused by name before any slice is written (without the check, x turned
    V times and a v_cache row held a rotated k)."""
    x = randn((1, B, H, S, D), torch.float32, 25)
    x0 = x.clone()
    with pytest.raises(ValueError, match=r"vmap of rotary::apply_rope_: x has elements sharing memory"):
        torch.func.vmap(lambda t: rotary.apply_rope_(t, FREQS))(x.expand(V, B, H, S, D))
    with pytest.raises(ValueError, match=r"vmap of rotary::apply_qk_norm_rope_: q has elements sharing memory"):
        torch.func.vmap(lambda a, b: rotary.apply_qk_norm_rope_(a, b, FREQS))(
            x.expand(V, B, H, S, D), randn((V, B, HK, S, D), torch.float32, 26))
    assert torch.equal(x, x0)
    kv = randn((V + 1, B, HK, S, D), torch.float32, 27)  # k of slice i is kv[i + 1], v of slice i is kv[i]
    q = randn((V, B, H, S, D), torch.float32, 28)
    kc, vc = (torch.full((V, B, HK, 8, D), float("nan")) for _ in range(2))
    before = [t.clone() for t in (kv, q)]
    with pytest.raises(ValueError, match=r"vmap of rotary::apply_rope_with_kv_cache_: k and v overlap in memory"):
        torch.func.vmap(lambda *t: rotary.apply_rope_with_kv_cache_(*t, FREQS, 2))(q, kv[1:], kv[:V], kc, vc)
    weight = kv[-1, 0, 0, 0]  # read by every slice, written by the last
    with pytest.raises(ValueError, match=r"vmap of rotary::apply_qk_norm_rope_: k and q_weight overlap in memory"):
        torch.func.vmap(lambda a, b: rotary.apply_qk_norm_rope_(a, b, FREQS, q_weight=weight))(q, kv[1:])
    assert all(torch.equal(t, b) for t, b in zip((kv, q), before)) and kc.isnan().all() and vc.isnan().all()


def test_errors_name_the_callers_shapes():
    """A refused vmapped call names a slice's shape (what the caller passed),
    not the folded one; a refused in-place call writes nothing."""
    x = randn((V, B, H, S, 7), torch.float32, 18)
    x0 = x.clone()
    for fn in (lambda t: rotary.apply_rope(t, FREQS), lambda t: rotary.apply_rope_(t, FREQS)):
        with pytest.raises(ValueError, match=r"got 7 \(shape \[2, 3, 5, 7\]\)"):
            torch.func.vmap(fn)(x)
    assert torch.equal(x, x0)


def test_compiled_vmap_matches_reference():
    x = randn((V, B, H, S, D), torch.float32, 19)
    got = torch.compile(lambda t: torch.func.vmap(lambda a: rotary.apply_rope(a, FREQS, 2))(t), fullgraph=True)(x)
    for i in range(V):
        torch.testing.assert_close(got[i].double(), ref_rope4(x[i], start=2), **tol(torch.float32))


def test_compiled_in_place_per_slice_matches_reference():
    """A batched table runs one call per slice, behind the rule's whole-batch
    overlap check: traced, that check read every fake tensor's address as 0
    and refused the call ("x and freqs overlap")."""
    tables = torch.stack([FREQS, rotary.freqs_table(D, 64, theta=500.0)])
    x = randn((2, B, H, S, D), torch.float32, 22)
    y = x.clone()

    def fn(t, f):
        torch.func.vmap(lambda a, b: rotary.apply_rope_(a, b, 3))(t, f)
        return t

    torch.compile(fn, backend="aot_eager")(y, tables)
    for i, theta in enumerate((10000.0, 500.0)):
        want = rope_reference(x[i], 3, base=theta)
        torch.testing.assert_close(y[i].double(), want, **tol(torch.float32))


def test_fp8_q_with_a_scale_per_head():
    """q_fp8_scale [heads] under the fold: each slice's head h divided by
    scale[h]. Against the float64 reference divided and clamped the same way:
    within float8_e4m3fn's rounding (half a step of its 3-bit mantissa, or of
    its smallest subnormal); a scale taken from another head is off by 2.5x
    or more."""
    q, k = randn((V, B, H, S, D), torch.float32, 20), randn((B, HK, S, D), torch.float32, 21)
    scale = torch.tensor([0.004, 0.02, 0.05])
    q8, _ = torch.func.vmap(lambda t: rotary.apply_qk_norm_rope(t, k, FREQS, 1, q_fp8_scale=scale))(q)
    assert q8.dtype == torch.float8_e4m3fn
    for i in range(V):
        want = (ref_prologue(q[i].double(), None, D, start=1) / scale.double().view(1, H, 1, 1)).clamp(-448, 448)
        assert want.abs().max() == 448  # saturation is exercised
        err = (q8[i].double() - want).abs()
        assert (err <= want.abs() * 2**-4 + 2**-10).all(), f"slice {i}: off by up to {float(err.max())}"
