"""Arguments a third trial got through: tensors with no heads past one CPU
tile, flags that are not bools, a table of no rows with inv_freq,
apply_rope_cos_sin's ids, and a start_pos given twice. Each call gives the
float64 reference's result or is refused by name, writing nothing."""

import enum
import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, randn, ref_rope4

D = 16
SIGNED = [torch.int8, torch.int16, torch.int32, torch.int64]
UNSIGNED = [torch.uint8, torch.uint16, torch.uint32, torch.uint64]


# ------------------------------------------------------------ no heads
@pytest.mark.parametrize("seq", [65, 1100])  # past one tile of tokens at head_dim 128, and at rotary_dim 8
def test_no_heads_past_one_tile(seq):
    """The CPU kernel divided the heads among 0 groups: SIGFPE."""
    f, f8 = rotary.freqs_table(128, 2048), rotary.freqs_table(8, 2048)
    x, k = torch.randn(1, 0, seq, 128), torch.randn(1, 0, seq, 128)
    assert rotary.apply_rope(x, f).shape == x.shape
    assert rotary.apply_rope(x, f8).shape == x.shape
    assert rotary.apply_rope_(x, f) is x
    assert [t.shape for t in rotary.apply_rope_qk(x, k, f)] == [x.shape, k.shape]
    assert rotary.RotaryEmbedding(128, 2048)(x).shape == x.shape
    assert rotary.CppRotaryEmbedding(128, 2048)(x).shape == x.shape
    xg = x.clone().requires_grad_()
    rotary.apply_rope(xg, f).sum().backward()
    assert xg.grad.shape == x.shape
    # Packed, and with the cache write (nothing to write).
    packed = torch.randn(seq, 0, 128)
    cu = torch.tensor([0, seq])
    assert rotary.apply_rope(packed, f, cu_seqlens=cu).shape == packed.shape
    kc = torch.full((1, 0, 2048, 128), 3.0)
    rotary.apply_rope_with_kv_cache_(x, k, k.clone(), kc, kc.clone(), f)


# --------------------------------------------------------- bool flags
@pytest.mark.parametrize("value", [None, 0, 1, 2, 0.5, "yes"], ids=repr)
@pytest.mark.parametrize("name", ["interleaved", "inverse"])
def test_flags_must_be_bools(name, value):
    """torch's parser took None for False (interleaved's default is True),
    0.5 for True, and 2."""
    x = randn((1, 2, 3, D), seed=1)
    f = rotary.freqs_table(D, 16)
    with pytest.raises(TypeError, match=rf"apply_rope: {name} must be a bool, got {value!r}"):
        rotary.apply_rope(x, f, 1, **{name: value})
    before = x.clone()
    with pytest.raises(TypeError, match=rf"apply_rope_: {name} must be a bool"):
        rotary.apply_rope_(x, f, 1, **{name: value})
    assert torch.equal(x, before)
    with pytest.raises(TypeError, match=rf"apply_rope_cos_sin: {name} must be a bool"):
        c = torch.ones(3, D)
        rotary.apply_rope_cos_sin(x, x, c, 0 * c, **{name: value})


@pytest.mark.parametrize("value", [None, 3, b"BHSD"], ids=repr)
def test_strings_must_be_strings(value):
    """torch's parser answered None for a str with its whole schema."""
    x, f = randn((1, 2, 3, D), seed=3), rotary.freqs_table(D, 16)
    kc = torch.zeros(1, 2, 8, D)
    calls = [("apply_rope", "layout", lambda v: rotary.apply_rope(x, f, layout=v)),
             ("apply_rope_with_kv_cache_", "kv_layout",
              lambda v: rotary.apply_rope_with_kv_cache_(x.clone(), x.clone(), x.clone(), kc, kc.clone(), f,
                                                         kv_layout=v)),
             ("apply_qk_norm_rope", "norm", lambda v: rotary.apply_qk_norm_rope(x, x, f, norm=v))]
    for op, name, call in calls:
        with pytest.raises(TypeError, match=rf"{op}: {name} must be a str, got {value!r}"):
            call(value)
    assert torch.equal(kc, torch.zeros_like(kc))


def test_positional_interleaved_must_be_a_bool():
    x, f = randn((1, 2, 3, D), seed=2), rotary.freqs_table(D, 16)
    with pytest.raises(TypeError, match=r"apply_rope: interleaved must be a bool, got None"):
        rotary.apply_rope(x, f, 1, None)
    with pytest.raises(TypeError, match=r"apply_qk_norm_rope: interleaved must be a bool, got 1"):
        rotary.apply_qk_norm_rope(x, x, f, 1, 1)
    # The bools themselves still reach the op.
    assert_close_ref(rotary.apply_rope(x, f, 1, False), ref_rope4(x, start=1, interleaved=False), torch.float32)


