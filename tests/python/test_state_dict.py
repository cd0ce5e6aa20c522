"""Module state: state_dict round trips (torch.save / torch.load, nested in a
parent, partial, across the Python and C++ modules), and loading tables that
do not match the options (other theta / rule / max_seq_len / dim /
angle_dtype, corrupted, meta or non-tensor entries): a load error, nothing
installed. Split from test_state.py (which holds the module specs) to keep
files short."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import rotary
from test_state import DYNAMIC, LONGROPE, MODULES, YARN, gen


# ---------------------------------------------------------------------------
# Loading a table that is not this module's
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MODULES))
def test_load_meta_or_non_tensor_is_a_load_error(kind):
    m = MODULES[kind](8, 32)
    sd = m.state_dict()
    with pytest.raises(RuntimeError, match=r"'freqs' is a meta tensor"):
        m.load_state_dict({"freqs": sd["freqs"].to("meta"), "inv_freq": sd["inv_freq"]})
    with pytest.raises(RuntimeError, match=r"'inv_freq' must be a tensor.*got \[1.0, 2.0\]"):
        m.load_state_dict({"freqs": sd["freqs"], "inv_freq": [1.0, 2.0]})
    before = m.freqs.clone()
    with pytest.raises(RuntimeError, match=r"the saved 'freqs' must be a tensor, got None"):  # not left out
        torch.nn.Sequential(m).load_state_dict({"0.freqs": None, "0.inv_freq": sd["inv_freq"]})
    assert torch.equal(m.freqs, before)


@pytest.mark.parametrize("kind", list(MODULES))
# mkldnn holds no complex tensor: no mkldnn freqs.
@pytest.mark.parametrize("key,form", [("freqs", "sparse COO"), ("freqs", "nested"), ("inv_freq", "sparse COO"),
                                      ("inv_freq", "mkldnn"), ("inv_freq", "nested")])
def test_load_of_a_tensor_without_strides_is_a_load_error(kind, key, form):
    """Named among the load's errors (a parent's load reports it with the
    rest), the buffers kept."""
    m = MODULES[kind](8, 32)
    sd = m.state_dict()
    before = {n: b.clone() for n, b in m.named_buffers()}
    t = sd[key]
    if form == "mkldnn":
        t = t.float().to_mkldnn()
    else:
        t = t.to_sparse() if form == "sparse COO" else torch.nested.nested_tensor([t])
    parent = nn.Sequential(m)
    with pytest.raises(RuntimeError, match=rf"the saved '{key}' must be a dense \(strided\) tensor, got an? {form}"):
        parent.load_state_dict({f"0.{k}": (t if k == key else v) for k, v in sd.items()})
    for n, b in m.named_buffers():
        assert torch.equal(b, before[n]), n


@pytest.mark.parametrize("src,dst", [("py", "py"), ("cpp", "cpp"), ("py", "cpp"), ("cpp", "py")])
def test_load_other_angle_dtype_short_table(src, dst):
    """A 32-row table differs between the angle dtypes by less than the
    entry tolerance (2^-22); it is still refused (it is the other one's table)."""
    a = MODULES[src](8, 32)
    b = MODULES[dst](8, 32, angle_dtype="float32")
    assert 0 < (a.freqs - b.freqs).abs().max() < 2**-22
    assert not torch.equal(a.freqs, b.freqs)
    with pytest.raises(RuntimeError, match=r"'freqs' is the table of angle_dtype=float64"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(RuntimeError, match=r"'freqs' is the table of angle_dtype=float32"):
        a.load_state_dict(b.state_dict())


# ---------------------------------------------------------------------------
# state_dict round trips
# ---------------------------------------------------------------------------
SPECS = [
    ("default", dict()),
    ("yarn", dict(scaling=YARN)),
    ("fp32-angles", dict(angle_dtype="float32")),
    ("longrope", dict(scaling=LONGROPE)),
    ("dynamic", dict(scaling=DYNAMIC)),
]


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("spec", [s for _, s in SPECS], ids=[n for n, _ in SPECS])
@pytest.mark.parametrize("src,dst", [("py", "py"), ("cpp", "cpp"), ("py", "cpp"), ("cpp", "py")])
def test_state_dict_round_trip(src, dst, spec):
    a = MODULES[src](8, 64, 500.0, False, **spec)
    x = torch.randn(1, 2, 8, 8, generator=gen(1))
    if spec.get("scaling") in (DYNAMIC, LONGROPE):
        a(x, 300)  # move the host-driven rule out of its initial state (grown / long factors)
    sd = _save_load(a.state_dict())
    assert list(sd) == ["freqs", "inv_freq"]
    b = MODULES[dst](8, 64, 500.0, False, **spec)
    result = b.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(b.freqs, a.freqs) and torch.equal(b.inv_freq, a.inv_freq)
    assert b.freqs.dtype == torch.complex64 and b.inv_freq.dtype == torch.float64
    far = 40 if spec.get("angle_dtype") == "float32" else 300  # float32 tables are not extended
    assert torch.equal(b(x, 5), a(x, 5)) and torch.equal(b(x, far), a(x, far))


@pytest.mark.parametrize("kind", list(MODULES))
def test_state_dict_nested_in_parent(kind):
    a = nn.ModuleDict({"rope": MODULES[kind](8, 32, 321.0)})
    b = nn.ModuleDict({"rope": MODULES[kind](8, 32, 321.0)})
    sd = _save_load(a.state_dict())
    assert set(sd) == {"rope.freqs", "rope.inv_freq"}
    b.load_state_dict(sd)
    assert torch.equal(b["rope"].freqs, a["rope"].freqs)
    with pytest.raises(RuntimeError, match=r"theta=10000"):
        nn.ModuleDict({"rope": MODULES[kind](8, 32)}).load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"Unexpected key.*rope\.extra"):
        b.load_state_dict({**sd, "rope.extra": torch.zeros(1)})


class _Leaf(nn.Module):
    """torch's own _load_from_state_dict, over buffers of the given names."""

    def __init__(self, state):
        super().__init__()
        for name, t in state.items():
            if isinstance(t, torch.Tensor):
                self.register_buffer(name, t.clone())


class _LeafWithExtraState(_Leaf):
    def get_extra_state(self):
        return {}

    def set_extra_state(self, state):
        pass


@pytest.mark.parametrize("kind", [*MODULES, "kv"])
def test_unexpected_keys_follow_torchs_rule(kind):
    """Keys under the module's prefix that it does not own, dotted ones
    included, are unexpected as torch reports them for a module without
    children; '_extra_state' is the KVCache's own."""
    make = (lambda: rotary.KVCache(1, 2, 4, 8)) if kind == "kv" else (lambda: MODULES[kind](8, 32))
    own = make().state_dict()
    extra = {"p.x": torch.ones(1), "p.x.y": torch.ones(1), "px": torch.ones(1), "q.x": torch.ones(1)}
    sd = {**{"p." + k: v for k, v in own.items()}, **extra, "p._extra_state": own.get("_extra_state", {})}
    leaf = _LeafWithExtraState if "_extra_state" in own else _Leaf
    want = nn.ModuleDict({"p": leaf(own)}).load_state_dict(sd, strict=False)
    got = nn.ModuleDict({"p": make()}).load_state_dict(sd, strict=False)
    assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys)
    assert set(got.unexpected_keys) == {*extra, *(["p._extra_state"] if kind != "kv" else [])}
    assert got.missing_keys == want.missing_keys == []


