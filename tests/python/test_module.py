"""rotary.RotaryEmbedding (Python nn.Module) and rotary.CppRotaryEmbedding
(the C++ module bound through torch.nn.cpp.ModuleWrapper)."""

import io

import numpy as np
import pytest
import torch
from torch import nn

import rotary
from rotary_testing.reference import freqs_reference, inv_freq, rope_half_vec, rope_reference, rope_vec, sinusoidal_pe
from rotary_testing.rope_testing import (
    DTYPE_IDS,
    DTYPES,
    PAIRING_IDS,
    PAIRINGS,
    Snapshot,
    assert_close_ref,
    make_heads,
    randn,
)

MODULES = ["py", "cpp"]


def make_module(kind, dim, max_seq_len=64, theta=10000.0, interleaved=True):
    if kind == "py":
        return rotary.RotaryEmbedding(dim, max_seq_len, theta, interleaved)
    return rotary.CppRotaryEmbedding(dim, max_seq_len, theta, interleaved)


# ---------------------------------------------------------------------------
# Construction and the freqs / inv_freq buffers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
def test_buffer(kind):
    m = make_module(kind, 16, 48, 500.0, False)
    assert (m.dim, m.max_seq_len, m.theta, m.interleaved) == (16, 48, 500.0, False)
    bufs = dict(m.named_buffers())
    assert list(bufs) == ["freqs", "inv_freq"]
    f = bufs["freqs"]
    assert f is m.freqs or torch.equal(f, m.freqs)
    assert f.dtype == torch.complex64 and f.shape == (48, 8)
    assert torch.equal(f, rotary.freqs_table(16, 48, 500.0))
    assert np.abs(f.numpy().astype(np.complex128) - freqs_reference(16, 48, 500.0)).max() < 1e-7
    inv = bufs["inv_freq"]
    assert inv is m.inv_freq or torch.equal(inv, m.inv_freq)
    assert inv.dtype == torch.float64 and inv.shape == (8,)
    np.testing.assert_allclose(inv.numpy(), inv_freq(16, 500.0), rtol=1e-15, atol=0)
    assert list(m.parameters()) == []
    assert list(m.state_dict()) == ["freqs", "inv_freq"]  # persistent: both move with the model


def test_defaults():
    py = rotary.RotaryEmbedding(8)
    cpp = rotary.CppRotaryEmbedding(8)
    for m in (py, cpp):
        assert (m.max_seq_len, m.theta, m.interleaved) == (4096, 10000.0, True)
        assert m.freqs.shape == (4096, 4)
    assert torch.equal(py.freqs, cpp.freqs)
    assert "dim=8" in repr(py) and "max_seq_len=4096" in repr(py)


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward(kind, dtype, interleaved):
    m = make_module(kind, 32, 64, 10000.0, interleaved)
    x = make_heads(2, 3, 7, 32, dtype, "transposed", seed=50)
    q = make_heads(2, 4, 7, 32, dtype, seed=51)
    k = make_heads(2, 2, 7, 32, dtype, "stride2", seed=52)
    snap = Snapshot(x, q, k)
    out = m(x, start_pos=9)
    assert_close_ref(out, rope_reference(x, 9, interleaved), dtype)
    assert torch.equal(out, rotary.apply_rope(x, m.freqs, 9, interleaved))
    oq, ok = m(q, k, start_pos=57)  # 57 + 7 == max_seq_len
    assert_close_ref(oq, rope_reference(q, 57, interleaved), dtype)
    assert_close_ref(ok, rope_reference(k, 57, interleaved), dtype)
    assert torch.equal(m(x), rotary.apply_rope(x, m.freqs, 0, interleaved))
    snap.check()


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_python_forward_positions(interleaved):
    m = rotary.RotaryEmbedding(16, 64, interleaved=interleaved)
    q = make_heads(2, 3, 5, 16, seed=53)
    k = make_heads(2, 1, 5, 16, seed=54)
    ids = torch.tensor([[0, 4, 8, 12, 16], [63, 62, 61, 60, 59]])
    oq, ok = m(q, k, position_ids=ids)
    assert_close_ref(oq, rope_reference(q, 0, interleaved, ids), torch.float32)
    assert_close_ref(ok, rope_reference(k, 0, interleaved, ids), torch.float32)
    off = torch.tensor([3, 50])
    out = m(q, start_pos=2, offsets=off)
    assert_close_ref(out, rope_reference(q, 2, interleaved, off), torch.float32)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_python_and_cpp_modules_agree(interleaved):
    py = rotary.RotaryEmbedding(24, 40, 1234.5, interleaved)
    cpp = rotary.CppRotaryEmbedding(24, 40, 1234.5, interleaved)
    assert torch.equal(py.freqs, cpp.freqs)
    x = make_heads(2, 3, 6, 24, torch.bfloat16, seed=55)
    k = make_heads(2, 1, 6, 24, torch.bfloat16, seed=56)
    assert torch.equal(py(x, start_pos=5), cpp(x, start_pos=5))
    a, b = py(x, k, start_pos=34), cpp(x, k, start_pos=34)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------
