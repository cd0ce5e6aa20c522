"""The in-place ops under the default inductor backend, and the real view of
the table (``torch.view_as_real(freqs)``) they take there: the inductor cannot
decompose an in-place custom op with a complex input, so the Python wrappers
pass that view while compiling."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, randn, ref_rope4

pytestmark = pytest.mark.usefixtures("reset_dynamo")


@pytest.mark.parametrize("conj", [False, True])
def test_inductor_inplace_qk_fresh_and_graph_inputs(tables, conj):
    f = tables(16, 32)
    table = f.conj() if conj else f

    def fresh(q, k):
        q, k = q * 1.0, k * 1.0
        rotary.apply_rope_qk_(q, k, table, 3)
        return q + 0.5, k

    def inputs(q, k):
        rotary.apply_rope_qk_(q, k, table, 3, interleaved=False)
        return q, k

    q, k = randn((2, 4, 5, 16), seed=301), randn((2, 2, 5, 16), seed=302)
    got = torch.compile(fresh, fullgraph=True)(q, k)
    assert_close_ref(got[0] - 0.5, ref_rope4(q, None, 3, True, inverse=conj), torch.float32)
    assert_close_ref(got[1], ref_rope4(k, None, 3, True, inverse=conj), torch.float32)

    q2, k2 = q.clone(), k.clone()
    torch.compile(inputs, fullgraph=True)(q2, k2)  # the graph inputs themselves are rotated
    assert_close_ref(q2, ref_rope4(q, None, 3, False, inverse=conj), torch.float32)
    assert_close_ref(k2, ref_rope4(k, None, 3, False, inverse=conj), torch.float32)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_inplace_single_with_a_conjugated_table(tables, backend):
    """A lazily conjugated table holds e^{-i angle}: traced, the in-place op
    is given the plain memory with inverse flipped, as eagerly."""
    f = tables(8, 16)
    x = randn((1, 2, 4, 8), seed=303)
    got = torch.compile(lambda t: rotary.apply_rope_(t, f.conj(), 0, False), backend=backend, fullgraph=True)(x.clone())
    assert_close_ref(got, ref_rope4(x, None, 0, False, inverse=True), torch.float32)


def test_inductor_inplace_single_bf16_position_ids(tables):
    f = tables(8, 32)
    ids = torch.tensor([[4, 0, 9], [1, 2, 3]])

    def fn(x):
        rotary.apply_rope_(x, f, position_ids=ids)
        return x

    x = randn((2, 3, 3, 12), torch.bfloat16, seed=303)
    want = rotary.apply_rope(x, f, position_ids=ids)
    got = torch.compile(fn, fullgraph=True)(x.clone())
    assert torch.equal(got, want)
    assert_close_ref(got, ref_rope4(x, 8, 0, True, ids), torch.bfloat16)


@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_", "apply_rope_qk", "apply_rope_qk_"])
@pytest.mark.parametrize("conj", [False, True])
def test_real_view_of_the_table_gives_the_same_bits(tables, op, conj):
    f = tables(16, 32).conj() if conj else tables(16, 32)
    real = torch.view_as_real(f.resolve_conj())
    q, k = randn((1, 3, 6, 16), seed=304), randn((1, 1, 6, 16), seed=305)
    fn = getattr(torch.ops.rotary, op)
    args = (q.clone(), k.clone()) if "qk" in op else (q.clone(),)
    ref_args = tuple(a.clone() for a in args)
    got = fn(*args, real, 2, True, inv_freq=rotary.inv_frequencies(16)[0])
    want = fn(*ref_args, f, 2, True, inv_freq=rotary.inv_frequencies(16)[0])
    if op.endswith("_"):
        got, want = args, ref_args
    for a, b in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, (tuple, list)) else [want]):
        assert torch.equal(a, b)


def test_real_view_opcheck(tables):
    real = torch.view_as_real(tables(8, 16))
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk_.default, (randn((1, 2, 4, 8)), randn((1, 1, 4, 8)), real, 1))
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, (randn((1, 2, 4, 8), torch.float64).requires_grad_(), real))


def test_a_real_table_that_is_not_a_view_as_real_is_refused(tables):
    real = torch.view_as_real(tables(8, 16))
    x = randn((1, 2, 3, 8))
    before = x.clone()
    with pytest.raises(ValueError, match=r"apply_rope_: a float32 freqs must be torch.view_as_real of the complex64 "
                                         r"table, \[max_seq_len, rotary_dim / 2, 2\] with its last dim contiguous; "
                                         r"got shape \[16, 4, 2\] and strides \[1, 16, 64\]"):
        rotary.apply_rope_(x, real.permute(2, 1, 0).contiguous().permute(2, 1, 0))
    with pytest.raises(ValueError, match=r"freqs must have shape \[max_seq_len, rotary_dim / 2\]"):
        rotary.apply_rope_(x, torch.view_as_real(tables(16, 16)))  # wider than the head
    with pytest.raises(TypeError, match=r"freqs must be complex64 .* or its torch.view_as_real view, got Double"):
        rotary.apply_rope_(x, real.double())
    assert torch.equal(x, before)


def test_inplace_on_a_view_with_a_symbolic_offset(tables):
    """k = qkv[..., H:2H] with H dynamic: its storage offset H * D is symbolic,
    and the inductor drops it for a mutated view (it rotated q's heads and
    left k as it was). apply_rope_ is traced as apply_rope + copy_; the ops
    that write two tensors are refused by name."""
    D, f = 16, tables(16, 64)

    def rope_k(qkv, H):
        k = qkv.view(qkv.shape[0], qkv.shape[1], 3 * H, D)[:, :, H:2 * H]
        rotary.apply_rope_(k, f, 3, layout="BSHD")

    def rope_qk(qkv, H):
        t = qkv.view(qkv.shape[0], qkv.shape[1], 3 * H, D)
        rotary.apply_rope_qk_(t[:, :, :H], t[:, :, H:2 * H], f, 3, layout="BSHD")

    c_k, c_qk = torch.compile(rope_k, fullgraph=True), torch.compile(rope_qk, fullgraph=True)
    for H in (4, 3, 2):  # the second call recompiles with H dynamic
        base = randn((2, 5, 3 * H * D), seed=310 + H)
        x = base.clone()
        c_k(x, H)
        heads = base.view(2, 5, 3 * H, D)
        want = heads.double().clone()
        want[:, :, H:2 * H] = ref_rope4(heads[:, :, H:2 * H], None, 3, True, layout="BSHD")
        assert_close_ref(x.view(2, 5, 3 * H, D), want, torch.float32)
    c_qk(randn((2, 5, 3 * 4 * D), seed=320), 4)  # static: served
    base = randn((2, 5, 3 * 3 * D), seed=321)
    y = base.clone()
    with pytest.raises(Exception, match=r"apply_rope_qk_: k is a view whose storage offset is symbolic .* call the "
                                         r"out-of-place op and copy_ its results"):
        c_qk(y, 3)
    assert torch.equal(y, base)


def test_symbolic_offset_rewrite_refuses_inputs_in_xs_storage(tables):
    """The apply_rope_ rewrite above loses the op's overlap checks: a table
    or offsets read from x's own buffer were accepted (and x written), where
    eager refuses them. Refused by name, nothing written."""
    D, f = 8, tables(8, 64)

    def x_over_offsets(buf, h):
        H = h.shape[0]
        x = buf[H * D: H * D + 4 * D].view(1, 1, 4, D)  # storage offset H * D, symbolic
        rotary.apply_rope_(x, f, 0, offsets=buf.view(torch.int32)[H * D + 5].view(()))

    def x_over_freqs(buf, h):
        H = h.shape[0]
        rotary.apply_rope_(buf[H * D: H * D + 4 * D].view(1, 1, 4, D),
                           torch.view_as_complex(buf[:64 * D].view(64, D // 2, 2)), 0)

    for fn, name in ((x_over_offsets, "offsets"), (x_over_freqs, "freqs")):
        buf = torch.zeros(100 * D)
        buf[:64 * D] = torch.view_as_real(f).reshape(-1)
        buf.view(torch.int32)[3 * D + 5] = 2
        before = buf.clone()
        with pytest.raises(Exception, match=rf"apply_rope_: x and {name} share one storage, and x is a view whose "
                                            r"storage offset is symbolic"):
            torch.compile(fn, fullgraph=True, dynamic=True)(buf, torch.empty(3))
        assert torch.equal(buf, before)


def test_a_written_slice_of_an_input_that_starts_past_0(tables):
    """An input that is itself a view (a layer of a stacked cache) and a slice
    of it written inside: torch 2.11 regenerated the slice from a start that
    counts the input's own offset, so the rotation was dropped (or landed on
    other rows). apply_rope_ is traced as apply_rope + copy_; the ops that
    write two tensors are refused by name, nothing written."""
    D, f = 16, tables(16, 64)

    def rope_rows(cache, new, p):
        rows = cache[:, :, p:p + new.shape[2]]
        rows.copy_(new)
        rotary.apply_rope_(rows, f, p, False)

    def rope_qk(qkv):
        rotary.apply_rope_qk_(qkv[:, :, :4], qkv[:, :, 4:6], f, 2, layout="BSHD")

    stacked, new = randn((4, 2, 2, 32, D), seed=340), randn((2, 2, 3, D), seed=341)
    want = stacked.double()
    want[2, :, :, 5:8] = ref_rope4(new, None, 5, False)
    torch.compile(rope_rows, fullgraph=True, backend="aot_eager")(stacked[2], new, 5)
    assert_close_ref(stacked, want, torch.float32)
    # An input whose slices' offsets are no multiple of the cut dim's stride: torch regenerates
    # them with as_strided, at the right place, so it is served as before.
    flat = randn((3 + 2 * 5 * 8 * D,), seed=343)
    near = flat[3:].view(2, 5, 8, D)
    want = near.double().clone()
    want[:, :, :4] = ref_rope4(near[:, :, :4], None, 2, True, layout="BSHD")
    want[:, :, 4:6] = ref_rope4(near[:, :, 4:6], None, 2, True, layout="BSHD")
    torch.compile(rope_qk, fullgraph=True, backend="aot_eager")(near)
    assert_close_ref(near, want, torch.float32)
    torch._dynamo.reset()  # the graph above has no guard on the input's storage offset
    big = randn((3, 2, 5, 8, D), seed=342)
    before = big.clone()
    with pytest.raises(Exception, match=r"apply_rope_qk_: q is a slice of a tensor that itself starts at storage "
                                        r"offset 1280 \(a compiled function's input that is a view"):
        torch.compile(rope_qk, fullgraph=True, backend="aot_eager")(big[1])
    assert torch.equal(big, before)


@pytest.mark.parametrize("strides", [(7, 3, 5, 1), (0, 3 * 16, 16, 1)], ids=["overlapping", "expanded"])
def test_compiled_in_place_on_elements_sharing_memory_is_refused(tables, strides):
    """x's elements share memory: eager refuses. Compiled with a symbolic
    offset (apply_rope_ rewritten as apply_rope + copy_) the rewrite wrote
    the shared elements; with an expanded x torch failed with a division by
    zero. Both are refused with eager's message, nothing written."""
    f = tables(8, 64)

    def fn(buf, n):
        rotary.apply_rope_(buf[:, n:n + 2], f, 3)

    store = randn((1000,), seed=330)
    buf = store.as_strided((2, 8, 3, 8), strides)
    before = store.clone()
    with torch._inductor.config.patch(force_disable_caches=True):  # traced, not a cached graph
        for call in (fn, torch.compile(fn, fullgraph=True, dynamic=True)):
            with pytest.raises(Exception, match=r"apply_rope_: x has elements sharing memory"):
                call(buf, 2)
            assert torch.equal(store, before)