# -------------------------------------------------- a table of no rows
def test_inv_freq_needs_a_table_row():
    """Rows past the table take its attention scaling from its first entry:
    with no entry, YaRN's 1.1386 became 1."""
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    inv, _ = rotary.inv_frequencies(D, scaling=sc)
    x = randn((1, 2, 3, D), seed=3)
    with pytest.raises(ValueError, match=r"apply_rope: inv_freq needs a table of at least one row .*got freqs "
                                         r"\[0, 8\]"):
        rotary.apply_rope(x, rotary.freqs_table(D, 0, scaling=sc), 5, inv_freq=inv)
    with pytest.raises(ValueError, match=r"inv_freq needs a table of at least one row"):
        rotary.apply_rope(x.to("meta"), rotary.freqs_table(D, 0).to("meta"), inv_freq=inv.to("meta"))


# ----------------------------------------------- apply_rope_cos_sin ids
def hf_tables(rows):
    inv = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    a = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return torch.cat([a.cos()] * 2, -1).float(), torch.cat([a.sin()] * 2, -1).float()


@pytest.mark.parametrize("dtype", SIGNED + UNSIGNED, ids=str)
def test_cos_sin_takes_every_integer_id_dtype(dtype):
    """As documented: index_select took int32 and int64 only, and uint16-64
    ids failed in a min() torch does not implement for them."""
    cos, sin = hf_tables(64)
    q, k = randn((2, 2, 5, D), seed=4), randn((2, 1, 5, D), seed=5)
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 35]])
    qo, ko = rotary.apply_rope_cos_sin(q, k, cos, sin, position_ids=ids.to(dtype))
    # The tables hold float32 cos/sin: compare at float32's tolerance.
    assert_close_ref(qo, ref_rope4(q, positions=ids, interleaved=False), torch.float32)
    assert_close_ref(ko, ref_rope4(k, positions=ids, interleaved=False), torch.float32)


def test_cos_sin_refuses_a_uint64_id_past_int64():
    cos, sin = hf_tables(8)
    q = randn((1, 1, 2, D), seed=6)
    ids = torch.tensor([0, 2**63], dtype=torch.uint64)
    with pytest.raises(IndexError, match=r"apply_rope_cos_sin: position_ids must lie in .*got 9223372036854775808 "
                                         r"\(uint64\)"):
        rotary.apply_rope_cos_sin(q, q, cos, sin, position_ids=ids)


@pytest.mark.parametrize("bad", [-1, 64])
def test_cos_sin_refuses_ids_off_the_table_under_compile(bad):
    """The inductor's index_select wraps -1 to the last row; eager refuses it."""
    cos, sin = hf_tables(64)
    q, k = randn((1, 2, 5, D), seed=7), randn((1, 1, 5, D), seed=8)
    ids = torch.tensor([[3, 1, 4, 1, bad]])
    with pytest.raises(IndexError, match=r"position_ids must be in \[0, 64\)"):
        rotary.apply_rope_cos_sin(q, k, cos, sin, position_ids=ids)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, ids: rotary.apply_rope_cos_sin(q, k, cos, sin, position_ids=ids), fullgraph=True)
    with pytest.raises(Exception, match=r"position_ids must be in \[0, |index out of bounds"):
        fn(q, k, ids)
    good = torch.tensor([[3, 1, 4, 1, 5]])
    assert_close_ref(fn(q, k, good)[0], ref_rope4(q, positions=good, interleaved=False), torch.float32)


def test_cos_sin_rotary_offset_near_int64_max_names_the_op():
    cos, sin = hf_tables(4)
    q = randn((1, 1, 4, D), seed=9)
    with pytest.raises(ValueError, match=r"apply_rope_cos_sin: the tables rotate R = 16 dims from rotary_offset = "
                                         r"9223372036854775805"):
        rotary.apply_rope_cos_sin(q, q, cos, sin, rotary_offset=2**63 - 3)


# ------------------------------------------------ start_pos given twice
@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["python", "cpp"])
def test_start_pos_given_twice_is_refused(make):
    """rope(x, 5, start_pos=3) rotated at 5 and dropped the 3."""
    rope = make(D, 64)
    x = randn((1, 2, 3, D), seed=10)
    for call in (lambda: rope(x, 5, start_pos=3), lambda: rope(x, 5, 3)):
        with pytest.raises(ValueError, match=r"RotaryEmbedding: start_pos is given twice: 5 in k's place .* and "
                                             r"start_pos=3"):
            call()
    assert_close_ref(rope(x, 5), ref_rope4(x, start=5), torch.float32)


