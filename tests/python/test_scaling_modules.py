"""Frequency (scaling) rules in the modules: RotaryEmbedding(scaling=...) and
CppRotaryEmbedding(scaling=...). The host-driven rules (dynamic, longrope)
switching tables as positions grow and shrink, and the module plumbing
(casts, state_dict, copies, position_ids, compile) with a rule set.
Split from test_scaling.py (the rules against the published formulas)."""

import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

import rotary
from test_scaling_errors import YARN64
from test_state import DYNAMIC, LONGROPE


def _qk(batch, seq, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, seq, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, 2, seq, head_dim, generator=g).to(dtype)
    return q, k


# ---------------------------------------------------------------------------
# Host-driven rules in the modules
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_dynamic_state_machine(kind):
    p = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 32}
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(8, 48, 10000.0, True, scaling=p)

    def expect(seq_len, rows):
        inv, _ = rotary.inv_frequencies(8, 10000.0, p, seq_len)
        assert torch.equal(m.inv_freq, inv), (seq_len, m.inv_freq, inv)
        assert m.freqs.shape == (rows, 4)
        assert torch.equal(m.freqs, rotary.freqs_table(8, rows, 10000.0, p, seq_len))

    x = torch.randn(1, 1, 4, 8)
    expect(0, 48)
    m(x, start_pos=20)          # reach 24 <= 32: unchanged
    expect(0, 48)
    m(x, start_pos=36)          # reach 40 > 32: grows (row 0 alone, the rest on the fly)
    expect(40, 1)
    m(x, start_pos=60)          # reach 64: grows
    expect(64, 1)
    y = m(x, start_pos=40)      # reach 44 (between 32 and 64): kept
    expect(64, 1)
    ref = rotary.apply_rope(x, rotary.freqs_table(8, 64, 10000.0, p, 64), 40, True)
    assert torch.equal(y, ref)  # the on-the-fly path gives the table's bits
    m(x, start_pos=32)          # reach 36: still kept (not under 32)
    expect(64, 1)
    m(x, start_pos=10)          # reach 14 < 32: back to the original
    expect(0, 48)
    # position ids count as well: the largest id decides
    m(x, position_ids=torch.tensor([[0, 1, 2, 99]]))
    expect(100, 1)


@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_longrope_switches(kind):
    p = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 5.0, 7.0, 9.0],
         "original_max_position_embeddings": 16, "factor": 4.0}
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(8, 64, 10000.0, False, scaling=p)
    short, att = rotary.inv_frequencies(8, 10000.0, p, 0)
    long, att_long = rotary.inv_frequencies(8, 10000.0, p, 17)
    assert att == att_long == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(16)))
    x = torch.randn(2, 2, 4, 8)
    for start, want in [(0, short), (12, short), (13, long), (40, long), (11, short)]:
        m(x, start_pos=start)
        assert torch.equal(m.inv_freq, want), start
        assert torch.equal(m.freqs, rotary.freqs_table(8, 64, 10000.0, p, 17 if want is long else 0))
    # offsets [batch] count: start_pos + offset + seq
    m(x, offsets=torch.tensor([0, 13]))
    assert torch.equal(m.inv_freq, long)


def test_static_rules_never_rebuild():
    m = rotary.RotaryEmbedding(8, 32, scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 8})
    freqs = m.freqs
    m(torch.randn(1, 1, 32, 8))
    assert m.freqs is freqs


def test_host_driven_is_public():
    for cls in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        assert cls(8, 64, scaling={"rope_type": "dynamic", "factor": 2.0}).host_driven
        assert not cls(8, 64, scaling=YARN64).host_driven
        assert not cls(8, 64).host_driven
    assert rotary._C.RopeTables(8, 64, scaling={"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                "long_factor": [2.0] * 4, "original_max_position_embeddings": 8,
                                                "factor": 2.0}).host_driven


