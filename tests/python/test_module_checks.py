"""rotary.RotaryEmbedding and rotary.CppRotaryEmbedding: what a call and the
constructor accept and refuse. start_pos past the table (computed from
inv_freq), too large or negative, partial rotary widths, and arguments of the
wrong type (the error names the user's argument).
Split from test_module.py (construction, forward, casts, state_dict)."""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import PAIRING_IDS, PAIRINGS, Snapshot, assert_close_ref, make_heads, randn
from test_module import MODULES, make_module


# ---------------------------------------------------------------------------
# Range checks
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("start,S", [(30, 3), (0, 33), (32, 1), (1000, 1), (10**6, 2)])
def test_out_of_range(kind, start, S, interleaved):
    """start_pos + seq_len past max_seq_len is no error for a module: it
    passes its float64 inv_freq, so the rows past the cached table are
    computed exactly (the functional op without inv_freq still raises)."""
    m = make_module(kind, 8, 32, interleaved=interleaved)
    x = randn((1, 2, S, 8), seed=61)
    k = randn((1, 1, S, 8), seed=68)
    snap = Snapshot(x, k)
    assert_close_ref(m(x, start_pos=start), rope_reference(x, start, interleaved), torch.float32)
    oq, ok = m(x, k, start_pos=start)
    assert_close_ref(oq, rope_reference(x, start, interleaved), torch.float32)
    assert_close_ref(ok, rope_reference(k, start, interleaved), torch.float32)
    snap.check()
    assert m.freqs.shape == (32, 4)  # the cached table is not grown
    with pytest.raises(IndexError, match=r"exceeds the freqs table length \(max_seq_len\) 32"):
        rotary.apply_rope(x, m.freqs, start, interleaved)


@pytest.mark.parametrize("kind", MODULES)
def test_start_pos_too_large(kind):
    m = make_module(kind, 8, 32)
    x = randn((1, 2, 3, 8), seed=69)
    snap = Snapshot(x)
    with pytest.raises(IndexError, match=r"RotaryEmbedding: start_pos must be < 2\^60, got 1152921504606846976"):
        m(x, start_pos=2**60)
    with pytest.raises(IndexError, match=r"RotaryEmbedding: start_pos must be < 2\^60, got 9223372036854775807"):
        m(x, x, start_pos=2**63 - 1)
    snap.check()
    # far past the table but below the bound: computed (positions still
    # exact in the float64 reference, which holds integers up to 2^53)
    for start in (2**40, 2**52):
        assert_close_ref(m(x, start_pos=start), rope_reference(x, start), torch.float32)


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_partial_rotary(kind, interleaved):
    """dim below the input head_dim rotates the first dim dims, the rest pass
    through; dim above head_dim is an error."""
    m = make_module(kind, 8, 32, interleaved=interleaved)
    x = make_heads(2, 3, 5, 16, seed=71, layout="transposed")
    k = make_heads(2, 1, 5, 16, seed=72)
    snap = Snapshot(x, k)

    def ref(t, start):
        rot = rope_reference(t[..., :8], start, interleaved)
        return torch.cat([rot, t[..., 8:].to(torch.float64)], dim=-1)

    out = m(x, start_pos=7)
    assert_close_ref(out, ref(x, 7), torch.float32)
    assert torch.equal(out[..., 8:], x[..., 8:])
    oq, ok = m(x, k, start_pos=30)  # 30 + 5 > max_seq_len too
    assert_close_ref(oq, ref(x, 30), torch.float32)
    assert_close_ref(ok, ref(k, 30), torch.float32)
    snap.check()
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(dim=8\): head_dim must be >= dim \(the rotated width\), got head_dim 6"):
        m(x[..., :6])


@pytest.mark.parametrize("kind", MODULES)
def test_negative_start_pos(kind):
    m = make_module(kind, 8, 32)
    x = randn((1, 2, 3, 8), seed=62)
    with pytest.raises(ValueError, match=r"start_pos must be >= 0, got -1"):
        m(x, start_pos=-1)
    with pytest.raises(ValueError, match=r"start_pos"):
        m(x, x, start_pos=-5)


@pytest.mark.parametrize("kind", MODULES)
def test_exact_fit(kind):
    m = make_module(kind, 8, 32)
    x = randn((1, 2, 4, 8), torch.float64, seed=63)
    assert_close_ref(m(x, start_pos=28), rope_reference(x, 28), torch.float64)
    assert_close_ref(m(x[:, :, :1], start_pos=31), rope_reference(x[:, :, :1], 31), torch.float64)


