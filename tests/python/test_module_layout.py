"""RotaryEmbedding(..., layout=): q and k in BHSD, BSHD or SBHD are rotated
along their own seq dim, by the fast path and every other path, against the
float64 reference (fp32, bf16, start_pos > 0); the checks read the seq dim of
the layout given; a bad layout is refused by name.

Head counts are equal and differ from seq on purpose: reading BSHD as BHSD
then rotates along the heads without any shape error (the bug this guards)."""

import warnings

import pytest
import torch

import rotary
from rotary_testing.rope_testing import LAYOUT_NAMES, assert_close_ref, bits, from_bhsd, layout_shape, randn, ref_rope4, to_bhsd

pytestmark = pytest.mark.usefixtures("reset_dynamo")

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
B, H, S, D = 2, 3, 5, 16
# The Python module and the C++ one (bound) take the same layout argument.
MODULES = [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding]
MODULE_IDS = ["py", "cpp"]
both = pytest.mark.parametrize("module", MODULES, ids=MODULE_IDS)


def heads(layout, dtype, seed, h=H, s=S, d=D):
    return randn(layout_shape(layout, B, h, s, d), dtype, seed)


@pytest.mark.parametrize("start_pos", [0, 7])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@both
def test_q_and_k_with_equal_heads(module, layout, dtype, interleaved, start_pos):
    rope = module(D, 32, interleaved=interleaved)
    q, k = heads(layout, dtype, 1), heads(layout, dtype, 2)
    got_q, got_k = rope(q, k, start_pos, layout=layout)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert_close_ref(got_q, ref_rope4(q, start=start_pos, interleaved=interleaved, layout=layout), dtype)
    assert_close_ref(got_k, ref_rope4(k, start=start_pos, interleaved=interleaved, layout=layout), dtype)
    x = rope(q, start_pos=start_pos, layout=layout)  # one tensor
    assert_close_ref(x, ref_rope4(q, start=start_pos, interleaved=interleaved, layout=layout), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@both
def test_gqa_partial_rotary_and_strided_views(module, layout, dtype):
    # rotary dim 8 of head_dim 16; 4 q heads, 2 kv heads; q and k views of a
    # BHSD buffer, so the layout is strides, not a copy.
    rope = module(8, 32)
    q = from_bhsd(randn((B, 4, S, D), dtype, 3), layout)
    k = from_bhsd(randn((B, 2, S, D), dtype, 4), layout)
    got_q, got_k = rope(q, k, 3, layout=layout)
    assert_close_ref(got_q, ref_rope4(q, r=8, start=3, layout=layout), dtype)
    assert_close_ref(got_k, ref_rope4(k, r=8, start=3, layout=layout), dtype)


@pytest.mark.parametrize("kind", ["offsets", "position_ids", "past_table"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
@both
def test_other_paths(module, layout, dtype, kind):
    # The paths past the fast one: explicit positions, and a reach past the
    # 8-row table (float64 angles: computed on the fly).
    rope = module(D, 8 if kind == "past_table" else 32)
    q, k = heads(layout, dtype, 5), heads(layout, dtype, 6)
    if kind == "offsets":
        off = torch.tensor([1, 4])
        got = rope(q, k, 2, offsets=off, layout=layout)
        want = [ref_rope4(t, start=2, positions=off, layout=layout) for t in (q, k)]
    elif kind == "position_ids":
        ids = torch.tensor([[0, 3, 4, 9, 2], [5, 6, 7, 8, 20]])
        got = rope(q, k, position_ids=ids, layout=layout)
        want = [ref_rope4(t, positions=ids, layout=layout) for t in (q, k)]
    else:
        got = rope(q, k, 6, layout=layout)
        want = [ref_rope4(t, start=6, layout=layout) for t in (q, k)]
    for g, w in zip(got, want):
        assert_close_ref(g, w, dtype)


@pytest.mark.parametrize(
    "kwargs",
    [dict(scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}),
     dict(angle_dtype="float32"), dict(rotary_offset=4, dim=8)],
    ids=["dynamic", "fp32-angles", "rotary_offset"],
)
@pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
@both
def test_same_bits_as_bhsd(module, layout, kwargs):
    # Rules without a float64 reference here: the layout's result is the
    # BHSD result of the same values, bit for bit. dynamic reaches past its
    # 8 positions, so it rebuilds its table for this call's seq.
    kw = dict(dim=D, max_seq_len=32)
    kw.update(kwargs)
    make = lambda: module(**kw)  # noqa: E731
    q, k = heads(layout, torch.float32, 7, s=6), heads(layout, torch.float32, 8, s=6)
    got = make()(q, k, 5, layout=layout)
    ref = make()(to_bhsd(q, layout).contiguous(), to_bhsd(k, layout).contiguous(), 5)
    for g, r in zip(got, ref):
        assert torch.equal(bits(to_bhsd(g, layout)), bits(r))


@pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
def test_compiled_fullgraph(layout):
    rope = rotary.RotaryEmbedding(D, 32)
    q, k = heads(layout, torch.float32, 9), heads(layout, torch.float32, 10)
    step = torch.compile(lambda q, k, p: rope(q, k, p, layout=layout), backend="aot_eager", fullgraph=True)
    for p in (0, 4):
        got, want = step(q, k, p), rope(q, k, p, layout=layout)
        assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
        assert_close_ref(got[0], ref_rope4(q, start=p, layout=layout), torch.float32)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["BHDS", "bshd", "", None, 2])
def test_unknown_layout_is_refused_by_name(bad):
    rope = rotary.RotaryEmbedding(D, 32)
    q = heads("BHSD", torch.float32, 11)
    # Not a str: a TypeError, as the C++ module says it.
    error, msg = (ValueError, r"^RotaryEmbedding: layout must be 'BHSD', 'BSHD' or 'SBHD', got " + repr(bad)) if (
        isinstance(bad, str)) else (TypeError, r"^RotaryEmbedding: layout must be a str, got " + repr(bad))
    with pytest.raises(error, match=msg):
        rope(q, q.clone(), 1, layout=bad)
    with pytest.raises(error, match=msg):
        rope(q, layout=bad)


@both
def test_head_dim_check_reads_the_last_dim(module):
    # BSHD [2, 5, 3, 8] for a dim-16 module: head_dim 8, whatever the layout.
    rope = module(D, 32)
    q = heads("BSHD", torch.float32, 12, d=8)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(dim=16\): head_dim must be >= dim .*got head_dim 8 "
                                         r"\(shape [(\[]2, 5, 3, 8[)\]]\)"):
        rope(q, q.clone(), layout="BSHD")


