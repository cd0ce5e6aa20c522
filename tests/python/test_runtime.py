"""Error messages that format numbers come back whole from the extension.

A librotary carrying its own static C++ runtime cut them short right before
the first number (or crashed). cmake/CxxRuntime.cmake prevents such builds;
this is the user-visible symptom, checked on the build under test.
"""
import re

import pytest
import torch

import rotary


def test_message_with_numbers_is_whole():
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(IndexError) as err:
        rotary.apply_rope(x, rotary.freqs_table(8, 16), 14)
    assert re.search(r"start_pos \+ seq_len = 14 \+ 3 = 17\b", str(err.value)), str(err.value)
    assert "16" in str(err.value)


@pytest.mark.parametrize("start_pos", [2**40, 2**59])
def test_large_numbers_format(start_pos):
    x = torch.randn(1, 1, 2, 8)
    with pytest.raises(IndexError) as err:
        rotary.apply_rope(x, rotary.freqs_table(8, 4), start_pos)
    assert str(start_pos) in str(err.value)


def test_error_from_cuda_build_path_is_whole():
    # The same formatting from another entry point (the module), so a second
    # library that formats messages (rotary._C) is covered too.
    rope = rotary.CppRotaryEmbedding(dim=8, max_seq_len=4)
    with pytest.raises(Exception) as err:
        rope.forward(torch.randn(1, 1, 2, 6))
    assert re.search(r"\d", str(err.value)), str(err.value)