# dtype casts leave the complex64 table alone
# ---------------------------------------------------------------------------
CASTS = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to_bf16": lambda m: m.to(torch.bfloat16),
    "to_fp16_kw": lambda m: m.to(dtype=torch.float16),
    "double": lambda m: m.double(),
    "float": lambda m: m.float(),
    "to_cpu_fp64": lambda m: m.to(torch.device("cpu"), torch.float64),
    "cpu": lambda m: m.cpu(),
}


# Both modules take every form, and each returns the module (torch's
# bind_module versions, which returned None, are dropped).
@pytest.mark.parametrize("kind,cast", [(k, c) for k in ("py", "cpp") for c in CASTS])
def test_cast_keeps_table(kind, cast):
    m = make_module(kind, 16, 32)
    before, before_inv = m.freqs.clone(), m.inv_freq.clone()
    assert CASTS[cast](m) is m
    assert m.freqs.dtype == torch.complex64
    assert torch.equal(m.freqs, before)
    assert m.state_dict()["freqs"].dtype == torch.complex64
    assert m.inv_freq.dtype == torch.float64 and torch.equal(m.inv_freq, before_inv)
    assert m.state_dict()["inv_freq"].dtype == torch.float64
    # positions past max_seq_len (computed from inv_freq) stay exact too
    x_far = make_heads(1, 2, 3, 16, torch.float16, seed=57)
    assert_close_ref(m(x_far, start_pos=40), rope_reference(x_far, 40, True), torch.float16)
    x = make_heads(1, 2, 3, 16, torch.float16, seed=57)
    assert_close_ref(m(x, start_pos=4), rope_reference(x, 4, True), torch.float16)


@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_mode_switches_return_the_module(kind):
    m = make_module(kind, 16, 32)
    assert m.eval() is m and not m.training
    assert m.train() is m and m.training
    cache = rotary.KVCache(1, 2, 8, 16)
    assert cache.cpu() is cache and cache.to("cpu") is cache and cache.half() is cache
    assert all(b.dtype == torch.float32 for b in cache.buffers())  # the cache keeps its options' dtype


class _Block(nn.Module):
    def __init__(self, rope):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.rope = rope
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x, start_pos=0):  # x: [B, H, S, 16]
        return self.rope(self.proj(x) * self.scale, start_pos=start_pos)


@pytest.mark.parametrize("cast", ["to_fp16", "half", "to_bf16", "double"])
def test_nested_python_module_cast(cast):
    parent = nn.Sequential(_Block(rotary.RotaryEmbedding(16, 32)))
    before = parent[0].rope.freqs.clone()
    before_inv = parent[0].rope.inv_freq.clone()
    {
        "to_fp16": lambda: parent.to(torch.float16),
        "half": lambda: parent.half(),
        "to_bf16": lambda: parent.to(torch.bfloat16),
        "double": lambda: parent.double(),
    }[cast]()
    blk = parent[0]
    dtype = blk.proj.weight.dtype
    assert dtype != torch.float32 and blk.scale.dtype == dtype  # the rest was cast
    assert blk.rope.freqs.dtype == torch.complex64 and torch.equal(blk.rope.freqs, before)
    assert parent.state_dict()["0.rope.freqs"].dtype == torch.complex64
    assert blk.rope.inv_freq.dtype == torch.float64 and torch.equal(blk.rope.inv_freq, before_inv)
    assert parent.state_dict()["0.rope.inv_freq"].dtype == torch.float64
    x = randn((1, 2, 3, 16), dtype, seed=58)
    h = blk.proj(x) * blk.scale
    out = blk(x, start_pos=5)
    assert out.dtype == dtype
    assert_close_ref(out, rope_reference(h, 5, True), dtype)


def test_nested_cpp_module_cast():
    """A CppRotaryEmbedding inside a Python parent keeps its complex64 table
    when the parent is cast, as its own C++ ``to(dtype)`` override does
    (ModuleWrapper._apply alone would cast every buffer)."""
    parent = nn.Sequential(_Block(rotary.CppRotaryEmbedding(16, 32)))
    before = parent[0].rope.freqs.clone()
    parent.to(torch.float16)
    assert parent[0].proj.weight.dtype == torch.float16
    assert parent[0].rope.freqs.dtype == torch.complex64
    assert torch.equal(parent[0].rope.freqs, before)


