"""The modules' options as attributes: read back, read-only. An assignment
was taken by one path and not another (a rotary_offset that forward read and
forward_with_cache did not; mrope_section written and never read; the C++
module's copies read back the new value and rotated with the old), and a
freqs swapped alone served positions past the table from the old inv_freq."""

import pytest
import torch
from torch.func import functional_call

import rotary
from rotary_testing.reference import rope_reference

OPTIONS = ("dim", "max_seq_len", "theta", "interleaved", "scaling", "angle_dtype", "rotary_offset", "mrope_section",
           "mrope_interleaved", "axes_dim", "pair_axes", "attention_scaling", "host_driven")
BUILT = {"plain": dict(dim=16, max_seq_len=8, rotary_offset=4),
         "mrope": dict(dim=16, max_seq_len=8, mrope_section=[4, 2, 2]),
         "axial": dict(dim=16, max_seq_len=8, axes_dim=[8, 8]),
         "yarn": dict(dim=16, max_seq_len=8, scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 4})}


def _call(m, kind, q):
    if kind in ("mrope", "axial"):
        ids = torch.randint(0, 12, (3 if kind == "mrope" else 2, 1, q.size(2)))
        return m(q, position_ids=ids), ids
    return m(q, start_pos=5), None


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
@pytest.mark.parametrize("kind", list(BUILT))
def test_options_read_back_and_refuse_assignment(cls, kind):
    torch.manual_seed(0)
    m, q = cls(**BUILT[kind]), torch.randn(1, 2, 6, 20, dtype=torch.float64)
    values = {name: getattr(m, name) for name in OPTIONS}
    out, ids = _call(m, kind, q)
    for name in OPTIONS:
        given = 1 if isinstance(values[name], bool) else [2, 2, 4] if isinstance(values[name], list) else 3
        with pytest.raises(AttributeError, match=name):
            setattr(m, name, given)
        assert getattr(m, name) == values[name], name
    for name in ("mrope_section", "axes_dim", "pair_axes"):  # lists are copies
        if values[name] is not None:
            getattr(m, name)[0] += 1
            assert getattr(m, name) == values[name], name
    again = m(q, position_ids=ids) if ids is not None else m(q, start_pos=5)
    assert torch.equal(again, out)


def test_rotary_offset_is_the_one_built_with_on_every_path():
    torch.manual_seed(1)
    m = rotary.RotaryEmbedding(8, 16, rotary_offset=4)
    with pytest.raises(AttributeError, match="rotary_offset"):
        m.rotary_offset = 0
    q, k, v = (torch.randn(1, 2, 1, 12, dtype=torch.float64) for _ in range(3))
    want = rope_reference(q[..., 4:8 + 4], 3, interleaved=True)
    cache = rotary.KVCache(1, 2, 4, 12, dtype=torch.float64)
    got, _, _ = m.forward_with_cache(q.clone(), k.clone(), v, cache, start_pos=3)
    torch.testing.assert_close(got[..., 4:12], want, rtol=0, atol=1e-6)
    assert torch.equal(got[..., :4], q[..., :4])
    torch.testing.assert_close(m(q, start_pos=3), got, rtol=0, atol=0)


def test_cpp_wrapper_message_names_the_attribute():
    m = rotary.CppRotaryEmbedding(16, 8)
    with pytest.raises(AttributeError, match=r"rotary\.CppRotaryEmbedding\.theta is read-only, got an assignment of "
                                             r"500\.0: .*build a new rotary\.CppRotaryEmbedding"):
        m.theta = 500.0
    assert m.theta == 10000.0 and "theta" not in vars(m)
    cache = rotary.KVCache(1, 2, 8, 16)
    with pytest.raises(AttributeError, match=r"rotary\.KVCache\.capacity is read-only"):
        cache.capacity = 4
    assert cache.capacity == 8


def test_tables_are_one_pair():
    """An assignment of either table is a checked load of that piece: another
    module's table is refused (nothing changed), this module's own installs a
    checked pair; functional_call with both is the other module's rotation."""
    torch.manual_seed(2)
    m, other = rotary.RotaryEmbedding(16, 8), rotary.RotaryEmbedding(16, 8, theta=500.0)
    before = m.freqs.clone(), m.inv_freq.clone()
    for name in ("freqs", "inv_freq"):
        with pytest.raises(ValueError, match=rf"RotaryEmbedding\.{name} = \.\.\.: the saved tables do not match"):
            setattr(m, name, getattr(other, name).clone())
        with pytest.raises(ValueError, match=rf"RotaryEmbedding\.register_buffer\('{name}'\): the saved tables"):
            m.register_buffer(name, getattr(other, name).clone())
        with pytest.raises(TypeError, match=rf"RotaryEmbedding\.{name} = \.\.\.: {name} must be a tensor"):
            setattr(m, name, [1.0])
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    m.freqs = before[0].clone()  # its own table: accepted, the pair rebuilt
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    m.register_buffer("freqs", before[0].clone(), persistent=False)  # persistent honoured
    assert list(m.state_dict()) == ["inv_freq"]
    q = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    for start in (2, 30):  # inside the table and past it: the other module's rotation
        got = functional_call(m, {"freqs": other.freqs, "inv_freq": other.inv_freq}, (q,), {"start_pos": start})
        torch.testing.assert_close(got, rope_reference(q, start, interleaved=True, base=500.0), rtol=0, atol=1e-6)
    m.inv_freq = before[1].to("meta")  # a meta piece: the pair goes to meta, as a move would
    assert m.freqs.is_meta and m.inv_freq.is_meta
    m.freqs = before[0].clone()  # into meta tables: checked, the pair back on the CPU
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    m.inv_freq = before[1].to("meta")
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.freqs = \.\.\.: the saved tables do not match"):
        m.freqs = other.freqs.clone()