@pytest.mark.parametrize("bad", ["BHDS", "bshd"])
def test_cpp_module_refuses_an_unknown_layout_by_name(bad):
    rope = rotary.CppRotaryEmbedding(D, 32)
    q = heads("BHSD", torch.float32, 11)
    before = q.clone()
    for call in (lambda: rope(q, q.clone(), 1, layout=bad), lambda: rope(q, layout=bad)):
        with pytest.raises(ValueError, match=rf"layout must be 'BHSD', 'BSHD' or 'SBHD'.*got '{bad}'"):
            call()
    assert torch.equal(q, before)


@pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
@both
def test_table_bound_reads_the_seq_dim(module, layout):
    # float32 angles have no on-the-fly path: 6 + seq 5 > 8 rows is refused,
    # naming seq 5 (the layout's seq dim; heads are 3, which would fit).
    rope = module(D, 8, angle_dtype="float32")
    q = heads(layout, torch.float32, 13)
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len = 6 \+ 5 = 11 exceeds max_seq_len 8"):
        rope(q, q.clone(), 6, layout=layout)
    rope(q, q.clone(), 3, layout=layout)  # 3 + 5 fits


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_table_bound_under_fullgraph_compile_is_the_ops_index_error(backend):
    # The module's host check cannot be traced (a Dynamo "Unsupported" error
    # named check_rows); traced, the op refuses the rows in its own words.
    rope = rotary.RotaryEmbedding(D, 8, angle_dtype="float32")
    q = heads("BSHD", torch.float32, 14)
    f = torch.compile(rope, fullgraph=True, backend=backend)
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len = 6 \+ 5 = 11 exceeds the freqs table length"):
        f(q, q.clone(), 6, layout="BSHD")


@pytest.mark.parametrize(
    "call,error,eager",
    [
        (lambda m, q: m(q, q.clone(), -1), ValueError, r"RotaryEmbedding: start_pos must be >= 0, got -1"),
        (lambda m, q: m(q, q.clone(), 1.5), TypeError, r"RotaryEmbedding: start_pos must be an int, got 1.5"),
        (lambda m, q: m(q[..., :4], q[..., :4].clone()), ValueError, r"head_dim must be >= dim \(the rotated width\)"),
    ],
    ids=["negative-start", "float-start", "narrow-head"],
)
def test_refusals_checked_in_cpp_under_compile(call, error, eager):
    """The module's C++ checks run at a graph break: compiled, the error is
    eager's (and Dynamo warns of no pybind call); under fullgraph=True the
    break says why instead of 'Attempted to call function marked as skipped'."""
    rope = rotary.RotaryEmbedding(D, 8)
    q = heads("BHSD", torch.float32, 15)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not know how to trace")  # Dynamo's, on a pybind call
        with pytest.raises(error, match=eager):
            torch.compile(lambda q: call(rope, q), backend="eager")(q)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"rotary.RotaryEmbedding checks this call's arguments in "
                                                            r"C\+\+.*Run the call without torch.compile"):
        torch.compile(lambda q: call(rope, q), backend="eager", fullgraph=True)(q)