# ---------------------------------------------------------------------------
# state_dict: Python <-> C++, torch.save / torch.load
# ---------------------------------------------------------------------------
def _assert_same_outputs(a, b, interleaved):
    x = make_heads(2, 3, 5, 16, seed=59)
    k = make_heads(2, 1, 5, 16, seed=60)
    assert torch.equal(a(x, start_pos=7), b(x, start_pos=7))
    oa, ob = a(x, k, start_pos=3), b(x, k, start_pos=3)
    assert torch.equal(oa[0], ob[0]) and torch.equal(oa[1], ob[1])
    # past max_seq_len (32) the loaded inv_freq is what is used
    oa, ob = a(x, k, start_pos=40), b(x, k, start_pos=40)
    assert torch.equal(oa[0], ob[0]) and torch.equal(oa[1], ob[1])


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("src,dst", [("py", "cpp"), ("cpp", "py"), ("py", "py"), ("cpp", "cpp")])
def test_state_dict_round_trip(src, dst, interleaved):
    a = make_module(src, 16, 32, 777.0, interleaved)
    b = make_module(dst, 16, 32, 777.0, interleaved)
    with torch.no_grad():  # loading must restore both buffers
        b.freqs.zero_()
        b.inv_freq.mul_(2.0)
    sd = a.state_dict()
    assert list(sd) == ["freqs", "inv_freq"]
    result = b.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert b.freqs.dtype == torch.complex64 and torch.equal(b.freqs, a.freqs)
    assert torch.equal(b.state_dict()["freqs"], a.freqs)
    assert b.inv_freq.dtype == torch.float64 and torch.equal(b.inv_freq, a.inv_freq)
    assert torch.equal(b.state_dict()["inv_freq"], a.inv_freq)
    _assert_same_outputs(a, b, interleaved)


@pytest.mark.parametrize("src,dst", [("py", "cpp"), ("cpp", "py")])
def test_state_dict_save_load(tmp_path, src, dst):
    a = make_module(src, 16, 32, 321.0, False)
    path = tmp_path / "rope.pt"
    torch.save(a.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    assert list(sd) == ["freqs", "inv_freq"]
    assert sd["freqs"].dtype == torch.complex64 and sd["inv_freq"].dtype == torch.float64
    # Tables saved with other options are refused, never silently installed.
    with pytest.raises(RuntimeError, match=r"saved tables do not match this module"):
        make_module(dst, 16, 32, 10000.0, False).load_state_dict(sd)
    b = make_module(dst, 16, 32, 321.0, False)
    b.load_state_dict(sd)
    assert torch.equal(b.freqs, a.freqs) and torch.equal(b.inv_freq, a.inv_freq)
    _assert_same_outputs(a, b, False)
    # also through an in-memory buffer, nested in a parent
    buf = io.BytesIO()
    torch.save(nn.ModuleDict({"rope": a}).state_dict(), buf)
    buf.seek(0)
    parent = nn.ModuleDict({"rope": make_module(dst, 16, 32, 321.0, False)})
    parent.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(parent["rope"].freqs, a.freqs)
    assert torch.equal(parent["rope"].inv_freq, a.inv_freq)


def test_load_state_dict_rejects_other_shape():
    a = rotary.RotaryEmbedding(16, 32)
    b = rotary.RotaryEmbedding(16, 48)
    with pytest.raises(RuntimeError, match="freqs"):
        b.load_state_dict(a.state_dict())


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
# The relative-position property (seeds 000 and 004)
# ---------------------------------------------------------------------------
D_REL = 8
STARTS = [2, 5, 9, 14, 20, 100, 777, 2048, 4000]


def _vecs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(D_REL, generator=g, dtype=torch.float64)
    k = torch.randn(D_REL, generator=g, dtype=torch.float64)
    return q, k


def _score(m, q, k, pos_q, pos_k):
    """q . k after rotating q at pos_q and k at pos_k with module m."""
    qr = m(q.view(1, 1, 1, -1), start_pos=pos_q)
    kr = m(k.view(1, 1, 1, -1), start_pos=pos_k)
    return float((qr * kr).sum())


@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_relative_position_property(kind, interleaved):
    m = make_module(kind, D_REL, 4096, 10000.0, interleaved)
    q, k = _vecs(7)
    vec = rope_vec if interleaved else rope_half_vec
    for offset in (0, 2, 3, 17):
        scores = [_score(m, q, k, p, p - offset) for p in STARTS if p >= offset]
        spread = max(scores) - min(scores)
        assert spread < 1e-5, f"offset {offset}: RoPE score moved by {spread} with absolute position"
        # ... and equals the exact score of q at `offset`, k at 0 (seed formula)
        exact = float(vec(q.numpy(), offset) @ vec(k.numpy(), 0))
        assert abs(scores[0] - exact) < 1e-5
    # The score is a real function of the offset, not a constant.
    by_offset = [_score(m, q, k, 12, 12 - off) for off in (0, 1, 3, 6)]
    assert max(by_offset) - min(by_offset) > 1e-3


def test_sinusoidal_add_leaks_absolute_position():
    """Control from the seeds: the 2017 additive encoding is not relative."""
    q, k = (t.numpy() for t in _vecs(7))
    scores = [(q + sinusoidal_pe(p, D_REL)) @ (k + sinusoidal_pe(p - 2, D_REL)) for p in STARTS]
    assert max(scores) - min(scores) > 1e-3


def test_mixed_pairings_scramble():
    """Interleaved q with half-split k loses the relative property (seed demo 6)."""
    inter = rotary.RotaryEmbedding(D_REL, 4096, interleaved=True)
    half = rotary.RotaryEmbedding(D_REL, 4096, interleaved=False)
    q, k = _vecs(3)
    scores = []
    for p in STARTS:
        qr = inter(q.view(1, 1, 1, -1), start_pos=p)
        kr = half(k.view(1, 1, 1, -1), start_pos=p - 2)
        scores.append(float((qr * kr).sum()))
    assert max(scores) - min(scores) > 1e-3


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_attention_is_shift_invariant(interleaved):
    """Same 6 tokens at positions 0..5 and 1000..1005: identical attention
    weights (seed demo 4), using the one-call q/k form."""
    m = rotary.RotaryEmbedding(32, 2048, interleaved=interleaved)
    q = make_heads(1, 4, 6, 32, torch.float64, seed=64)
    k = make_heads(1, 4, 6, 32, torch.float64, seed=65)

    def weights(start):
        qr, kr = m(q, k, start_pos=start)
        return torch.softmax(qr @ kr.transpose(-1, -2) / 32**0.5, dim=-1)

    w0, w1 = weights(0), weights(1000)
    torch.testing.assert_close(w0, w1, rtol=1e-5, atol=1e-6)
    plain = torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, dim=-1)
    assert (w0 - plain).abs().max() > 1e-3  # and position did matter