def _mismatches():
    """(id, saved-from options, loading-into options, expected message)."""
    base = dict(dim=8, max_seq_len=32, theta=10000.0)
    long = dict(base, max_seq_len=1024)
    return [
        ("theta", dict(base, theta=500000.0), base, r"theta=10000.*'inv_freq'\[1\] = .* but these options give"),
        ("rule", dict(base, scaling=YARN), base, r"'inv_freq'\[\d\] = .* but these options give"),
        ("factor", dict(base, scaling=dict(YARN, factor=8.0)), dict(base, scaling=YARN), r"inv_freq"),
        ("max-seq-len", dict(base, max_seq_len=48), base, r"'freqs' has 48 rows but this module's max_seq_len is 32"),
        ("dim", dict(base, dim=16), base, r"'freqs' must be complex64 \[rows, dim / 2\] = \[\*, 4\], got ComplexFloat \[32, 8\]"),
        # float32 and float64 angles differ by less than the tolerance (2^-22)
        # in the first rows; a 1024-row table tells them apart. (A shorter
        # one loads, and is rebuilt with the module's own angle_dtype.)
        ("angle-dtype", dict(long, angle_dtype="float32"), long, r"angle_dtype=float64.*'freqs' row \d+, pair \d+ differs by"),
        ("angle-dtype-back", long, dict(long, angle_dtype="float32"), r"'freqs' row \d+, pair \d+ differs by"),
    ]


