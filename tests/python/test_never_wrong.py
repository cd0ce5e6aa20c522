"""The crash, out-of-bounds and wrong-result classes two trials found, one
test per class: each refuses cleanly (naming the argument, writing nothing)
or gives the float64 reference's result."""

import copy
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, randn, ref_rope4

FP8 = torch.float8_e4m3fn
BIG_OFFSETS = [2**63 - 8, 2**63 - 1, 2**62, 2**62 + 3]


def snapshot(*ts):
    return [t.detach().clone() for t in ts]


def unchanged(before, *ts):
    return all(torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                           b.view(torch.uint8) if b.dtype == FP8 else b) for a, b in zip(before, ts))


# ---------------------------------------------------------------- integers
@pytest.mark.parametrize("offset", BIG_OFFSETS)
@pytest.mark.parametrize("op", ["apply_rope", "apply_rope_", "apply_rope_qk", "apply_rope_qk_"])
def test_rotary_offset_near_int64_max_is_refused(op, offset):
    q, k = randn((1, 2, 5, 16), seed=1), randn((1, 2, 5, 16), seed=2)
    f = rotary.freqs_table(8, 16)
    before = snapshot(q, k)
    args = (q, k) if "qk" in op else (q,)
    with pytest.raises(ValueError, match=r"rotary_offset \+ rotary_dim must fit in head_dim = 16.*got rotary_offset = "
                       + str(offset)):
        getattr(rotary, op)(*args, f, 5, rotary_offset=offset)
    assert unchanged(before, q, k)


@pytest.mark.parametrize("offset", BIG_OFFSETS)
def test_rotary_offset_near_int64_max_meta_and_modules(offset):
    f = rotary.freqs_table(8, 16)
    with pytest.raises(ValueError, match=r"rotary_offset \+ rotary_dim must fit"):
        rotary.apply_rope(torch.empty(1, 2, 5, 16, device="meta"), f.to("meta"), 5, rotary_offset=offset)
    q = randn((1, 2, 5, 16), seed=3)
    for make in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        with pytest.raises(ValueError, match=rf"head_dim must be >= rotary_offset \+ dim = {offset + 8} "):
            make(8, 16, rotary_offset=offset)(q, q.clone())


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70])
def test_rotary_offset_past_int64_names_the_argument(value):
    with pytest.raises(ValueError, match=rf"apply_rope: rotary_offset must fit in int64, got {value}"):
        rotary.apply_rope(randn((1, 1, 2, 16)), rotary.freqs_table(8, 16), rotary_offset=value)


