"""Where the frequency rules stop serving, they refuse by name: an ntk or
dynamic base past a double's range and update_for_reach past the positions a
call may hold (a checkpoint's recomputation: test_checkpoint_replay.py)."""

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.scaling_reference import ref_frequencies

MODULES = [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding]
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}


@pytest.mark.parametrize("theta,factor", [(1.5e308, 2.0), (1e4, 1e300)])
def test_an_ntk_base_past_a_double_is_refused(theta, factor):
    # It used to give inv_freq = 1, 0, 0, ... (inf^0, inf^-x): finite, so no check caught it.
    with pytest.raises(ValueError, match=r"RopeScaling\(type='ntk'\): theta = .* grow the base to theta \* .*= inf "
                                         r"\(rotary_dim d = 128\); it must be finite and > 0"):
        rotary.freqs_table(128, 4, theta, {"rope_type": "ntk", "factor": factor})
    # Just inside the range it is served, and matches the plain-math rule.
    inv, _ = rotary.inv_frequencies(128, 1e300, {"rope_type": "ntk", "factor": 2.0})
    want, _ = ref_frequencies(128, 1e300, {"rope_type": "ntk", "factor": 2.0})
    np.testing.assert_allclose(inv.numpy(), np.array(want), rtol=1e-12)
    assert (inv > 0).all()


@pytest.mark.parametrize("cls", MODULES)
def test_positions_on_the_meta_device_are_named_before_their_largest_is_read(cls):
    """A host-driven rule reads the call's largest position on the host:
    meta positions hold none (torch's words said Tensor.item())."""
    m = cls(8, 16, scaling={**DYNAMIC, "max_position_embeddings": 16})
    q = torch.randn(1, 1, 2, 8)
    for kw in (dict(position_ids=torch.tensor([[1, 50]], device="meta")),
               dict(offsets=torch.tensor([3], device="meta"))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"RotaryEmbedding: a host-driven rule \(dynamic, longrope\) sizes its "
                                             rf"table by the call's largest position, read on the host; {name} on "
                                             r"the meta device hold no values"):
            m(q, **kw)
        assert m.rope_state == 0


@pytest.mark.parametrize("cls", MODULES)
def test_a_dynamic_base_grown_past_a_double_refuses_the_call(cls):
    torch.manual_seed(0)
    m = cls(128, 16, theta=1.5e308, scaling={**DYNAMIC, "max_position_embeddings": 4096})
    q = torch.randn(1, 1, 2, 128)
    out = m(q, start_pos=10)  # the original base: served
    assert torch.isfinite(out).all() and m.rope_state == 0
    before = {n: b.clone() for n, b in m.named_buffers()}
    with pytest.raises(ValueError, match=r"type='dynamic'\): theta = 1.5e\+308 and factor = 2 at seq_len 8192 grow "
                                         r"the base"):
        m(q, start_pos=8190)
    assert m.rope_state == 0
    for n, b in m.named_buffers():
        assert torch.equal(b, before[n]), n
    # Its state is still read back from its buffers (lengths past the range count as past the saved one).
    again = cls(128, 16, theta=1.5e308, scaling={**DYNAMIC, "max_position_embeddings": 4096})
    again.load_state_dict(m.state_dict())
    assert again.rope_state == 0


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_update_for_reach_is_checked_by_name(cls):
    m = cls(8, 64, scaling=DYNAMIC)
    for bad in (2**62, -3):
        with pytest.raises(ValueError, match=r"update_for_reach: reach \(one past the largest position of a call\) "
                                             rf"must be in \[0, 2\^60\], got {bad}"):
            m.update_for_reach(bad)
    for bad in (1.5, True, None):
        with pytest.raises(TypeError, match=rf"{cls.__name__}.update_for_reach: reach must be an int, got"):
            m.update_for_reach(bad)
    with pytest.raises(ValueError, match=r"reach must fit in int64"):
        m.update_for_reach(2**64)
    assert m.rope_state == 0
    m.update_for_reach(torch.tensor(12))  # torch.max(position_ids) + 1, numpy's ints: as pybind's int64 took them
    m.update_for_reach(np.int64(12))
    state = m.rope_state
    m.update_for_reach(0)  # an empty call reaches nothing: nothing changes
    assert m.rope_state == state
    m.update_for_reach(2**60)  # the largest reach a call may have
    assert m.rope_state == 2**60
    # The tables round-trip; past 2^53 the lengths within one double's spacing share them.
    again = cls(8, 64, scaling=DYNAMIC)
    again.load_state_dict(m.state_dict())
    assert abs(again.rope_state - 2**60) <= 256
    for (name, a), (_, b) in zip(again.named_buffers(), m.named_buffers()):
        assert torch.equal(a, b), name