# ------------------------------------------------- tables and modules
@pytest.mark.parametrize("args,name", [((8.0, 4), "dim"), ((8, True), "max_seq_len"), ((8, 4, True), "theta"),
                                       ((8, 4, "1e4"), "theta")])
def test_table_arguments_are_named(args, name):
    """pybind took True as 1 (a one-row table, or theta 1) and named neither
    argument nor function for a float."""
    with pytest.raises(TypeError, match=rf"freqs_table: {name} must be"):
        rotary.freqs_table(*args)
    if name != "max_seq_len":
        with pytest.raises(TypeError, match=rf"inv_frequencies: {name} must be"):
            rotary.inv_frequencies(*(args[:1] + args[2:]))


def test_table_arguments_take_any_integer_type():
    import numpy as np
    f = rotary.freqs_table(np.int64(D), np.int32(4), np.float32(500.0))
    torch.testing.assert_close(f, rotary.freqs_table(D, 4, 500.0))


def test_table_arguments_refuse_a_bool_or_float_tensor_by_name():
    """A tensor's __index__ read tensor(True) as 1 (a one-row table) where
    True is refused, and a float tensor got torch's words, naming neither the
    argument nor the function. An integer tensor is still taken."""
    import numpy as np
    module = rotary.RotaryEmbedding(D, 16, scaling={"rope_type": "dynamic", "factor": 2.0})
    calls = [(lambda v: rotary.freqs_table(D, v), "freqs_table: max_seq_len"),
             (lambda v: rotary.inv_frequencies(D, 1e4, None, v), "inv_frequencies: seq_len"),
             (lambda v: rotary.sinusoidal_table(v, 4), "sinusoidal_table: n"),
             (lambda v: rotary.alibi_slopes(v), "alibi_slopes: n_heads"),
             (module.update_for_reach, "RotaryEmbedding.update_for_reach: reach")]
    for call, name in calls:
        for bad in (torch.tensor(True), torch.tensor([True]), torch.tensor(4.0), torch.tensor([3, 4]), np.bool_(True)):
            with pytest.raises(TypeError, match=rf"{name} must be an int, got"):
                call(bad)
    assert module.rope_state == 0
    torch.testing.assert_close(rotary.freqs_table(D, torch.tensor(4)), rotary.freqs_table(D, 4), rtol=0, atol=0)
    module.update_for_reach(torch.tensor([40]))
    assert module.rope_state == 40


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_forward_with_cache_takes_a_numpy_start_pos_as_forward_does(cls):
    """forward took np.int64(2) as start_pos; forward_with_cache refused it
    as "not an int", in the words of another call."""
    import numpy as np
    rope = cls(D, 64)
    q, k, v = (randn(s, seed=40 + i) for i, s in enumerate([(1, 2, 3, D), (1, 1, 3, D), (1, 1, 3, D)]))
    got, want = rotary.KVCache(1, 1, 8, D), rotary.KVCache(1, 1, 8, D)
    with torch.no_grad():
        out = rope.forward_with_cache(q.clone(), k.clone(), v, got, np.int64(2))
        ref = rope.forward_with_cache(q.clone(), k.clone(), v, want, 2)
        with pytest.raises(TypeError, match=r"RotaryEmbedding.forward_with_cache: start_pos must be an int, got 1.5"):
            rope.forward_with_cache(q.clone(), k.clone(), v, got, 1.5)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(out[0].double(), ref_rope4(q, start=2), rtol=0, atol=1e-6)  # the float64 reference
    torch.testing.assert_close(out[1][:, :, -3:].double(), ref_rope4(k, start=2), rtol=0, atol=1e-6)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v) and got.length == want.length == 3