@pytest.mark.parametrize("rule", [
    {**YARN64, "beta_fast": 16.0, "mscale": 0.5, "mscale_all_dim": 1.0, "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.5}, DYNAMIC, LONGROPE,
], ids=["yarn", "llama3", "linear", "dynamic", "longrope"])
def test_the_scaling_property_rebuilds_the_same_rule(rule):
    """RotaryEmbedding.scaling is documented as a dict that builds the same
    rule: a field it left out would silently fall back to its default."""
    m = rotary.RotaryEmbedding(8, 96, 500.0, scaling=rule)
    again = rotary.RotaryEmbedding(8, 96, 500.0, scaling=m.scaling)
    assert again.scaling == m.scaling and set(m.scaling) <= set(rule)
    assert torch.equal(again.inv_freq, m.inv_freq) and torch.equal(again.freqs, m.freqs)
    assert again.attention_scaling == m.attention_scaling
    if m.host_driven:  # and the same tables past the original context
        q = torch.randn(1, 1, 80, 8, dtype=torch.float64)
        torch.testing.assert_close(again(q), m(q), rtol=0, atol=0)
        assert torch.equal(again.inv_freq, m.inv_freq)


# ---------------------------------------------------------------------------
# Module plumbing: casts, state_dict, copies, position_ids, compile
# ---------------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("kind", ["py", "cpp"])
@pytest.mark.parametrize("cast", ["half", "bf16", "double", "nested_half", "nested_bf16"])
def test_casts_leave_both_buffers(kind, cast):
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(16, 32, 10000.0, False, scaling=YARN)
    before = (m.freqs.clone(), m.inv_freq.clone())
    parent = nn.Sequential(nn.Linear(4, 4), m)
    if cast == "half":
        m.half()
    elif cast == "bf16":
        m.to(torch.bfloat16)
    elif cast == "double":
        m.double()
    elif cast == "nested_half":
        parent.half()
        assert parent[0].weight.dtype == torch.float16
    else:
        parent.to(torch.bfloat16)
        assert parent[0].weight.dtype == torch.bfloat16
    assert m.freqs.dtype == torch.complex64 and torch.equal(m.freqs, before[0])
    assert m.inv_freq.dtype == torch.float64 and torch.equal(m.inv_freq, before[1])


@pytest.mark.parametrize("src,dst", [("py", "cpp"), ("cpp", "py"), ("py", "py"), ("cpp", "cpp")])
def test_state_dict_moves_both_buffers(src, dst, tmp_path):
    make = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}
    a = make[src](16, 32, 777.0, False, scaling=YARN)
    path = tmp_path / "rope.pt"
    torch.save(a.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    assert list(sd) == ["freqs", "inv_freq"]
    # Tables saved with other options are refused, never silently installed.
    with pytest.raises(RuntimeError, match=r"saved tables do not match this module"):
        make[dst](16, 32, 10000.0, False).load_state_dict(sd)
    b = make[dst](16, 32, 777.0, False, scaling=YARN)
    with torch.no_grad():  # loading must restore both buffers
        b.freqs.zero_()
        b.inv_freq.mul_(2.0)
    result = b.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(b.freqs, a.freqs) and torch.equal(b.inv_freq, a.inv_freq)
    assert b.inv_freq.dtype == torch.float64
    q, k = _qk(1, 5, 16, torch.float32, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a(q, k, start_pos=3), b(q, k, start_pos=3)))


def test_python_module_copies_and_repr():
    m = rotary.RotaryEmbedding(16, 32, scaling={"type": "linear", "factor": 2})
    assert m.scaling == {"rope_type": "linear", "factor": 2.0}
    assert "scaling={'rope_type': 'linear', 'factor': 2.0}" in repr(m)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.scaling == m.scaling and torch.equal(c.freqs, m.freqs) and torch.equal(c.inv_freq, m.inv_freq)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert torch.equal(again.inv_freq, m.inv_freq)
    assert rotary.RotaryEmbedding(16).scaling is None


@pytest.mark.parametrize("kind", ["py", "cpp"])
def test_position_ids(kind):
    cls = rotary.RotaryEmbedding if kind == "py" else rotary.CppRotaryEmbedding
    m = cls(16, 64, 10000.0, False, scaling=YARN)
    q, k = _qk(2, 6, 16, torch.float32, seed=4)
    pid = torch.tensor([[5, 9, 3, 0, 60, 63], [1, 2, 3, 4, 5, 6]])
    qo, ko = m(q, k, position_ids=pid)
    qr, kr = rotary.apply_rope_qk(q, k, m.freqs, 0, False, position_ids=pid)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)
    with pytest.warns(DeprecationWarning, match="positions= is deprecated"):
        assert torch.equal(m(q, position_ids=pid), m(q, positions=pid))
    with pytest.raises(ValueError, match="pass offsets= or position_ids= alone|pass offsets or position_ids alone"):
        m(q, k, positions=pid, position_ids=pid)


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_an_empty_call_leaves_a_host_driven_state_alone(cls):
    """A call of no tokens reaches nothing, whatever its start_pos: the table
    stays as it was, and the next call rotates as a fresh module's."""
    m, fresh = cls(16, 64, scaling=DYNAMIC), cls(16, 64, scaling=DYNAMIC)
    m(torch.randn(1, 2, 0, 16), start_pos=1000)
    assert m.rope_state == 0 and m.freqs.shape[0] == 64
    x = torch.randn(1, 1, 1, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m(x, start_pos=100), fresh(x, start_pos=100))


@pytest.mark.parametrize("rule", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_compile_fullgraph_of_a_host_driven_rule_names_why(rule):
    """The host step is a graph break with a reason (Dynamo's own words name
    a pybind function); without fullgraph it runs eagerly and rotates as the
    module does, state recorded."""
    m = rotary.RotaryEmbedding(8, 64, scaling=rule)
    q, k = _qk(1, 8, 8, torch.float32, seed=9)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"dynamic or longrope rule rebuilds its tables on the "
                                                             r"host.*update_for_reach\(reach\)"):
        torch.compile(lambda q, k: m(q, k, start_pos=3), fullgraph=True, backend="eager")(q, k)
    torch._dynamo.reset()
    twin = rotary.RotaryEmbedding(8, 64, scaling=rule)
    compiled = torch.compile(lambda q, k, s: m(q, k, start_pos=s), backend="eager")
    for start in (3, 70, 5):  # past the threshold and back
        for a, b in zip(compiled(q, k, start), twin(q, k, start_pos=start)):
            assert torch.equal(a, b)
        assert m.rope_state == twin.rope_state and (m.rope_state > 0) == (start == 70)


def test_compile_static_rule():
    m = rotary.RotaryEmbedding(16, 64, scaling=YARN)
    q, k = _qk(1, 8, 16, torch.float32, seed=9)
    pid = torch.arange(8).add(20).unsqueeze(0)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    for a, b in zip(compiled(q, k, position_ids=pid), m(q, k, position_ids=pid)):
        assert torch.equal(a, b)