@pytest.mark.parametrize("rule", [None, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}],
                         ids=["default", "dynamic-grown"])
@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_tables_cannot_be_deleted_or_parametrized(cls, rule):
    """forward reads both tables: one deleted (parametrize deletes it first)
    raised KeyError at the next call. Refused by name, nothing changed: a
    right_inverse, which parametrize writes into the table before deleting
    it, is undone (a grown dynamic rule keeps its state)."""
    import torch.nn.utils.parametrize as parametrize

    class Same(torch.nn.Module):
        def forward(self, t):
            return t

    class Halved(torch.nn.Module):
        def forward(self, t):
            return t * 0.5

        def right_inverse(self, t):
            return t * 2

    m = cls(16, 32, scaling=rule)
    q = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    grown = m(q, start_pos=3)  # a dynamic rule grows past its 16 positions
    before = m.freqs.clone(), m.inv_freq.clone()
    # The Python module says the tables are one pair; the C++ one that its tensors are the C++ module's.
    match = r"cannot be deleted or parametrized" if cls is rotary.RotaryEmbedding else r"cannot delete buffer"
    for name in ("freqs", "inv_freq"):
        for parametrization in (Same(), Halved()):
            with pytest.raises((AttributeError, TypeError), match=rf"{cls.__name__}.*{match}"):
                parametrize.register_parametrization(m, name, parametrization)
            assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
        with pytest.raises((AttributeError, TypeError), match=match):
            delattr(m, name)
    assert not parametrize.is_parametrized(m)
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1])
    assert torch.equal(m(q, start_pos=3), grown)
    if rule is None:
        torch.testing.assert_close(grown, rope_reference(q, 3, interleaved=True), rtol=0, atol=1e-6)


def test_transformers_from_pretrained_loads_a_model_holding_the_module(tmp_path):
    """transformers' loader sets each saved buffer with setattr."""
    transformers = pytest.importorskip("transformers")

    class Cfg(transformers.PretrainedConfig):
        model_type = "rotary_attribute_test"

    class Tiny(transformers.PreTrainedModel):
        config_class = Cfg

        def __init__(self, config):
            super().__init__(config)
            self.lin = torch.nn.Linear(16, 16)
            self.rope = rotary.RotaryEmbedding(16, 32)
            self.post_init()

        def forward(self, x):
            return self.rope(self.lin(x), start_pos=3)

    torch.manual_seed(4)
    model = Tiny(Cfg())
    model.save_pretrained(tmp_path)
    x = torch.randn(1, 2, 4, 16)
    loaded = Tiny.from_pretrained(tmp_path)
    assert not loaded.rope.freqs.is_meta
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    # A checkpoint without the module's tables: from_pretrained fills them with uninitialised
    # memory (as any module's missing buffer), which the check refuses rather than serve.
    (tmp_path / "bare").mkdir()
    torch.nn.Module.__delattr__(model, "rope")
    model.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match=r"RotaryEmbedding\.(freqs|inv_freq) = \.\.\.: the saved"):
        Tiny.from_pretrained(tmp_path / "bare")


def test_a_module_pickled_with_plain_option_attributes_loads():
    """Pickles made before the options were read-only hold them as plain
    attributes and no _layout: loaded, the module reads its C++ tables."""
    torch.manual_seed(3)
    m = rotary.RotaryEmbedding(16, 8, rotary_offset=4)
    state = dict(m.__getstate__())
    del state["_layout"]
    state.update(rotary_offset=4, mrope_section=None, mrope_interleaved=False, axes_dim=None, pair_axes=None)
    old = rotary.RotaryEmbedding.__new__(rotary.RotaryEmbedding)
    old.__setstate__(state)
    assert old.rotary_offset == 4 and "rotary_offset" not in vars(old)
    q = torch.randn(1, 2, 3, 20, dtype=torch.float64)
    assert torch.equal(old(q, start_pos=2), m(q, start_pos=2))