def test_rotary_offset_overflow_does_not_crash_the_process():
    """Out of place, the same call aborted the process (malloc(): invalid size)."""
    code = ("import torch, rotary; q = torch.randn(1, 2, 5, 16)\n"
            "try:\n    rotary.apply_rope_qk(q, q.clone(), rotary.freqs_table(8, 16), 5, rotary_offset=2**63 - 8)\n"
            "except ValueError:\n    print('refused')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr


# ----------------------------------------------------------- negative bits
def neg_view(shape, seed):
    """A float view with the negative bit: logical values = -memory."""
    z = torch.complex(randn(shape, seed=seed), randn(shape, seed=seed + 1))
    v = z.conj().imag
    assert v.is_neg()
    return v


@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_negative_bit_views_rotate_in_place(which):
    f = rotary.freqs_table(16, 16)
    q = neg_view((1, 2, 5, 16), 1) if which in ("q", "both") else randn((1, 2, 5, 16), seed=1)
    k = neg_view((1, 3, 5, 16), 3) if which in ("k", "both") else randn((1, 3, 5, 16), seed=3)
    want_q, want_k = ref_rope4(q, start=2), ref_rope4(k, start=2)
    rotary.apply_rope_qk_(q, k, f, 2)
    assert_close_ref(q, want_q, torch.float32)
    assert_close_ref(k, want_k, torch.float32)
    x = neg_view((1, 2, 5, 16), 5)
    assert_close_ref(rotary.apply_rope(x, f, 2), ref_rope4(x, start=2), torch.float32)


def kv_inputs(seed=0, cache_dtype=torch.float32):
    q, k, v = randn((1, 2, 3, 16), seed=seed), randn((1, 2, 3, 16), seed=seed + 1), randn((1, 2, 3, 16), seed=seed + 2)
    kc = torch.full((1, 2, 8, 16), 7.0).to(cache_dtype)
    vc = torch.full((1, 2, 8, 16), -7.0).to(cache_dtype)
    return q, k, v, kc, vc


def test_negative_bit_views_in_the_kv_op():
    f = rotary.freqs_table(16, 16)
    q, k, v, kc, vc = kv_inputs()
    want_k = ref_rope4(k, start=1)
    # v with the bit: copied by its logical values.
    vn = neg_view((1, 2, 3, 16), 9)
    rotary.apply_rope_with_kv_cache_(q, k, vn, kc, vc, f, 1)
    assert_close_ref(kc[:, :, 1:4], want_k, torch.float32)
    assert torch.equal(vc[:, :, 1:4], vn.clone())
    # v_cache with the bit: it holds v's logical values.
    q, k, v, kc, vc = kv_inputs(5)
    vcn = neg_view((1, 2, 8, 16), 11)
    rotary.apply_rope_with_kv_cache_(q, k, v, kc, vcn, f, 1)
    assert torch.equal(vcn.clone()[:, :, 1:4], v)
    # k and k_cache both with the bit: the rotated logical k in both.
    q, k, v, kc, vc = kv_inputs(7)
    kn, kcn = neg_view((1, 2, 3, 16), 13), neg_view((1, 2, 8, 16), 15)
    want_k = ref_rope4(kn, start=1)
    rotary.apply_rope_with_kv_cache_(q, kn, v, kcn, vc, f, 1)
    assert_close_ref(kn, want_k, torch.float32)
    assert_close_ref(kcn[:, :, 1:4], want_k, torch.float32)


@pytest.mark.parametrize("which", ["k", "k_cache"])
def test_negative_bit_on_one_of_k_and_k_cache_is_refused(which):
    f = rotary.freqs_table(16, 16)
    q, k, v, kc, vc = kv_inputs()
    if which == "k":
        k = neg_view((1, 2, 3, 16), 21)
    else:
        kc = neg_view((1, 2, 8, 16), 23)
    before = snapshot(q, k, v, kc, vc)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: k is (not )?a negative-bit view but k_cache"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 1)
    assert unchanged(before, q, k, v, kc, vc)


def test_negative_bit_inputs_that_overlap_a_written_tensor_are_refused():
    """A read-only negative-bit input is copied before the op runs, so the
    op's overlap checks saw the copy: v = -k (a view of k) wrote k as it was
    before the rotation into v_cache, and a table overlapping x was read
    while x was written. Refused by name, nothing written."""
    f = rotary.freqs_table(16, 16)
    q, k, _, kc, vc = kv_inputs()
    v = k._neg_view()
    before = snapshot(q, k, kc, vc)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: k and v overlap in memory"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 1)
    assert unchanged(before, q, k, kc, vc)
    # A plain v overlapping k, with a negative-bit v_cache (v is negated into a copy).
    vcn = neg_view((1, 2, 8, 16), 25)
    before = snapshot(q, k, kc, vcn)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: k and v overlap in memory"):
        rotary.apply_rope_with_kv_cache_(q, k, k, kc, vcn, f, 1)
    assert unchanged(before, q, k, kc, vcn)
    buf = randn((16 * 16 + 64,), seed=27)
    table = torch.view_as_complex(buf[:16 * 16].view(16, 8, 2))
    x = buf[16 * 16 - 32:16 * 16 + 32].view(1, 1, 4, 16)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"apply_rope_: x and freqs overlap in memory"):
        rotary.apply_rope_(x, table._neg_view(), 0)
    assert torch.equal(buf, before)
    # Traced (meta tensors, no addresses): the same valid call with separate
    # tensors is accepted, not read as an overlap at address 0.
    xm, fm = randn((1, 2, 4, 16), seed=28).to("meta"), f.to("meta")
    rotary.apply_rope_(xm, fm._neg_view(), 0)
    qm, km, km2, kcm, vcm = (t.to("meta") for t in kv_inputs()[:2] + (k.clone(), kc, vc))
    rotary.apply_rope_with_kv_cache_(qm, km, km2._neg_view(), kcm, vcm, f.to("meta"), 1)