def _make(kind, o):
    o = dict(o)
    args = (o.pop("dim"), o.pop("max_seq_len"), o.pop("theta"))
    return MODULES[kind](*args, **o)


@pytest.mark.parametrize("case", _mismatches(), ids=[m[0] for m in _mismatches()])
@pytest.mark.parametrize("src,dst", [("py", "py"), ("cpp", "cpp"), ("py", "cpp"), ("cpp", "py")])
def test_load_mismatched_tables_is_an_error(src, dst, case):
    _, saved_opts, opts, match = case
    sd = _make(src, saved_opts).state_dict()
    b = _make(dst, opts)
    before = (b.freqs.clone(), b.inv_freq.clone())
    with pytest.raises(RuntimeError, match=match) as e:
        b.load_state_dict(sd)
    assert "Error(s) in loading state_dict" in str(e.value) and "load_state_dict: " in str(e.value)
    # nothing was installed
    assert torch.equal(b.freqs, before[0]) and torch.equal(b.inv_freq, before[1])


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_load_in_place_into_state_dict_leaves_the_tables(kind, tmp_path):
    """torch.distributed.checkpoint loads into the tensors state_dict() hands
    out, then load_state_dict checks them: the tables handed out are copies,
    so a refused load (or none) leaves the module rotating by its options."""
    import torch.distributed.checkpoint as dcp

    dcp.save(MODULES[kind](16, 32, theta=500.0).state_dict(), checkpoint_id=str(tmp_path))
    m = MODULES[kind](16, 32)
    before = (m.freqs.clone(), m.inv_freq.clone())
    sd = m.state_dict()
    with pytest.warns(UserWarning):  # no process group: DCP says it loads on this process alone
        dcp.load(sd, checkpoint_id=str(tmp_path))
    assert sd["inv_freq"][1] != before[1][1]  # the other theta's tables reached the dict
    with pytest.raises(RuntimeError, match=r"load_state_dict: the saved tables do not match"):
        m.load_state_dict(sd)
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    x = torch.randn(1, 1, 4, 16, generator=gen(3))
    assert torch.equal(m(x, start_pos=3), MODULES[kind](16, 32)(x, start_pos=3))
    sd["freqs"].mul_(2)  # a copy: writing it changes nothing
    assert torch.equal(m.freqs, before[0])
    assert m.state_dict(keep_vars=True)["freqs"] is m.freqs  # keep_vars: the tensors themselves


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda sd: sd["freqs"].__setitem__((5, 1), sd["freqs"][5, 1] * 1.001), r"'freqs' row 5, pair 1 differs"),
        (lambda sd: sd["freqs"].__setitem__((3, 0), complex("nan+nanj")), r"'freqs' row 3, pair 0 differs"),
        (lambda sd: sd.__setitem__("freqs", torch.view_as_real(sd["freqs"])), r"'freqs' must be complex64"),
        (lambda sd: sd.__setitem__("inv_freq", sd["inv_freq"].float()), r"'inv_freq' must be float64"),
        (lambda sd: sd["inv_freq"].mul_(1 + 1e-9), r"'inv_freq'\[0\] = 1.000000001"),
    ],
    ids=["one-entry", "nan-entry", "real-freqs", "float32-inv-freq", "inv-freq-off-by-1e-9"],
)
def test_load_corrupted_tables_is_an_error(kind, corrupt, match):
    sd = {k: v.clone() for k, v in MODULES[kind](8, 32).state_dict().items()}
    corrupt(sd)
    m = MODULES[kind](8, 32)
    with pytest.raises(RuntimeError, match=match):
        m.load_state_dict(sd)