# ---------------------------------------------------------------------------
# Arguments of the wrong type: the error names the user's argument
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(interleaved="yes"), TypeError, r"RotaryEmbedding: interleaved must be a bool .*got 'yes'"),
        (dict(interleaved=None), TypeError, r"interleaved must be a bool .*got None"),
        (dict(interleaved=1), TypeError, r"interleaved must be a bool .*got 1"),
        (dict(dim=8.0), TypeError, r"RotaryEmbedding: dim must be an int, got 8.0"),
        (dict(max_seq_len="64"), TypeError, r"max_seq_len must be an int, got '64'"),
        (dict(max_seq_len=2**64), ValueError, r"max_seq_len must fit in int64"),
        (dict(theta="1e4"), TypeError, r"theta must be a number, got '1e4'"),
        (dict(angle_dtype=None), TypeError, r"angle_dtype must be 'float64' or 'float32' \(a str or a torch dtype\), "
                                            r"got None"),
        (dict(angle_dtype=torch.float16), ValueError, r"angle_dtype must be 'float64'.*got torch.float16"),
    ],
)
def test_constructor_argument_types(kind, kwargs, error, match):
    args = dict(dim=8, max_seq_len=16, theta=10000.0, interleaved=True)
    args.update(kwargs)
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    with pytest.raises(error, match=match) as e:
        cls(**args)
    assert "incompatible function arguments" not in str(e.value)


@pytest.mark.parametrize("kind", MODULES)
def test_call_argument_errors_name_the_argument(kind):
    m = make_module(kind, 8, 32)
    x = randn((1, 2, 3, 8), seed=80)
    snap = Snapshot(x)
    cases = [
        (lambda: m(x, start_pos=2**64), IndexError, r"RotaryEmbedding: start_pos must be < 2\^60, got 18446744073709551616"),
        (lambda: m(x, 2**64), IndexError, r"start_pos must be < 2\^60, got 18446744073709551616"),
        (lambda: m(x, start_pos=-(2**70)), ValueError, r"start_pos must be >= 0, got -1180591620717411303424"),
        (lambda: m(x, torch.tensor(3)), TypeError, r"start_pos must be an int, got a tensor \(tensor\(3\)\)"),
        (lambda: m(x, start_pos=torch.tensor(3)), TypeError, r"start_pos must be an int, got a tensor"),
        (lambda: m(x, start_pos=2.0), TypeError, r"start_pos must be an int, got 2.0"),
        (lambda: m(x, x, start_pos=None), TypeError, r"start_pos must be an int, got None"),
        (lambda: m(x, "k"), TypeError, r"RotaryEmbedding: k must be a tensor or None, got 'k'"),
        (lambda: m(x, positions=[1, 2]), TypeError, r"positions must be a tensor or None, got \[1, 2\]"),
        (lambda: m(x, layout=None), (TypeError, ValueError), r"layout must be .*got None"),
        (lambda: m.forward_with_cache(x, x, x, rotary.KVCache(1, 2, 8, 8), layout=None), TypeError,
         r"RotaryEmbedding.forward_with_cache: layout must be a str, got None"),
        (lambda: m.forward_with_cache(x, None, x, rotary.KVCache(1, 2, 8, 8)), TypeError,
         r"RotaryEmbedding.forward_with_cache: k must be a tensor, got None"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "incompatible function arguments" not in str(e.value) and "k must be float32" not in str(e.value)
    snap.check()
    # an int in k's slot is start_pos
    assert torch.equal(m(x, 5), m(x, start_pos=5))


@pytest.mark.parametrize("kind", MODULES)
def test_forward_with_cache_names_the_kv_caches_shape(kind):
    """The op would name k_cache / v_cache, which a module caller never passed
    (and hint at MLA's v_head_dim, which one KVCache head_dim cannot hold)."""
    m = make_module(kind, 8, 32)
    q, k, v = (randn(shape, seed=81 + i) for i, shape in enumerate([(2, 2, 1, 8), (2, 2, 1, 8), (1, 2, 1, 4)]))
    cache = rotary.KVCache(1, 2, 8, 8)
    snap = Snapshot(q, k, v, cache.k, cache.v)
    want = r"RotaryEmbedding.forward_with_cache: {} must be BHSD \[batch, heads, seq_len, head_dim\] with the KVCache's " \
           r"batch = 1, kv_heads = 2 and head_dim = 8, got shape \[{}\]"
    with pytest.raises(ValueError, match=want.format("k", "2, 2, 1, 8")):
        m.forward_with_cache(q, k, k, cache)
    with pytest.raises(ValueError, match=want.format("v", "1, 2, 1, 4")):
        m.forward_with_cache(q[:1], k[:1], v, cache)
    with pytest.raises(ValueError, match=r"k must be BSHD \[batch, seq_len, heads, head_dim\] .*got shape \[1, 2, 1, 8\]"):
        m.forward_with_cache(q[:1], k[:1], k[:1], cache, layout="BSHD")
    snap.check()
    assert cache.length == 0
