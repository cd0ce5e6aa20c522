"""Out-of-place calls whose outputs are large enough for the CPU kernel's
streaming stores (a whole line per head at a time): on fresh pages, mapped
in parallel with MADV_POPULATE_WRITE first, and on mapped pages from the
stream line on (half the last-level cache: 8-16 MiB), heads-major and
token-major (the HF layout): the float64 reference on every element, at 1
and 2 threads."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import assert_close_ref, make_heads, ref_rope4


@pytest.mark.parametrize("hf_layout", [False, True], ids=["bhsd", "hf"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_large_out_of_place_matches_reference(threads, dtype, interleaved, hf_layout):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 16 MiB in fp32, 8 MiB in 16 bits (q + k over the 16 MiB line);
        # "transposed": [B, S, H, D] memory seen as BHSD (walked token by token)
        layout = "transposed" if hf_layout else "contiguous"
        q = make_heads(1, 16, 2048, 128, dtype, layout, seed=1)
        k = make_heads(1, 8 if dtype == torch.float32 else 16, 2048, 128, dtype, layout, seed=2)
        f = rotary.freqs_table(128, 4096)
        out_q, out_k = rotary.apply_rope_qk(q, k, f, 3, interleaved)
        assert out_q.stride() == q.stride()  # the output keeps the walk's layout
        assert_close_ref(out_q, ref_rope4(q, start=3, interleaved=interleaved), dtype)
        assert_close_ref(out_k, ref_rope4(k, start=3, interleaved=interleaved), dtype)
    finally:
        torch.set_num_threads(old)


# AVX2's build as well where the best is AVX-512's (on an AVX2 host it is the best).
@pytest.mark.parametrize("capability", [None] + (["avx2"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else []),
                         ids=lambda c: c or "best")
def test_streaming_stores_into_mapped_pages_match_reference(capability):
    """ROTARY_CPU_STREAM_BYTES=1 sends every aligned output over 16 MiB
    through the streaming path whatever the machine's cache, in both walks,
    with the best build and with AVX2's (ATEN_CPU_CAPABILITY), whose lines
    take several stores."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, rotary\n"
        "from rotary_testing.rope_testing import assert_close_ref, make_heads, ref_rope4\n"
        "torch.set_num_threads(2)\n"
        "f = rotary.freqs_table(128, 4096)\n"
        "for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
        "    for inter in (True, False):\n"
        "        for hf in (False, True):  # heads-major, then [B, S, H, D] memory walked token by token\n"
        "            layout = 'transposed' if hf else 'contiguous'\n"
        "            q = make_heads(1, 32, 2048, 128, dtype, layout, seed=1)\n"
        "            k = make_heads(1, 8, 2048, 128, dtype, layout, seed=2)\n"
        "            for _ in range(2):  # the second call reuses mapped pages\n"
        "                oq, ok = rotary.apply_rope_qk(q, k, f, 5, inter)\n"
        "            assert oq.stride() == q.stride()\n"
        "            assert_close_ref(oq, ref_rope4(q, start=5, interleaved=inter), dtype)\n"
        "            assert_close_ref(ok, ref_rope4(k, start=5, interleaved=inter), dtype)\n"
        "print('ok')\n"
    )
    # The child imports what this run imports: rotary and tests/rotary_testing.
    env = dict(os.environ, ROTARY_CPU_STREAM_BYTES="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