@pytest.mark.parametrize("kind", list(MODULES))
def test_negative_bit_tables_are_checked_by_the_values_they_show(kind):
    """A table with the negative bit was checked by its memory: an inv_freq
    showing -inv_freq loaded, one showing exactly the module's was refused."""
    sd = MODULES[kind](16, 64).state_dict()
    m = MODULES[kind](16, 64)
    before = (m.freqs.clone(), m.inv_freq.clone())
    with pytest.raises(RuntimeError, match=r"'inv_freq'\[0\] = -1"):
        m.load_state_dict({**sd, "inv_freq": sd["inv_freq"].clone()._neg_view()})
    with pytest.raises(RuntimeError, match=r"'freqs' row 0, pair 0 differs"):
        m.load_state_dict({**sd, "freqs": sd["freqs"].clone()._neg_view()})
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    m.load_state_dict({"inv_freq": (-sd["inv_freq"])._neg_view(), "freqs": (-sd["freqs"])._neg_view()})
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])


@pytest.mark.parametrize("kind", list(MODULES))
def test_partial_state_dict(kind):
    a = MODULES[kind](8, 32, 321.0)
    b = MODULES[kind](8, 32, 321.0)
    r = b.load_state_dict({"freqs": a.freqs.clone()}, strict=False)
    assert r.missing_keys == ["inv_freq"] and torch.equal(b.freqs, a.freqs)
    r = b.load_state_dict({"inv_freq": a.inv_freq.clone()}, strict=False)
    assert r.missing_keys == ["freqs"]
    with pytest.raises(RuntimeError, match=r"'inv_freq'\[1\]"):
        b.load_state_dict({"inv_freq": torch.ones(4, dtype=torch.float64)}, strict=False)
    with pytest.raises(RuntimeError, match=r"Missing key"):
        b.load_state_dict({"freqs": a.freqs.clone()})


@pytest.mark.parametrize("angle_dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_a_grown_dynamic_freqs_loaded_alone_names_what_is_missing(kind, angle_dtype):
    """A grown dynamic table that kept max_seq_len rows (or its one row),
    loaded without its inv_freq into a module of the same options, was
    refused as "saved from a module with other options". It says that
    freqs alone cannot tell a grown length from other options; with
    inv_freq it loads."""
    rule = {"rope_type": "dynamic", "factor": 4.0, "max_position_embeddings": 32}
    a, b = (MODULES[kind](16, 64, scaling=rule, angle_dtype=angle_dtype) for _ in range(2))
    a(torch.randn(1, 1, 45, 16))  # grown to 45, the table keeps its rows
    words = (r"do not match this module's initial state .*'freqs' alone, of \d+ row\(s\), cannot tell a length this "
             r"dynamic rule grew to from other options: load the saved 'inv_freq' with it")
    with pytest.raises(RuntimeError, match=words):
        b.load_state_dict({"freqs": a.freqs.clone()}, strict=False)
    other = MODULES[kind](16, 64, 5e5, scaling=rule, angle_dtype=angle_dtype)  # another theta, never grown
    with pytest.raises(RuntimeError, match=words):
        b.load_state_dict({"freqs": other.freqs.clone()}, strict=False)
    b.load_state_dict(a.state_dict())
    assert b.rope_state == a.rope_state == 45 and torch.equal(b.freqs, a.freqs)


def test_load_restores_host_driven_state():
    """A dynamic module saved after growing (row 0 alone, the grown inv_freq)
    loads into a fresh one: same grown state, and it still shrinks back."""
    a = rotary.RotaryEmbedding(8, 64, scaling=DYNAMIC)
    x = torch.randn(1, 1, 4, 8)
    a(x, 196)  # reach 200 > 64: grown
    assert a.freqs.shape[0] == 1 and a.rope_state == 200
    b = rotary.RotaryEmbedding(8, 64, scaling=DYNAMIC)
    b.load_state_dict(a.state_dict())
    assert b.freqs.shape[0] == 1 and b.rope_state == 200 and torch.equal(b.inv_freq, a.inv_freq)
    assert torch.equal(b(x, 150), a(x, 150))
    assert torch.equal(b(x, 10), rotary.RotaryEmbedding(8, 64, scaling=DYNAMIC)(x, 10))
    assert b.freqs.shape[0] == 64
