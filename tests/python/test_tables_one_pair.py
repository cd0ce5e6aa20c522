"""A host-driven module's tables are one pair (freqs, inv_freq) of one state.
The state machine knew them by freqs alone and told a pair it never met by
its inv_freq alone: functional_call given one table of another state
rotated the rows of the table by one state and the positions past it (or
the rows themselves) by the other, silently, and so did a write of one
table in place. A pair it never met must now be one state's, or the call is
refused by name with nothing changed; a table written alone in place is
rebuilt to the module's own state."""

import pytest
import torch

import rotary
from test_state import LONGROPE, MODULES, gen
from test_tables_written_in_place import (DIM, DYNAMIC, LONGROPE_SCALE, dynamic_inv, longrope_inv,
                                          rule_reference)

SHORT, LONG = longrope_inv(LONGROPE["short_factor"]), longrope_inv(LONGROPE["long_factor"])


def donor_and_module(kind, piece):
    """A module in the rule's initial state, a donor of `piece` in another,
    the positions where that piece turns the call, and the float64 references
    by the module's own state and by the donor's."""
    if piece == "inv_freq":  # read past the 16-row table: positions 20..27 (reach 28: no growth)
        donor, m = MODULES[kind](DIM, 16, scaling=DYNAMIC), MODULES[kind](DIM, 16, scaling=DYNAMIC)
        donor(torch.randn(1, 1, 100, DIM, generator=gen(1)))  # grown to 100
        pos, own, other, scale = range(20, 28), dynamic_inv(0), dynamic_inv(100), 1.0
    else:  # the rows themselves: positions 0..7 inside a 256-row table
        donor, m = MODULES[kind](DIM, 256, scaling=LONGROPE), MODULES[kind](DIM, 256, scaling=LONGROPE)
        donor(torch.randn(1, 1, 100, DIM, generator=gen(1)))  # the long factors
        pos, own, other, scale = range(8), SHORT, LONG, LONGROPE_SCALE
    x = torch.randn(1, 2, len(pos), DIM, generator=gen(2))
    want, wrong = rule_reference(x, pos, own, scale), rule_reference(x, pos, other, scale)
    assert not torch.allclose(want, wrong, atol=1e-2)  # the checks below can fail
    return donor, m, x, pos[0], want


@pytest.mark.parametrize("piece", ["inv_freq", "freqs"])
def test_functional_call_with_one_table_of_another_state_is_refused(piece):
    donor, m, x, start, want = donor_and_module("py", piece)
    before = m.freqs.clone(), m.inv_freq.clone()
    message = (r"RotaryEmbedding\(dim=8, .*\): the tables it holds are not one pair: 'inv_freq' is that of "
               r"(the state at seq_len 100|the rule's initial state), but 'freqs' (row \d+, pair \d+ differs from "
               r"that state's by|is complex64 \[16, 4\] where that state's is complex64 \[1, 4\]).*pass 'freqs' "
               r"and 'inv_freq' of one state")
    for _ in range(2):  # the refused pair is not noted as served
        with pytest.raises(ValueError, match=message):
            torch.func.functional_call(m, {piece: getattr(donor, piece).clone()}, (x, start))
    assert torch.equal(m.freqs, before[0]) and torch.equal(m.inv_freq, before[1]) and m.rope_state == 0
    torch.testing.assert_close(m(x, start).double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("piece", ["inv_freq", "freqs"])
def test_functional_call_with_one_table_of_the_same_state_is_served(piece):
    _, m, x, start, want = donor_and_module("py", piece)
    got = torch.func.functional_call(m, {piece: getattr(m, piece).clone()}, (x, start))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    assert m.rope_state == 0


@pytest.mark.parametrize("called", [True, False], ids=["after-a-call", "before-any-call"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_a_longrope_freqs_written_alone_is_rebuilt_to_the_modules_state(kind, called):
    """The long factors' freqs copied over a short-state module's, its
    inv_freq left: the rows turned by the long factors, silently. Before any
    call the tables are those the module built, noted as its own: the write
    shows as one (else the pair, never met, would be refused)."""
    donor, m, x, start, want = donor_and_module(kind, "freqs")
    if called:
        m(x, start)
    with torch.no_grad():
        m.freqs.copy_(donor.freqs)
    torch.testing.assert_close(m(x, start).double(), want, rtol=0, atol=2e-6)
    assert m.rope_state == 0
    torch.testing.assert_close(m.freqs, rotary.CppRotaryEmbedding(DIM, 256, scaling=LONGROPE).freqs, rtol=0, atol=0)
