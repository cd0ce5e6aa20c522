"""Errors whose words misled: a fix that does not fit the argument, a
message about another field or call, a type error raised as something else,
a received value left out. Each now names the argument, what it got and
what was wanted."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import randn, ref_rope4

D = 8


def test_a_float_for_an_optional_tensor_gets_the_float32_fix_only_where_it_fits():
    """The fp8 scales are float32 tensors; offsets, ids and inv_freq are not:
    following the fix there gave the next refusal."""
    x, f = randn((1, 2, 4, D), seed=1), rotary.freqs_table(D, 16)
    for name in ("offsets", "position_ids", "inv_freq", "cu_seqlens"):
        with pytest.raises(TypeError, match=rf"apply_rope: {name} must be a tensor or None, got float 2.0$"):
            rotary.apply_rope(x, f, **{name: 2.0})
    cache = torch.zeros(1, 2, 8, D, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"k_scale must be a tensor or None, got float 2.0; pass "
                                        r"torch.tensor\(2.0, dtype=torch.float32\)"):
        rotary.apply_rope_with_kv_cache_(x.clone(), x.clone(), x.clone(), cache, cache.clone(), f, k_scale=2.0)


def test_a_required_tensor_given_something_else_is_a_type_error_naming_it():
    """None reached C++ as an undefined tensor: a ValueError in C++'s words,
    or, for apply_rope_cos_sin, "shape [0]" and "UNKNOWN_SCALAR"."""
    x, f = randn((1, 2, 4, D), seed=2), rotary.freqs_table(D, 16)
    cos, sin = torch.ones(4, D), torch.zeros(4, D)
    for call, words in ((lambda: rotary.apply_rope(None, f), "apply_rope: x must be a tensor, got NoneType None"),
                        (lambda: rotary.apply_rope([1.0], f), r"apply_rope: x must be a tensor, got list \[1.0\]"),
                        (lambda: rotary.apply_rope_qk(x, None, f), "apply_rope_qk: k must be a tensor, got NoneType"),
                        (lambda: rotary.apply_rope_cos_sin(None, x, cos, sin), "apply_rope_cos_sin: q must be a tensor"),
                        (lambda: rotary.apply_rope_cos_sin(x, x, None, sin), "apply_rope_cos_sin: cos must be a tensor"),
                        (lambda: rotary.RotaryEmbedding(D, 16)(None), r"RotaryEmbedding: q \(or x\) must be a tensor, "
                                                                     "got None"),
                        (lambda: rotary.RotaryEmbedding(D, 16)(x, layout=3), "RotaryEmbedding: layout must be a str, "
                                                                             "got 3")):
        with pytest.raises(TypeError, match=words):
            call()
    # The raw op, as C++ callers reach it: named before its rank or dtype is read.
    for args, name in (((None, x, cos, sin), "q"), ((x, None, cos, sin), "k"), ((x, x, None, sin), "cos")):
        with pytest.raises(ValueError, match=rf"apply_rope_cos_sin: {name} is an undefined tensor"):
            torch.ops.rotary.apply_rope_cos_sin(*args)


def test_a_cache_write_that_requires_grad_is_not_told_to_use_an_out_of_place_op():
    f = rotary.freqs_table(D, 16)
    x = randn((1, 2, 4, D), seed=3)
    cache = torch.zeros(1, 2, 16, D)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: k_cache requires grad; the cache write is not "
                                         r"differentiable. It has no out-of-place form: pass k_cache.detach\(\)"):
        rotary.apply_rope_with_kv_cache_(x.clone(), x.clone(), x, cache.clone().requires_grad_(), cache.clone(), f)
    with pytest.raises(ValueError, match=r"apply_rope_with_kv_cache_: q requires grad; in-place rotation is not "
                                         r"differentiable. It has no out-of-place form: pass q.detach\(\)"):
        rotary.RotaryEmbedding(D, 16).forward_with_cache(x.clone().requires_grad_(), x.clone(), x,
                                                         rotary.KVCache(1, 2, 16, D))
    with pytest.raises(ValueError, match=r"q_weight requires grad; the in-place norm and rotation is not "
                                         r"differentiable. It has no out-of-place form"):
        rotary.apply_qk_norm_rope_with_kv_cache_(x.clone(), x.clone(), x, cache.clone(), cache.clone(), f,
                                                 q_weight=torch.ones(D, requires_grad=True))
    with pytest.raises(ValueError, match=r"q_weight requires grad; the in-place norm and rotation is not "
                                         r"differentiable. Use the out-of-place op"):
        rotary.apply_qk_norm_rope_(x.clone(), x.clone(), f, q_weight=torch.ones(D, requires_grad=True))


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_forward_with_cache_names_an_integer_k_before_advising_a_cache_of_its_dtype(cls):
    q = torch.ones(1, 2, 3, D, dtype=torch.int64)
    cache = rotary.KVCache(1, 2, 8, D)
    with pytest.raises(TypeError, match=r"RotaryEmbedding.forward_with_cache: k must be float32, float64, float16 or "
                                        r"bfloat16, got Long"):
        cls(D, 16).forward_with_cache(q, q.clone(), q.clone(), cache)
    assert cache.length == 0


def test_a_kv_cache_past_this_machines_memory_names_its_sizes():
    with pytest.raises(ValueError, match=r"KVCache: k and v of batch=1024 x kv_heads=64 x capacity=1048576 x "
                                         r"head_dim=128 needs 70368744177664 bytes \(two Float\), more than this "
                                         r"machine's memory .*; pass a smaller capacity or batch"):
        rotary.KVCache(1024, 64, 2**20, 128)
    cache = rotary.KVCache(1, 2, 8, D)
    sd = cache.state_dict()
    sd["_extra_state"] = dict(sd["_extra_state"], layout=3)
    with pytest.raises(RuntimeError, match=r"KVCache.load_state_dict: _extra_state\['layout'\] must be a str, got 3"):
        cache.load_state_dict(sd)


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_a_grown_dynamic_table_past_this_machines_memory_names_the_reach(cls):
    """The call's reach grows the float32-angle table, so a smaller max_seq_len
    (the module's 16) is no way out; float64 angles are."""
    rope = cls(2**19, 16, scaling={"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16},
               angle_dtype="float32")  # 2 TB at its reach: past any machine that runs the tests
    x = randn((1, 1, 1, 2**19), seed=7)
    before = x.clone()
    with pytest.raises(ValueError, match=r"max_seq_len=16.*freqs_table: the dynamic rule's float32-angle table, "
                                         r"grown for this call's reach to 1048576 rows \(at most 2\^20\) x dim // 2 = "
                                         r"262144 pairs, needs "
                                         r"2199023255552 bytes \(complex64\), more than this machine's memory .*; pass "
                                         r"angle_dtype=float64 \(its grown positions are then computed on the fly\)"):
        rope(x, start_pos=2**20 - 1)
    assert torch.equal(x, before) and rope.freqs.shape[0] == 16


def test_from_hf_config_names_what_it_was_given():
    llama = dict(model_type="llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                 rope_theta=1e4)
    with pytest.raises(TypeError, match=r"from_hf_config: config must be a transformers config or a config.json dict,"
                                        r" got str 'meta-llama/Llama-2-7b-hf'; for a model id, pass "
                                        r"transformers.AutoConfig.from_pretrained\(id\)"):
        rotary.RotaryEmbedding.from_hf_config("meta-llama/Llama-2-7b-hf")
    for bad in (None, 3, [1]):
        with pytest.raises(TypeError, match=rf"config must be a transformers config or a config.json dict, got "
                                            rf"{type(bad).__name__} "):
            rotary.rope_kwargs_from_hf_config(bad)
    with pytest.raises(ValueError, match=r"llama has no head_dim, and derives it as hidden_size // "
                                         r"num_attention_heads: num_attention_heads must be > 0, got 0"):
        rotary.rope_kwargs_from_hf_config(dict(llama, num_attention_heads=0))
    mla = dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4, qk_nope_head_dim=128,
               max_position_embeddings=128, rope_theta=1e4)
    for width in (63, 0):
        with pytest.raises(ValueError, match=rf"from_hf_config: qk_rope_head_dim = {width}, the rotated dims, must be "
                                             r"even and > 0"):
            rotary.rope_kwargs_from_hf_config(dict(mla, qk_rope_head_dim=width))


def test_the_required_tensor_check_leaves_what_torch_routes():
    """An FX Proxy carries __torch_function__: the wrappers' new check
    refused it, where torch.fx.symbolic_trace had traced them."""
    import torch.fx
    f = rotary.freqs_table(D, 16)

    class Rope(torch.nn.Module):
        def forward(self, q, k):
            return rotary.apply_rope_qk(q, k, f, 3)

    q, k = randn((1, 2, 4, D), seed=4), randn((1, 1, 4, D), seed=5)
    traced = torch.fx.symbolic_trace(Rope())
    for got, x in zip(traced(q, k), (q, k)):
        torch.testing.assert_close(got.double(), ref_rope4(x, start=3), rtol=0, atol=1e-6)


def test_a_str_subclass_layout_is_read_as_the_str_it_holds():
    """A StrEnum layout: the ops and the C++ module took it; the Python
    module said "layout must be a str" of a str."""
    import enum

    class Layout(str, enum.Enum):  # str() of it is 'Layout.BSHD'; C++ reads 'BSHD'
        BSHD = "BSHD"

    x, f = randn((1, 4, 2, D), seed=6), rotary.freqs_table(D, 16)
    want = ref_rope4(x, start=2, layout="BSHD")
    for module in (rotary.RotaryEmbedding(D, 16), rotary.CppRotaryEmbedding(D, 16)):
        torch.testing.assert_close(module(x, 2, layout=Layout.BSHD).double(), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(module(x, x, 2, layout=Layout.BSHD)[1].double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(rotary.apply_rope(x, f, 2, layout=Layout.BSHD).double(), want, rtol=0, atol=1e-6)