def test_attention_relative_with_position_ids():
    """Per-row position ids: each row shifted by a different amount gives
    the same q.k scores as the unshifted row."""
    m = rotary.RotaryEmbedding(16, 512)
    row_q = make_heads(1, 2, 5, 16, torch.float64, seed=66)
    row_k = make_heads(1, 2, 5, 16, torch.float64, seed=67)
    q, k = row_q.expand(3, 2, 5, 16), row_k.expand(3, 2, 5, 16)
    ids = torch.arange(5) + torch.tensor([[0], [37], [400]])
    qr, kr = m(q, k, position_ids=ids)
    scores = qr @ kr.transpose(-1, -2)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[2], scores[0], rtol=1e-5, atol=1e-5)


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
        (dict(angle_dtype=None), ValueError, r"angle_dtype must be 'float64'.*got None"),
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
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match) as e:
            call()
        assert "incompatible function arguments" not in str(e.value) and "k must be float32" not in str(e.value)
    snap.check()
    # an int in k's slot is start_pos
    assert torch.equal(m(x, 5), m(x, start_pos=5))


def test_module_to_device(device):
    py = rotary.RotaryEmbedding(64, 128, interleaved=False)
    cpp = rotary.CppRotaryEmbedding(64, 128, 10000.0, False)
    before = py.freqs.clone()
    py.to(device, torch.float16)
    cpp.to(torch.device(device))
    for m in (py, cpp):
        assert m.freqs.device.type == device and m.freqs.dtype == torch.complex64
        assert torch.equal(m.freqs.cpu(), before)
    x = make_heads(2, 4, 10, 64, torch.float16, seed=262, device=device)
    assert_close_ref(py(x, start_pos=100), rope_reference(x, 100, False), torch.float16)
    assert torch.equal(py(x, start_pos=100), cpp(x, start_pos=100))
    # Past the 128 cached rows the module computes the rotation from inv_freq.
    assert_close_ref(py(x, start_pos=119), rope_reference(x, 119, False), torch.float16)
    assert_close_ref(cpp(x, start_pos=5000), rope_reference(x, 5000, False), torch.float16)