class _Passthrough(torch.Tensor):
    """A __torch_dispatch__ subclass over real memory that runs ops on
    itself with Python dispatch off: its tensors carry the Python key."""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_subclass(cls, t)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._mode_utils import no_dispatch

        with no_dispatch():
            return func(*args, **(kwargs or {}))


def test_subclass_over_real_memory_keeps_the_overlap_refusals():
    """The overlap check skips tensors with no addresses (traced); a subclass
    over real memory has them: x over its own table rewrote the table, and
    overlapping q and k were rotated, where plain tensors are refused."""
    f = rotary.freqs_table(8, 17)
    before = f.clone()
    x = _Passthrough(torch.view_as_real(f)[:16].reshape(1, 1, 16, 8))
    with pytest.raises(ValueError, match=r"apply_rope_: x and freqs overlap in memory"):
        torch.ops.rotary.apply_rope_(x, f, 1)
    assert torch.equal(f, before)
    buf = _Passthrough(randn((1, 1, 4, 10), seed=29))
    snap = buf.as_subclass(torch.Tensor).clone()
    with pytest.raises(ValueError, match=r"apply_rope_qk_: q and k overlap in memory"):
        torch.ops.rotary.apply_rope_qk_(buf[..., :8], buf[..., 2:], rotary.freqs_table(8, 16))
    assert torch.equal(buf.as_subclass(torch.Tensor), snap)


# ------------------------------------------------------- integer positions
def test_legacy_uint8_positions_plus_start_pos_do_not_wrap():
    x = randn((1, 1, 1, 16), seed=4)
    f = rotary.freqs_table(16, 300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out = rotary.apply_rope(x, f, 10, positions=torch.tensor([[250]], dtype=torch.uint8))
        mod = rotary.RotaryEmbedding(16, 300)(x, 10, positions=torch.tensor([[250]], dtype=torch.uint8))
    want = ref_rope4(x, positions=torch.tensor([[260]]))
    assert_close_ref(out, want, torch.float32)
    assert_close_ref(mod, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("rule", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 32}])
def test_host_driven_rules_take_every_integer_dtype(dtype, rule):
    m = rotary.RotaryEmbedding(16, 64, scaling=dict(rule, max_position_embeddings=64))
    x = randn((1, 1, 3, 16), seed=6)
    ids = torch.tensor([[5, 40, 70]], dtype=dtype)
    out_ids = m(x, position_ids=ids)
    ref = rotary.RotaryEmbedding(16, 64, scaling=dict(rule, max_position_embeddings=64))(x, position_ids=ids.long())
    assert torch.equal(out_ids, ref)
    out_off = m(x, offsets=torch.tensor([3], dtype=dtype))
    assert out_off.shape == x.shape


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
@pytest.mark.parametrize("dtype,shown", [(torch.complex64, "ComplexFloat"), (torch.float32, "Float"), (torch.bool, "Bool")])
@pytest.mark.parametrize("kind", ["position_ids", "offsets"])
def test_host_driven_rules_refuse_non_integer_positions_by_name(make, dtype, shown, kind):
    """The reach read before the call names the argument, as the op does."""
    m = make(16, 64, scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64})
    given = torch.tensor([[1, 0, 1]]) if kind == "position_ids" else torch.tensor([1])
    with pytest.raises(TypeError, match=rf"apply_rope: {kind} must have an integer dtype .*got {shown}"):
        m(randn((1, 1, 3, 16), seed=6), **{kind: given.to(dtype)})


def test_uint64_past_int64_is_reported_as_unsigned():
    x = randn((1, 1, 1, 16))
    with pytest.raises(IndexError, match=r"position_ids must lie in \(-2\^60, 2\^60\), got 9223372036854775813 \(uint64\)"):
        rotary.apply_rope(x, rotary.freqs_table(16, 16), position_ids=torch.tensor([[2**63 + 5]], dtype=torch.uint64))