def test_op_arguments_take_numpy_scalars_as_torch_does():
    """The wrappers refused np.int64(3) for start_pos ("must be an int, got
    np.int64(3)"), where torch's own parser takes it; numpy's bool and a
    tensor are still refused by name."""
    import numpy as np
    from rotary_testing.rope_testing import make_heads, ref_rope4
    x, f = make_heads(1, 2, 5, D, seed=31), rotary.freqs_table(D, 16)
    want = ref_rope4(x, start=3)
    class Pos(enum.IntEnum):  # an int subclass, which torch's parser takes as the int
        THREE = 3
    for out in (rotary.apply_rope(x, f, np.int64(3)), rotary.apply_rope(x, f, np.int32(3), rotary_offset=np.int64(0)),
                rotary.apply_rope(x, f, start_pos=np.int16(3)), rotary.apply_rope(x, f, Pos.THREE),
                torch.ops.rotary.apply_rope(x, f, Pos.THREE, True)):
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
    for bad in (np.bool_(True), torch.tensor(3)):
        with pytest.raises(TypeError, match=r"apply_rope: start_pos must be an int, got"):
            rotary.apply_rope(x, f, bad)
    for module in (rotary.RotaryEmbedding(D, 16), rotary.CppRotaryEmbedding(D, 16)):  # the modules too
        for out in (module(x, np.int64(3)), module(x, start_pos=np.int32(3)), module(x, x, np.uint8(3))[1],
                    module(x, Pos.THREE), module(x, start_pos=Pos.THREE)):
            torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
        with pytest.raises(TypeError, match=r"RotaryEmbedding: start_pos must be an int, got np.True_"):
            module(x, start_pos=np.bool_(True))


def test_constructors_take_numpy_scalars_and_refuse_a_complex_by_name():
    """The constructors refused np.int64(64) for dim ("must be an int"), where
    torch.nn.Linear takes it; a complex theta or factor (whose __float__ drops
    the imaginary part) and a tensor theta are refused by name."""
    import numpy as np
    want = rotary.RotaryEmbedding(16, 32, 500.0, rotary_offset=3, mrope_section=[4, 2, 2])
    got = rotary.RotaryEmbedding(np.int64(16), np.int32(32), np.float32(500.0), rotary_offset=np.uint8(3),
                                 mrope_section=[np.int64(4), 2, np.int16(2)])
    assert repr(got) == repr(want) and torch.equal(got.freqs, want.freqs)
    assert repr(rotary.CppRotaryEmbedding(np.int64(16), 32, np.float64(500.0))) == repr(rotary.CppRotaryEmbedding(16, 32, 500.0))
    assert "capacity=64, head_dim=16" in repr(rotary.KVCache(2, np.int64(4), np.int64(64), np.int32(16)))
    for bad, arg, words in ((np.complex64(1e4), "theta", r"theta must be a number, got np.complex64"),
                            (torch.tensor(1e4), "theta", r"theta must be a number, got tensor\(10000\.\)"),
                            (np.bool_(True), "max_seq_len", r"max_seq_len must be an int, got np.True_"),
                            (np.uint64(2**64 - 1), "max_seq_len", r"max_seq_len must fit in int64, got 18446744073709551615")):
        with pytest.raises((TypeError, ValueError), match=rf"RotaryEmbedding: {words}"):
            rotary.RotaryEmbedding(16, **{"max_seq_len": 32, "theta": 1e4, arg: bad})
    with pytest.raises(ValueError, match=r"rope scaling: 'factor' must be a number, got np.complex128\(2\+1j\)"):
        rotary.RotaryEmbedding(16, 32, scaling={"rope_type": "linear", "factor": np.complex128(2 + 1j)})
    with pytest.raises(TypeError, match=r"KVCache: k_scale must be a number, or a list"):
        rotary.KVCache(1, 2, 4, 8, dtype=torch.float8_e4m3fn, k_scale=np.complex64(0.5))
    # A one-element tensor is a number there, but a bool one was read as 1.0.
    assert rotary.RotaryEmbedding(16, 32, scaling={"rope_type": "linear", "factor": torch.tensor(2)}).scaling["factor"] == 2
    with pytest.raises(ValueError, match=r"rope scaling: 'factor' must be a number, got tensor\(True\)"):
        rotary.RotaryEmbedding(16, 32, scaling={"rope_type": "linear", "factor": torch.tensor(True)})
    with pytest.raises(TypeError, match=r"KVCache: v_scale must be a number, or a list .*got tensor\(\[True\]\)"):
        rotary.KVCache(1, 2, 4, 8, dtype=torch.float8_e4m3fn, v_scale=torch.tensor([True]))


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding], ids=["python", "cpp"])
def test_nd_positions_past_the_pair_limit_are_refused_at_construction(make):
    """Accepted before, then every call failed naming pair_axes, an argument
    the caller never passed."""
    with pytest.raises(ValueError, match=r"RotaryEmbedding: N-D positions \(mrope_section, axes_dim, pair_axes\) turn at most "
                                         r"512 pairs, got dim / 2 = 1024"):
        make(2048, 16, mrope_section=[512, 256, 256])


