"""A checkpoint's recomputation of a dynamic rule whose table depends on
the calls made since its forward pass: served where the state it would use
is the one its forward used, refused by name where history changed it."""

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import rotary
from rotary_testing.reference import rotate_pairs_nd
from rotary_testing.scaling_reference import ref_frequencies

MODULES = [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding]
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}

def _grad_reference(c, seq, interleaved, state=0):
    """d sum(rope(x) * c) / dx: c turned back by the rule's angles in `state`."""
    inv, _ = ref_frequencies(8, 10000.0, DYNAMIC, state)
    angle = np.arange(seq, dtype=np.float64)[:, None] * np.array(inv)[None, :]
    return torch.from_numpy(rotate_pairs_nd(c.numpy(), -angle, interleaved))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("cls", MODULES)
def test_checkpoint_recomputes_a_dynamic_rule_only_where_history_cannot_change_it(cls, reentrant):
    torch.manual_seed(0)
    m = cls(8, 64, scaling=DYNAMIC)
    # Below max_position_embeddings every state gives the original table: served, even after growth.
    x = torch.randn(1, 2, 10, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    y = checkpoint(m, x, use_reentrant=reentrant)
    m(torch.randn(1, 2, 50, 8, dtype=torch.float64))  # grows the table to 50
    (y * c).sum().backward()
    torch.testing.assert_close(x.grad, _grad_reference(c, 10, interleaved=True), rtol=0, atol=2e-7)  # the complex64 table: ~3e-8 per entry

    # Past it, a recomputation whose state has not changed since its forward is served: a training
    # step (every checkpointed call of one reach, then backward), twice.
    m = cls(8, 64, scaling=DYNAMIC)
    for seq in (20, 30):
        x = torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True)
        c = torch.randn(1, 2, seq, 8, dtype=torch.float64)
        (checkpoint(m, x, use_reentrant=reentrant) * c).sum().backward()
        torch.testing.assert_close(x.grad, _grad_reference(c, seq, True, seq), rtol=0, atol=2e-7)

    # One whose state changed since, the table it would use is another: refused, not silently the
    # other state's gradient (the forward used length 40, the module is at 50 now).
    x = torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True)
    y = checkpoint(m, x, use_reentrant=reentrant)
    m(torch.randn(1, 2, 50, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"called during a backward pass \(torch.utils.checkpoint recomputing it\) "
                                         r"with positions up to 39, past max_position_embeddings = 16, .*would now "
                                         r"turn by the table of length 50, but calls of this reach turned by "
                                         r"length\(s\) 40.*update_for_reach\(40\) before it"):
        y.sum().backward()
    assert x.grad is None


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("cls", MODULES)
def test_a_backward_after_a_later_forward_still_sees_its_calls(cls, reentrant):
    """The notes started afresh at the first call after any recomputation,
    dropping those of checkpointed calls whose backward had not run (two
    backward passes with a forward between, a pipeline schedule): one was
    then recomputed by another state's table, a silently wrong gradient, and
    one whose state had not changed was refused. Calls inside a checkpoint
    keep their notes until recomputed: a reentrant one's forward runs in an
    autograd.Function, with grad and forward grad off."""
    torch.manual_seed(1)
    m = cls(8, 64, scaling=DYNAMIC)
    m(torch.randn(1, 1, 40, 8))  # grows the table to 40
    step = lambda t: m(t, start_pos=16)  # noqa: E731 - reach 20, turned by length 40
    xa, xb, xc = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    c = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    la, lb, lc = ((checkpoint(step, x, use_reentrant=reentrant) * c).sum() for x in (xa, xb, xc))
    lb.backward()  # served: recomputed at 40
    m(torch.randn(1, 1, 1, 8), start_pos=37)  # reach 38: the state stays 40
    la.backward()  # served: a's state has not changed
    want = _grad_reference(torch.cat([torch.zeros(1, 2, 16, 8, dtype=torch.float64), c], 2), 20, True, 40)[:, :, 16:]
    for x in (xa, xb):
        torch.testing.assert_close(x.grad, want, rtol=0, atol=2e-7)
    m(torch.randn(1, 1, 1, 8), start_pos=49)  # reach 50: the state grows to 50
    m(torch.randn(1, 1, 4, 8), start_pos=16)  # reach 20 now turns by length 50
    with pytest.raises(ValueError, match=r"would now turn by the table of length 50, but calls of this reach turned "
                                         r"by length\(s\) 40, 50"):
        lc.backward()  # c ran at 40: refused, not length 50's gradient
    assert xc.grad is None
    for _ in range(2):  # and a plain step after it is served
        x = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
        (checkpoint(lambda t: m(t, start_pos=30), x, use_reentrant=reentrant) * c).sum().backward()
        ref = _grad_reference(torch.cat([torch.zeros(1, 2, 30, 8, dtype=torch.float64), c], 2), 34, True, 50)
        torch.testing.assert_close(x.grad, ref[:, :, 30:], rtol=0, atol=2e-7)


@pytest.mark.parametrize("cls", MODULES)
def test_a_retained_graph_and_a_backward_that_never_runs(cls):
    """A graph kept by retain_graph recomputes again: its second backward
    after a later forward turned by the newer table. A checkpointed call
    whose backward never runs keeps its note for ReplayNotes::kKeepSteps (8)
    steps only: refused within them, served after."""
    torch.manual_seed(2)
    m = cls(8, 64, scaling=DYNAMIC)
    m(torch.randn(1, 1, 40, 8))  # state 40
    c = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    loss = (checkpoint(lambda t: m(t, start_pos=16), x, use_reentrant=False) * c).sum()
    loss.backward(retain_graph=True)  # served at 40
    m(torch.randn(1, 1, 1, 8), start_pos=49)  # state 50
    m(torch.randn(1, 1, 4, 8), start_pos=16)  # reach 20 at 50
    with pytest.raises(ValueError, match=r"would now turn by the table of length 50, but calls of this reach turned "
                                         r"by length\(s\) 40, 50"):
        loss.backward()

    def step(start):  # a checkpointed call and its backward: one step
        t = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
        (checkpoint(lambda u: m(u, start_pos=start), t, use_reentrant=False) * c).sum().backward()
        return t.grad

    m = cls(8, 64, scaling=DYNAMIC)
    m(torch.randn(1, 1, 40, 8))
    checkpoint(lambda t: m(t, start_pos=16), x, use_reentrant=False)  # reach 20 at 40, never backpropagated
    m(torch.randn(1, 1, 1, 8), start_pos=49)  # state 50
    step(30)
    with pytest.raises(ValueError, match=r"turned by length\(s\) 40, 50"):
        step(16)
    for _ in range(8):
        step(30)
    want = _grad_reference(torch.cat([torch.zeros(1, 2, 16, 8, dtype=torch.float64), c], 2), 20, True, 50)
    torch.testing.assert_close(step(16), want[:, :, 16:], rtol=0, atol=2e-7)


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
def test_the_state_machines_bookkeeping_stays_bounded(cls):
    """The states noted for one reach stop at a few (two already refuse a
    recomputation): a decode loop growing the table over and over made the
    list, each call's scan and the refusal's message grow without end. Loads
    with no call between them each left a dropped table's entry behind."""
    m = cls(8, 16, scaling=DYNAMIC)
    x = torch.randn(1, 1, 1, 8)
    for i in range(12):
        m(x, start_pos=1000 + i)  # grows the table
        # reach 20: by the grown table, another state each time; checkpointed, its backward never run
        checkpoint(lambda t: m(t, start_pos=19), x.clone().requires_grad_(), use_reentrant=False)
        m(x, start_pos=0)
    q = torch.randn(1, 1, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"calls of this reach turned by length\(s\) 1001, 1002, 1003, 1004, and "
                                         r"others\. Call the module"):
        checkpoint(lambda t: m(t, start_pos=19), q, use_reentrant=False).sum().backward()
    sd = m.state_dict()
    tables = m._tables if cls is rotary.RotaryEmbedding else m.cpp_module
    tracked = []
    for _ in range(200):
        m.load_state_dict(sd)
        tracked.append(tables._tracked_tables())
    # sd's table, the one held, and the one the last load dropped.
    assert max(tracked) == tracked[-1] <= 3


def test_the_documented_way_around_a_checkpoint():
    """update_for_reach before the checkpointed function, the tables passed in:
    the gradient of the forward that ran."""
    torch.manual_seed(0)
    m = rotary.RotaryEmbedding(8, 64, scaling=DYNAMIC, interleaved=False)
    x = torch.randn(1, 2, 20, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 20, 8, dtype=torch.float64)
    m.update_for_reach(20)
    freqs, inv = m.freqs, m.inv_freq
    y = checkpoint(lambda t, f, i: rotary.apply_rope(t, f, 0, False, inv_freq=i), x, freqs, inv, use_reentrant=False)
    m(torch.randn(1, 2, 50, 8, dtype=torch.float64))
    (y * c).sum().backward()
    inv20, _ = ref_frequencies(8, 10000.0, DYNAMIC, 20)
    angle = np.arange(20, dtype=np.float64)[:, None] * np.array(inv20)[None, :]
    torch.testing.assert_close(x.grad, torch.from_numpy(rotate_pairs_nd(c.numpy(), -angle, False)),
                               rtol=0, atol=2e-7)  # the complex64 table: ~3e-8 per entry


# Not (True, False): a non-reentrant checkpoint inside a reentrant one looks like a plain
# recomputation and is counted twice (docs/api.md says so).
@pytest.mark.parametrize("outer,inner", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("cls", MODULES)
def test_nested_checkpoints_count_each_call_once(cls, outer, inner):
    """An outer checkpoint's recomputation runs the inner one's forward, and
    the inner backward recomputes the call again: counted as two, one
    forward's note was spent by another's backward, and a backward after a
    later forward turned by the newer table (a reentrant inner one). Its
    forward, inside a Function, is now checked, not counted."""
    torch.manual_seed(2)
    m = cls(8, 64, scaling=DYNAMIC)
    m(torch.randn(1, 1, 40, 8))  # state 40
    nested = lambda t: checkpoint(lambda u: checkpoint(lambda w: m(w, start_pos=16), u,  # noqa: E731 - reach 20
                                                       use_reentrant=inner), t, use_reentrant=outer)
    c = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    want = _grad_reference(torch.cat([torch.zeros(1, 2, 16, 8, dtype=torch.float64), c], 2), 20, True, 40)[:, :, 16:]
    for grow in (False, True):
        xa, xb = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        la, lb = ((nested(x) * c).sum() for x in (xa, xb))
        lb.backward()
        torch.testing.assert_close(xb.grad, want, rtol=0, atol=2e-7)
        if not grow:
            m(torch.randn(1, 1, 1, 8), start_pos=30)  # reach 31: the state stays 40
            la.backward()  # served: a's state has not changed
            torch.testing.assert_close(xa.grad, want, rtol=0, atol=2e-7)
            continue
        m(torch.randn(1, 1, 1, 8), start_pos=60)  # the state grows to 61
        m(torch.randn(1, 2, 4, 8), start_pos=16)  # reach 20 now turns by length 61
        with pytest.raises(ValueError, match=r"would now turn by the table of length 61, but calls of this reach "
                                             r"turned by length\(s\) 40, 61"):
            la.backward()
        assert xa.grad is None


@pytest.mark.parametrize("cls", MODULES)
def test_a_plain_recomputation_beside_a_reentrant_checkpoint_or_under_hooks_is_counted(cls):
    """A plain recomputation ran inside torch's reentrant checkpoint Function
    (which unpacked a saved tensor of the outer checkpoint), or under
    save_on_cpu while that Function recomputed: taken for a nested one, it
    was not counted, and the third of three steps (lengths 20, 30, 20) was
    refused though its state had not changed."""
    from torch.autograd.graph import save_on_cpu
    lin = torch.nn.Linear(8, 8).double()
    steps = (lambda m, x: checkpoint(lambda t: checkpoint(lin, m(t), use_reentrant=True), x, use_reentrant=False),
             lambda m, x: checkpoint(lambda t: lin(m(t)), x, use_reentrant=True))
    for step in steps:
        m = cls(8, 64, scaling=DYNAMIC)
        for length, state in ((20, 20), (30, 30), (20, 30)):  # a dynamic table does not shrink past the threshold
            x = torch.randn(1, 2, length, 8, dtype=torch.float64, requires_grad=True)
            with save_on_cpu():
                loss = step(m, x).sum()
                loss.backward()
            c = torch.ones(1, 2, length, 8, dtype=torch.float64) @ lin.weight.detach()  # d sum(lin(y)) / dy
            torch.testing.assert_close(x.grad, _grad_reference(c, length, True, state), rtol=0, atol=2e-7)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("cls", MODULES)
def test_a_no_grad_rollout_leaves_a_later_checkpointed_step_alone(cls, reentrant):
    """A rollout under no_grad (never recomputed) noted its calls: a later
    checkpointed step of one of its reaches, at the state its forward and
    recomputation share, was refused as ambiguous; past 4096 noted reaches
    every new one was refused as unnoted. Calls a backward waits for speak
    for their reach; the notes of the others make room."""
    m = cls(8, 64, scaling=DYNAMIC)
    with torch.no_grad():
        for p in range(200):  # reaches 1..200, each by the table of its own length past 16
            m(torch.randn(1, 1, 1, 8, dtype=torch.float64), start_pos=p)
    assert m.rope_state == 200
    for seq in (150, 4400):
        if seq == 4400:
            with torch.no_grad():  # fills the notes with 4096 more reaches
                for p in range(200, 4300):
                    m(torch.randn(1, 1, 1, 8, dtype=torch.float64), start_pos=p)
        x = torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True)
        c = torch.randn(1, 2, seq, 8, dtype=torch.float64)
        (checkpoint(m, x, use_reentrant=reentrant) * c).sum().backward()
        assert m.rope_state == max(seq, 200 if seq == 150 else 4300)  # the state its forward used
        torch.testing.assert_close(x.grad, _grad_reference(c, seq, True, m.rope_state), rtol=0, atol=2e-7)


@pytest.mark.parametrize("cls", MODULES)
def test_grad_turned_back_on_inside_a_reentrant_checkpoint_still_counts(cls):
    """A function that turns grad back on inside a reentrant checkpoint
    looked like a plain call (its forward grad stays off): with a waiting
    checkpointed call of its reach at another state, the recomputation was
    served by that state's table, the forward's gradient silently lost."""
    m = cls(8, 64, scaling=DYNAMIC)

    def f(t):
        with torch.enable_grad():
            return m(t)

    with torch.no_grad():
        m(torch.randn(1, 2, 60, 8, dtype=torch.float64))
    checkpoint(m, torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True), use_reentrant=False)  # waits
    with torch.no_grad():
        m(torch.randn(1, 2, 10, 8, dtype=torch.float64))  # back under max_position_embeddings: the table resets
    x = torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True)
    y = checkpoint(f, x, use_reentrant=True)  # by the table of length 40
    with torch.no_grad():
        m(torch.randn(1, 2, 60, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"would now turn by the table of length 60, but calls of this reach turned "
                                         r"by length\(s\) 60, 40"):
        y.sum().backward()


@pytest.mark.parametrize("cls", MODULES)
def test_many_rollout_states_of_one_reach_leave_a_checkpointed_step_alone(cls):
    """Four generations noted four states for one reach: the checkpointed
    call's note then merged into "and others" and was refused."""
    m = cls(8, 64, scaling=DYNAMIC)
    top = 40
    with torch.no_grad():
        for _ in range(4):
            m(torch.randn(1, 1, 40, 8, dtype=torch.float64))  # reach 40 by the table of each generation's length
            for p in range(40, top + 10):
                m(torch.randn(1, 1, 1, 8, dtype=torch.float64), start_pos=p)
            top += 10
    x = torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    (checkpoint(m, x, use_reentrant=False) * c).sum().backward()
    assert m.rope_state == 80
    torch.testing.assert_close(x.grad, _grad_reference(c, 40, True, 80), rtol=0, atol=2e-7)



@pytest.mark.parametrize("cls", MODULES)
def test_an_inner_reentrant_checkpoint_that_turns_grad_on_is_counted_once(cls):
    """An outer reentrant checkpoint's recomputation runs the inner one's
    forward, whose function turned grad back on: taken for a plain
    recomputation, the call was counted done there, and the inner backward's
    own recomputation met only a rollout's note of another state: refused."""
    m = cls(8, 64, scaling=DYNAMIC)
    with torch.no_grad():
        m(torch.randn(1, 2, 60, 8, dtype=torch.float64))  # state 60
        m(torch.randn(1, 2, 40, 8, dtype=torch.float64))  # reach 40 by length 60: no backward waits for it
        m(torch.randn(1, 2, 10, 8, dtype=torch.float64))  # under max_position_embeddings: the table resets

    def f(t):
        with torch.enable_grad():
            return m(t)

    x = torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    y = checkpoint(lambda t: checkpoint(f, t, use_reentrant=True), x, use_reentrant=True)  # by length 40
    (y * c).sum().backward()
    torch.testing.assert_close(x.grad, _grad_reference(c, 40, True, 40), rtol=0, atol=2e-7)
    assert m.rope_state == 40
