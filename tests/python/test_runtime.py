"""Error messages that format numbers come back whole from the extension.

A librotary carrying its own static C++ runtime cut them short right before
the first number (or crashed). cmake/CxxRuntime.cmake prevents such builds;
this is the user-visible symptom, checked on the build under test.
"""
import re

import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, make_heads, op_positions, PAIRING_IDS, PAIRINGS
from rotary_testing.devices import needs_cuda
from rotary_testing.reference import rope_reference


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


@needs_cuda
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_replay_with_device_positions(interleaved, dtype):
    """Capture once with a 0-dim int64 device tensor `positions`; change it
    (and the input) in place between replays. Capture fails if the op syncs
    with the host (e.g. reads positions with .item())."""
    D, L = 64, 256
    f = rotary.freqs_table(D, L).cuda()
    x = make_heads(2, 4, 8, D, dtype, "transposed", seed=270, device="cuda")
    k = make_heads(2, 2, 8, D, dtype, seed=271, device="cuda")
    pos = torch.zeros((), dtype=torch.int64, device="cuda")
    rope = rotary.RotaryEmbedding(D, L, interleaved=interleaved).cuda()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up outside the capture
            rotary.apply_rope(x, f, interleaved=interleaved, **op_positions(3, pos))
            rotary.apply_rope_qk(x, k, f, interleaved=interleaved, **op_positions(3, pos))
            rope(x, offsets=pos)
    torch.cuda.current_stream().wait_stream(s)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = rotary.apply_rope(x, f, interleaved=interleaved, **op_positions(3, pos))
        oq, ok = rotary.apply_rope_qk(x, k, f, interleaved=interleaved, **op_positions(3, pos))
        om = rope(x, offsets=pos)

    for i, p in enumerate([0, 5, 17, 240, 1]):
        pos.fill_(p)
        x.copy_(make_heads(2, 4, 8, D, dtype, "transposed", seed=272 + i, device="cuda"))
        for o in (out, oq, ok, om):
            o.fill_(float("nan"))  # poison: replay must overwrite every element
        g.replay()
        torch.cuda.synchronize()
        ref = rope_reference(x, 3 + p, interleaved)
        assert_close_ref(out, ref, dtype, msg=f"replay with positions={p}")
        assert_close_ref(oq, ref, dtype)
        assert_close_ref(ok, rope_reference(k, 3 + p, interleaved), dtype)
        assert_close_ref(om, rope_reference(x, p, interleaved), dtype)


@needs_cuda
def test_compile_reduce_overhead_cudagraphs():
    torch._dynamo.reset()
    f = rotary.freqs_table(64, 128).cuda()

    def fn(x, pos):
        return rotary.apply_rope(x, f, interleaved=True, **op_positions(0, pos)) * 2

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    x = make_heads(2, 4, 8, 64, seed=280, device="cuda")
    for p in [0, 7, 7, 50, 3]:
        pos = torch.tensor(p, device="cuda")
        out = compiled(x, pos).clone()
        assert_close_ref(out / 2, rope_reference(x, p, True), torch.float32)
    torch._dynamo.reset()


@needs_cuda
def test_side_stream():
    f = rotary.freqs_table(64, 64).cuda()
    x = make_heads(2, 4, 8, 64, seed=281, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = rotary.apply_rope(x, f, 9, False)
    torch.cuda.current_stream().wait_stream(s)
    assert_close_ref(out, rope_reference(x, 9, False), torch.float32)
