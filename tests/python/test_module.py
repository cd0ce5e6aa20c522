"""rotary.RotaryEmbedding (Python nn.Module) and rotary.CppRotaryEmbedding
(the C++ module bound through torch.nn.cpp.ModuleWrapper): construction, the
freqs / inv_freq buffers, forward, dtype casts, state_dict and devices.
What a call accepts and refuses is in test_module_checks.py, the
relative-position property in test_module_relative.py."""

import io

import numpy as np
import pytest
import torch
from torch import nn

import rotary
from rotary_testing.reference import freqs_reference, inv_freq, rope_reference
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


@pytest.mark.parametrize("kind", ["py", "cpp", "kv"])
def test_share_memory_reaches_the_buffers(kind):
    """nn.Module.share_memory (an in-place step through _apply) moves the
    modules' own buffers to shared memory, values and dtypes kept, and the
    module rotates as before."""
    m = rotary.KVCache(1, 2, 8, 16) if kind == "kv" else make_module(kind, 16, 32)
    parent = nn.Sequential(m, nn.Linear(2, 2))
    before = {n: b.clone() for n, b in m.named_buffers()}
    assert parent.share_memory() is parent and parent[1].weight.is_shared()
    for n, b in m.named_buffers():
        assert b.is_shared() and b.dtype == before[n].dtype and torch.equal(b, before[n]), n
    if kind != "kv":
        x = make_heads(1, 2, 3, 16, torch.float32, seed=61)
        assert_close_ref(m(x, start_pos=40), rope_reference(x, 40, True), torch.float32)


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


def test_built_under_a_device_context():
    """`with torch.device("meta"):` (a large model's empty init) puts the
    tables there, as nn.Module's own buffers; to_empty rebuilds them from
    the options, and a state_dict loads into them."""
    with torch.device("meta"):
        rope = rotary.RotaryEmbedding(64, 128, interleaved=False)
        assert rope(torch.empty(1, 2, 8, 64), start_pos=3).device.type == "meta"
    assert rope.freqs.device.type == "meta" and rope.inv_freq.device.type == "meta"
    built = rotary.RotaryEmbedding(64, 128, interleaved=False)
    rope.to_empty(device="cpu")
    assert torch.equal(rope.freqs, built.freqs) and torch.equal(rope.inv_freq, built.inv_freq)
    rope.load_state_dict(built.state_dict())
    x = make_heads(1, 2, 8, 64, torch.float32, seed=263)
    assert_close_ref(rope(x, start_pos=3), rope_reference(x, 3, False), torch.float32)


@pytest.mark.parametrize("kind", ["python", "cpp"])
def test_a_state_dict_without_the_tables_loads_strictly(kind):
    """The tables follow from the options: a model checkpoint saved without
    them (or from a module with another max_seq_len, its tables left out)
    loads under a strict load, and the module keeps and rotates with its own."""
    make = (lambda n: rotary.RotaryEmbedding(64, n)) if kind == "python" else \
        (lambda n: rotary.CppRotaryEmbedding(64, n, 10000.0, True))
    saved = nn.ModuleDict({"rope": make(64), "proj": nn.Linear(4, 4)})
    state = {k: v for k, v in saved.state_dict().items() if not k.startswith("rope.")}
    model = nn.ModuleDict({"rope": make(256), "proj": nn.Linear(4, 4)})
    before = model["rope"].freqs.clone()
    model.load_state_dict(state)  # strict
    assert torch.equal(model["proj"].weight, saved["proj"].weight) and torch.equal(model["rope"].freqs, before)
    x = make_heads(1, 2, 8, 64, torch.float32, seed=264)
    assert_close_ref(model["rope"](x, start_pos=200), rope_reference(x, 200, True), torch.float32)
    one = dict(state, **{"rope.freqs": saved["rope"].freqs})  # one table alone is still missing its pair
    with pytest.raises(RuntimeError, match="inv_freq"):
        model.load_state_dict(one)
