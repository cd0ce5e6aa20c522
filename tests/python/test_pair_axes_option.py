"""The module's explicit pair -> axis map (pair_axes=): a map no mrope_section
names (ERNIE-4.5-VL's h/w pairs, then t), against the float64 reference in
every dtype and layout; its text-token and decode calls, gradients, compile,
copies of both modules, and its refusals by name."""

import copy
import pickle

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference_nd
from rotary_testing.rope_testing import assert_close_ref, gen, randn

pytestmark = pytest.mark.usefixtures("reset_dynamo")

# Four pairs alternate h (1) and w (2), the last two take t (0): 16 dims.
MAP = [1, 2, 1, 2, 0, 0]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _ids(b, s, seed, top=64):
    return torch.randint(0, top, (3, b, s), generator=gen(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_explicit_map_matches_the_reference(dtype, interleaved, device):
    rope = rotary.RotaryEmbedding(12, 64, interleaved=interleaved, pair_axes=MAP, rotary_offset=2).to(device)
    assert rope.pair_axes == MAP and "pair_axes=[1, 2, 1, 2, 0, 0]" in repr(rope)
    q = randn((2, 4, 16, 3), dtype, seed=1, device=device).permute(0, 1, 3, 2)  # non-contiguous [2, 4, 3, 16]
    k = randn((2, 1, 3, 16), dtype, seed=2, device=device)
    pos = _ids(2, 3, 3).to(device)
    oq, ok = rope(q, k, position_ids=pos)
    assert_close_ref(oq, rope_reference_nd(q, pos.cpu().numpy(), MAP, 12, 2, interleaved), dtype)
    assert_close_ref(ok, rope_reference_nd(k, pos.cpu().numpy(), MAP, 12, 2, interleaved), dtype)
    # BSHD: the same rotation of the same memory.
    out = rope(q.transpose(1, 2), position_ids=pos, layout="BSHD")
    assert torch.equal(out.transpose(1, 2), oq)


def test_text_tokens_decode_and_empty_calls():
    """Equal axes are a text token: the 1-D rotation, at start_pos too; S == 1
    and empty calls run."""
    rope = rotary.RotaryEmbedding(12, 64, pair_axes=MAP)
    q = randn((1, 2, 5, 12), seed=4)
    one = torch.arange(7, 12).expand(1, 5)
    assert torch.equal(rope(q, position_ids=one.expand(3, 1, 5)), rope(q, position_ids=one))
    assert torch.equal(rope(q, position_ids=one), rope(q, 7))
    step = randn((1, 2, 1, 12), seed=5)
    pos = _ids(1, 1, 6)
    assert_close_ref(rope(step, position_ids=pos), rope_reference_nd(step, pos.numpy(), MAP, 12), torch.float32)
    empty = randn((1, 2, 0, 12), seed=7)
    assert rope(empty, position_ids=_ids(1, 0, 8)).shape == empty.shape


def test_same_map_as_sections_is_the_same_rotation():
    sections = rotary.RotaryEmbedding(16, 64, mrope_section=[2, 3, 3])
    explicit = rotary.RotaryEmbedding(16, 64, pair_axes=[0, 0, 1, 1, 1, 2, 2, 2])
    q, pos = randn((2, 3, 4, 16), seed=9), _ids(2, 4, 10)
    assert torch.equal(sections(q, position_ids=pos), explicit(q, position_ids=pos))


def test_gradients_and_compile():
    rope = rotary.RotaryEmbedding(12, 64, pair_axes=MAP)
    pos = _ids(1, 3, 11)
    q = randn((1, 2, 3, 12), torch.float64, seed=12).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: rope(x, position_ids=pos), (q,))
    x = randn((1, 2, 3, 12), seed=13)
    compiled = torch.compile(lambda t, p: rope(t, position_ids=p), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, pos), rope(x, position_ids=pos))


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_copies_keep_the_map(make):
    rope = make(12, 64, pair_axes=MAP)
    q, pos = randn((1, 2, 3, 12), seed=14), _ids(1, 3, 15)
    want = rope(q, position_ids=pos)
    for other in (copy.deepcopy(rope), pickle.loads(pickle.dumps(rope))):
        assert other.pair_axes == MAP and "pair_axes=[1, 2, 1, 2, 0, 0]" in repr(other)
        if make is rotary.RotaryEmbedding:  # the C++ state machine, which its pickle rebuilds, holds the map too
            assert other._tables.pair_axes == MAP
        assert torch.equal(other(q, position_ids=pos), want)
    assert "pair_axes=[1, 2, 1, 2, 0, 0]" in repr(rope)


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_bad_maps_are_refused_by_name(make):
    cases = [
        (dict(pair_axes=[0, 1]), ValueError, r"pair_axes must have one entry per pair, dim / 2 = 6, got 2"),
        (dict(pair_axes=[0, 1, 2, 0, -1, 0]), ValueError, r"pair_axes\[4\] must be an axis index in \[0, 16\), got -1"),
        (dict(pair_axes=[0, 1, 2, 0, 16, 0]), ValueError, r"pair_axes\[4\] must be an axis index in \[0, 16\), got 16"),
        (dict(pair_axes=MAP, mrope_section=[2, 2, 2]), ValueError, r"are three N-D rules; pass one of them"),
        (dict(pair_axes=MAP, axes_dim=[4, 4, 4]), ValueError, r"are three N-D rules; pass one of them"),
        (dict(pair_axes="012"), TypeError, r"pair_axes must be a list of ints or None, got '012'"),
        (dict(pair_axes=[0, 1.0, 0, 0, 0, 0]), TypeError, r"pair_axes\[1\] must be an int, got 1.0"),
        # Empty would read as unset: a 1-D module where the caller asked for a map.
        (dict(pair_axes=[]), ValueError, r"pair_axes must not be empty \(None: not set\), got \[\]"),
        (dict(mrope_section=()), ValueError, r"mrope_section must not be empty"),
        (dict(axes_dim=[]), ValueError, r"axes_dim must not be empty"),
        (dict(axes_dim=[6, 6], axes_theta=[]), ValueError, r"axes_theta must not be empty"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            make(12, 64, **kw)
    with pytest.raises(ValueError, match=r"turn at most 512 pairs, got dim / 2 = 513"):
        make(1026, 8, pair_axes=[0] * 513)
    # A call: the ids must have the axes the map reads (n_axes = max + 1).
    rope = make(12, 64, pair_axes=MAP)
    with pytest.raises(ValueError, match=r"pair_axes \(a module's mrope_section, axes_dim or pair_axes\) uses axes "
                                         r"0..2; the axis counts must match \(n_axes = 3\)"):
        rope(randn((1, 2, 3, 12), seed=16), position_ids=_ids(1, 3, 17)[:2])


@pytest.mark.parametrize("make", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_a_module_rebuilt_from_its_own_options_is_the_same(make):
    # Unset N-D options read back as None (an empty list is refused), in both modules.
    one_d = make(12, 64)
    assert one_d.mrope_section is None and one_d.axes_dim is None and one_d.pair_axes is None
    again = make(12, 64, mrope_section=one_d.mrope_section, axes_dim=one_d.axes_dim, pair_axes=one_d.pair_axes)
    q = randn((1, 2, 3, 12), seed=18)
    assert torch.equal(again(q, 5), one_d(q, 5))
    explicit = make(12, 64, pair_axes=MAP)
    assert make(12, 64, pair_axes=explicit.pair_axes).pair_axes == MAP


def test_states_pickled_before_the_option_still_load():
    # RopeTables' state had 13 entries and CppRotaryEmbedding's 16 before the map joined them.
    t = rotary._C.RopeTables(16, 32, mrope_section=[2, 3, 3])
    old = rotary._C.RopeTables.__new__(rotary._C.RopeTables)
    old.__setstate__(t.__getstate__()[:13])
    assert old.pair_axes == [0, 0, 1, 1, 1, 2, 2, 2]
    load, (state,) = rotary.CppRotaryEmbedding(12, 64, pair_axes=MAP).__reduce__()
    assert len(state) == 17 and load(state).pair_axes == MAP
    assert load(state[:16]).pair_axes is None and load(state[:15]).pair_axes is None