# ------------------------------------------------------------------ options
BAD_OPTIONS = [
    (dict(axes_dim=[8, 8], mrope_section=[4, 4]), r"mrope_section \(M-RoPE\), axes_dim \(axial RoPE\) and pair_axes "
                                                   r"\(an explicit map\) are three N-D rules"),
    (dict(pair_axes=[0] * 8, axes_dim=[16]), r"are three N-D rules; pass one of them"),
    (dict(pair_axes=[0, 1, 2, 0, 0, 0, 0, True]), r"pair_axes\[7\] must be an int, got True"),
    (dict(mrope_interleaved=True), r"mrope_interleaved=True needs mrope_section"),
    (dict(axes_theta=[100.0]), r"axes_theta needs axes_dim"),
    (dict(axes_shared_spectrum=True), r"axes_shared_spectrum=True needs axes_dim"),
    (dict(mrope_section=[4, 4, 0]), r"mrope_section\[2\] must be in \[1, rotary_dim / 2 = 8\]"),
    (dict(mrope_section=[True, 7]), r"mrope_section\[0\] must be an int, got True"),
    (dict(rotary_offset=True), r"rotary_offset must be an int, got True"),
    (dict(mrope_section=[4, 4], mrope_interleaved="yes"), r"mrope_interleaved must be a bool, got 'yes'"),
]


@pytest.mark.parametrize("kwargs,message", BAD_OPTIONS, ids=[str(i) for i in range(len(BAD_OPTIONS))])
def test_both_modules_refuse_option_combinations_in_the_same_words(kwargs, message):
    errors = []
    for make in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        with pytest.raises((ValueError, TypeError), match=message) as e:
            make(16, 32, **kwargs)
        errors.append((type(e.value), str(e.value).split("\n")[0]))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("value", [True, 2.0])
def test_scalar_start_pos_and_pair_axes_are_refused_by_name(value):
    x = randn((1, 1, 2, 16))
    f = rotary.freqs_table(16, 16)
    with pytest.raises(TypeError, match=rf"apply_rope: start_pos must be an int, got {value}"):
        rotary.apply_rope(x, f, value)
    for m in (rotary.RotaryEmbedding(16, 16), rotary.CppRotaryEmbedding(16, 16)):
        with pytest.raises(TypeError, match=rf"RotaryEmbedding: start_pos must be an int, got {value}"):
            m(x, value)
        with pytest.raises(TypeError, match=rf"RotaryEmbedding: start_pos must be an int, got {value}"):
            m(x, start_pos=value)
    ids = torch.zeros(2, 1, 2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"apply_rope: pair_axes\[0\] must be an int, got True"):
        rotary.apply_rope(x, f, position_ids=ids, pair_axes=[True, False] * 4)


# ------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("scale", [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_fp8_scales_must_be_finite_and_positive(name, scale):
    f = rotary.freqs_table(16, 16)
    q, k, v, kc, vc = kv_inputs(cache_dtype=FP8)
    scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor([1.0, 1.0])}
    scales[name] = torch.tensor([1.0, scale]) if name == "v_scale" else torch.tensor(scale)
    before = snapshot(q, k, v, kc, vc)
    with pytest.raises(ValueError, match=rf"apply_rope_with_kv_cache_: {name} must be finite and > 0"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 1, **scales)
    assert unchanged(before, q, k, v, kc, vc)
    with pytest.raises(ValueError, match=rf"KVCache: {name} must be finite and > 0"):
        rotary.KVCache(1, 2, 8, 16, dtype=FP8, **{name: scale})


def test_fp8_scales_are_read_through_their_stride():
    """A per-head scale that is a strided view is checked element by element
    where it lies: a bad head is named, the stride's other elements are not
    read."""
    f = rotary.freqs_table(16, 16)
    q, k, v, kc, vc = kv_inputs(cache_dtype=FP8)
    every_other = torch.tensor([1.0, float("nan"), 2.0, float("nan")])[::2]  # [1, 2]: the NaNs lie between
    rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 1, k_scale=torch.tensor(1.0), v_scale=every_other)
    bad = torch.tensor([1.0, 5.0, -3.0, 5.0])[::2]  # [1, -3]
    before = snapshot(q, k, v, kc, vc)
    with pytest.raises(ValueError, match=r"v_scale must be finite and > 0 \(the cache stores x / scale\), got -3 at head 1"):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 1, k_scale=torch.tensor(1.0), v_scale=bad)
    assert unchanged(before, q, k, v, kc, vc)