# ------------------------------------------------------- packed messages
def test_packed_errors_name_the_sequence():
    """A packed token was named "(batch 0, seq t)" with t its flat index."""
    f = rotary.freqs_table(D, 6)
    x = randn((9, 2, D), seed=11)
    cu = torch.tensor([0, 3, 9])
    with pytest.raises(IndexError, match=r"apply_rope: token 7 \(sequence 1, index 4\) has position 6 \(start_pos 2 "
                                         r"\+ s\), outside the freqs table \[0, 6\)"):
        rotary.apply_rope(x, f, 2, cu_seqlens=cu)
    k, v = randn((9, 1, D), seed=12), randn((9, 1, D), seed=13)
    kc, vc = torch.zeros(2, 1, 6, D), torch.zeros(2, 1, 6, D)
    with pytest.raises(IndexError, match=r"token 8 \(sequence 1, index 5\) goes to cache position 6 \(its rotary "
                                         r"position\)"):
        rotary.apply_rope_with_kv_cache_(x.clone(), k, v, kc, vc, rotary.freqs_table(D, 16), 1, cu_seqlens=cu)


def test_a_cache_overlapping_an_index_names_it():
    """The message said "an index or scale tensor"."""
    f = rotary.freqs_table(D, 16)
    q, k, v = randn((1, 2, 2, D), seed=14), randn((1, 1, 2, D), seed=15), randn((1, 1, 2, D), seed=16)
    store = torch.zeros(4 * D + 2, dtype=torch.float32)
    kc = store[: 4 * D].view(2, 2, 1, D)  # NHD: 2 blocks of 2 slots
    slots = store[4 * D - 1:4 * D + 1].view(torch.int32)  # 2 int32 slots, the first over kc's last element
    slots.copy_(torch.tensor([0, 1], dtype=torch.int32))
    before = store.clone()
    with pytest.raises(ValueError, match=r"k_cache and slot_mapping overlap in memory"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, torch.zeros(2, 2, 1, D), f, 0, slot_mapping=slots.view(1, 2),
                                         kv_layout="NHD")
    assert torch.equal(store, before)


def test_a_failed_move_keeps_the_module_tables():
    """A move that raised (.to('meta') then .cpu(), .cuda() without a GPU)
    left RotaryEmbedding with no freqs and inv_freq."""
    rope = rotary.RotaryEmbedding(D, 16)
    x = randn((1, 2, 3, D), seed=17)
    rope.to("meta")
    with pytest.raises(NotImplementedError):
        rope.cpu()
    assert set(dict(rope.named_buffers())) == {"freqs", "inv_freq"}
    assert rope.freqs.is_meta and rope.freqs.dtype == torch.complex64
    fresh = rotary.RotaryEmbedding(D, 16)
    if not torch.cuda.is_available():
        with pytest.raises(Exception):
            fresh.cuda()
        assert set(dict(fresh.named_buffers())) == {"freqs", "inv_freq"}
        assert_close_ref(fresh(x, start_pos=2), ref_rope4(x, start=2), torch.float32)


# --------------------------------------------------------- optional tensors
@pytest.mark.parametrize("op,name,value", [
    ("apply_qk_norm_rope", "q_fp8_scale", 0.5),
    ("apply_rope_with_kv_cache_", "k_scale", 2.0),
    ("apply_rope", "offsets", [1]),
    ("apply_rope_qk", "position_ids", 3),
], ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_a_tensor_argument_given_something_else_is_named(op, name, value):
    """torch's argument parser answered a float scale with the whole schema;
    the wrappers name the op and the argument, and write nothing."""
    q, k, v = randn((1, 2, 3, D), seed=3), randn((1, 1, 3, D), seed=4), randn((1, 1, 3, D), seed=5)
    f = rotary.freqs_table(D, 16)
    kc, vc = torch.zeros(1, 1, 8, D, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, 8, D, dtype=torch.float8_e4m3fn)
    before = [t.clone() for t in (q, k)]
    args = {"apply_qk_norm_rope": (q, k, f), "apply_rope_with_kv_cache_": (q, k, v, kc, vc, f),
            "apply_rope": (q, f), "apply_rope_qk": (q, k, f)}[op]
    hint = r"; pass torch\.tensor" if isinstance(value, float) else "$"
    with pytest.raises(TypeError, match=rf"{op}: {name} must be a tensor or None, got {type(value).__name__} .*{hint}"):
        getattr(rotary, op)(*args, **{name: value})
    assert all(torch.equal(t, b) for t, b in zip((q, k), before)) and not kc.float().any()