def test_views_of_one_tensor_made_inside_the_compiled_function():
    """Caches (or q and k) that are views of one tensor, cut inside the
    compiled function, are written as eagerly. (Passed in as two separate
    graph inputs, torch 2.11's inductor miscompiles any in-place custom op
    writing both: docs/kv_cache.md, "torch.compile".)"""
    f = rotary.freqs_table(16, 64)
    slots = torch.tensor([[0, 5, 9], [30, -1, 12]])

    def step(q, k, v, kv, t):
        rotary.apply_rope_with_kv_cache_(q, k, v, kv[0], kv[1], f, 0, layout="BSHD", kv_layout="NHD",
                                         slot_mapping=slots)
        rotary.apply_rope_qk_(t[0], t[1], f, 1)

    base = [randn((2, 3, 4, 16), seed=1), randn((2, 3, 2, 16), seed=2), randn((2, 3, 2, 16), seed=3),
            randn((2, 8, 4, 2, 16), seed=4), randn((2, 1, 2, 5, 16), seed=5)]
    want, got = [t.clone() for t in base], [t.clone() for t in base]
    step(*want)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(*got)
    for name, w, g in zip(("q", "k", "v", "kv", "t"), want, got):
        assert torch.equal(w, g), name
    assert not torch.equal(want[3], base[3]) and not torch.equal(want[4], base[4])  # both were written