def test_kv_cache_module_refusals():
    with pytest.raises(ValueError, match=r"KVCache: head_dim must be even .*got 15"):
        rotary.KVCache(1, 2, 8, 15)
    with pytest.raises(ValueError, match=r"KVCache: k_scale is only for float8_e4m3fn caches"):
        rotary.KVCache(1, 2, 8, 16, k_scale=2.0)
    with pytest.raises(TypeError, match=r"KVCache.keys_values: dtype must be float32, float64, float16 or bfloat16"):
        rotary.KVCache(1, 2, 8, 16).keys_values(torch.int32)


def test_kv_cache_keeps_its_dtype_when_a_parent_is_cast():
    rope = rotary.CppRotaryEmbedding(16, 32)
    parent = torch.nn.Module()
    parent.cache = rotary.KVCache(1, 2, 8, 16, dtype=FP8, k_scale=0.5)
    parent.half()
    assert parent.cache.k.dtype == FP8 and parent.cache.k_scale.dtype == torch.float32
    q, k, v = randn((1, 2, 2, 16), seed=1), randn((1, 2, 2, 16), seed=2), randn((1, 2, 2, 16), seed=3)
    _, keys, values = rope.forward_with_cache(q, k, v, parent.cache)  # still appends
    assert keys.shape == (1, 2, 2, 16)
    assert torch.equal(values, v.div(1.0).to(FP8).float())  # v_scale 1


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_kv_cache_pickles_and_deepcopies(dtype):
    rope = rotary.CppRotaryEmbedding(16, 32)
    cache = rotary.KVCache(1, 2, 8, 16, dtype=dtype, **({"k_scale": 0.5} if dtype == FP8 else {}))
    rope.forward_with_cache(randn((1, 2, 3, 16), seed=1), randn((1, 2, 3, 16), seed=2), randn((1, 2, 3, 16), seed=3), cache)
    cache.eval()
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert other.length == 3 and repr(other) == repr(cache) and not other.training
        a, b = cache.keys_values(), other.keys_values()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert other.k.data_ptr() != cache.k.data_ptr()


def test_kv_cache_of_another_dtype_names_the_call_made():
    rope = rotary.CppRotaryEmbedding(16, 32)
    cache = rotary.KVCache(1, 2, 8, 16, dtype=torch.bfloat16)
    q = randn((1, 2, 2, 16))
    with pytest.raises(TypeError, match=r"RotaryEmbedding.forward_with_cache: the KVCache holds BFloat16 but k is Float"):
        rope.forward_with_cache(q, q.clone(), q.clone(), cache)


@pytest.mark.parametrize("paged", [False, True])
def test_duplicate_destinations_are_refused(paged):
    f = rotary.freqs_table(16, 16)
    q, k, v = randn((1, 2, 3, 16), seed=1), randn((1, 2, 3, 16), seed=2), randn((1, 2, 3, 16), seed=3)
    if paged:
        kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
        kw = dict(kv_layout="NHD", slot_mapping=torch.tensor([5, -1, 5]))
        what = (r"token \(batch 0, seq 0\) and token \(batch 0, seq 2\) both go to slot 5 \(block 1, offset 1\) "
                r"of slot_mapping")
    else:
        kc, vc = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
        kw = dict(cache_positions=torch.tensor([[2, 6, 2]]))
        what = (r"token \(batch 0, seq 0\) and token \(batch 0, seq 2\) both go to cache row 2 of sequence 0 "
                r"\(cache_positions\)")
    before = snapshot(q, k, v, kc, vc)
    with pytest.raises(ValueError, match=what):
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 0, **kw)
    assert unchanged(before, q, k, v, kc, vc)
    if paged:  # -1 twice is two skipped tokens, not a duplicate
        rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, f, 0, kv_layout="NHD",
                                         slot_mapping=torch.tensor([-1, 3, -1]))


def test_raw_kv_op_with_a_complex_table_compiles_under_the_default_inductor():
    f = rotary.freqs_table(16, 16)

    def step(q, k, v, kc, vc, freqs):  # the table a graph input, as a module's buffer is
        torch.ops.rotary.apply_rope_with_kv_cache_(q, k, v, kc, vc, freqs, 1, True)
        return q * 2, k + 1

    eager = kv_inputs(3)
    want = step(*eager, f)
    comp = kv_inputs(3)
    got = torch.compile(step, fullgraph=True)(*comp, f)
    for a, b in zip(want + eager, got + comp):
        assert torch.equal(a, b)
