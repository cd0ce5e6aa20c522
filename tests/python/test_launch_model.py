"""benchmarks/launch_model.py: the launch it models is the op's own
(rotary._C._cuda_launch_shape runs prepare_rope and make_grid), its fields
are consistent, and it predicts at most 1.05x clone for every CUDA case of
bench.py (the issue's bar without a device). No GPU needed."""

import importlib.util
import os
import sys

import pytest
import torch

import rotary

HERE = os.path.dirname(os.path.abspath(__file__))
BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("rotary::apply_rope", "CUDA")
pytestmark = pytest.mark.skipif(not BUILT_WITH_CUDA, reason="rotary was built without CUDA kernels")


def load_model():
    path = os.path.join(HERE, "..", "..", "benchmarks", "launch_model.py")
    spec = importlib.util.spec_from_file_location("launch_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["launch_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_launch_shape_fields():
    q = torch.empty(2, 6, 7, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 7, 64, dtype=torch.bfloat16)
    s = rotary._C._cuda_launch_shape(q, k, rotary.freqs_table(64, 16), True)
    assert s["vectorized"] == 1 and s["int32"] == 1 and s["heads"] == 8 and s["rows"] == 14
    assert s["block_threads"] == s["rows_per_block"] * s["lanes"] == s["rows_per_block"] * s["group_threads"] * s["chunks"]
    assert s["row_blocks"] == -(-s["rows"] // s["rows_per_block"])
    assert s["rotary_groups"] == 64 // 2 // 4  # 4 pairs of bf16 per 16-byte vector
    strided = rotary._C._cuda_launch_shape(q.transpose(2, 3).contiguous().transpose(2, 3), k, rotary.freqs_table(64, 16))
    assert strided["vectorized"] == 0
    with pytest.raises(ValueError, match="_cuda_launch_shape"):  # validated as the op validates
        rotary._C._cuda_launch_shape(q, k, rotary.freqs_table(128, 16), True)  # span > head_dim


def test_every_case_predicted_within_five_percent():
    rows = list(load_model().model_rows())
    assert len(rows) == 12
    for m in rows:
        assert m["prefetch"], m  # every case strides over its rows on a vector path
        assert max(m["now"]) <= 1.05, m
        assert min(m["without"]) >= min(m["now"]), m  # fewer bytes in flight never model faster


def test_the_fit_covers_the_measured_kernel():
    """Without prefetch, the model brackets what the H200 measured (to 0.02)."""
    rows = [m for m in load_model().model_rows() if m["measured"]]
    assert len(rows) == 10
    for m in rows:
        lo, hi = sorted(m["without"])
        assert lo - 0.02 <= m["measured"] <= hi + 0.02, m


def test_the_prefetch_switch():
    q, k = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16), torch.empty(1, 2, 4096, 128, dtype=torch.bfloat16)
    f = rotary.freqs_table(128, 4096)
    assert rotary._C._cuda_launch_shape(q, k, f)["l2_prefetch"] == 1
    assert rotary._C._cuda_set_l2_prefetch(False) is True
    try:
        assert rotary._C._cuda_launch_shape(q, k, f)["l2_prefetch"] == 0
    finally:
        assert rotary._C._cuda_set_l2_prefetch(True) is False
    # float64 interleaved does not prefetch (at the register cap), its half pairing does.
    q64, k64 = q.double(), k.double()
    assert rotary._C._cuda_launch_shape(q64, k64, f, True)["l2_prefetch"] == 0
    assert rotary._C._cuda_launch_shape(q64, k64, f, False)["l2_prefetch"] == 1


def test_kv_launch_fused_when_the_caches_are_vector_addressable():
    q = torch.empty(4, 8, 1, 64, dtype=torch.bfloat16)
    k = torch.empty(4, 2, 1, 64, dtype=torch.bfloat16)
    v = torch.empty(4, 2, 1, 64, dtype=torch.bfloat16)
    f = rotary.freqs_table(64, 32)
    for cdt in (torch.bfloat16, torch.float8_e4m3fn):
        kc, vc = torch.empty(4, 2, 32, 64, dtype=cdt), torch.empty(4, 2, 32, 64, dtype=cdt)
        s = rotary._C._cuda_kv_launch(q, k, v, kc, vc, f, 3)
        assert s["fused"] == 1 and s["launches"] == 1 and s["rows"] == 4, (cdt, s)
        # Rows one element apart cannot be vector-addressed: the two launches.
        wide = torch.empty(4, 2, 32, 65, dtype=cdt)[..., :64]
        s = rotary._C._cuda_kv_launch(q, k, v, wide, vc, f, 3)
        assert s["fused"] == 0 and s["launches"] == 2, (cdt, s)
    fp64 = [t.double() for t in (q, k, v)]
    s = rotary._C._cuda_kv_launch(*fp64, torch.empty(4, 2, 32, 64, dtype=torch.float8_e4m3fn),
                                  torch.empty(4, 2, 32, 64, dtype=torch.float8_e4m3fn), f, 3)
    assert s["fused"] == 0  # float64 with an fp8 cache keeps the two launches
    with pytest.raises(IndexError, match="_cuda_kv_launch"):  # validated as the op validates
        rotary._C._cuda_kv_launch(q, k, v, kc, vc, rotary.freqs_table(64, 64), 40)  # past the cache rows


def test_kv_launch_copy_blocks():
    """Decode (B=64, 32/8 heads, D=128, bf16, half pairing): 32 rope blocks of
    two rows; copy blocks of one row (16 v chunks x 8 heads of 160 lanes)
    when both fit in one wave, each thread one round trip; the rope rows'
    own copy would take two after the rotation."""
    q = torch.empty(64, 32, 1, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(64, 8, 1, 128, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.empty(256, 16, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    f = rotary.freqs_table(128, 64)
    slots = torch.arange(64).reshape(64, 1) * 64

    def launch(resident):
        return rotary._C._cuda_kv_launch(q, k, v, kc, vc, f, 7, slots, "NHD", resident, False)

    s = launch(264)
    assert (s["row_blocks"], s["block_threads"]) == (32, 160), s
    assert (s["copy_lanes"], s["copy_rows_per_block"], s["copy_row_blocks"], s["copy_blocks"]) == (128, 1, 64, 64), s
    assert (s["rope_trips"], s["row_copy_trips"], s["copy_block_trips"]) == (1, 2, 1), s
    assert launch(95)["copy_blocks"] == 0  # 32 + 64 blocks do not fit one wave: the rows copy
    assert "copy_blocks" not in launch(0)
    assert rotary._C._cuda_set_copy_blocks(False) is True
    try:
        assert launch(264)["copy_blocks"] == 0
    finally:
        assert rotary._C._cuda_set_copy_blocks(True) is False


def test_decode_fused_predicted_at_most_0_6_of_two_launches():
    rows = list(load_model().decode_rows())
    assert len(rows) == 8 and all(m["fused"] and m["launches"] == 1 for m in rows), rows
    for m in rows:
        assert max(m["ratio"]) <= 0.6, m
        assert m["copy_blocks"] > 0 and m["trips"] == 1, m  # v copied beside the rotation
        assert m["rows_trips"] == (3 if m["pairing"] == "half" else 2), m  # as the H200 ran it


def test_decode_fitted_to_the_h200():
    """With the trip fitted to the H200's 5.0 us (rows copying, half pairing,
    paged NHD), the model gives that launch 5.0 us and a bf16 launch with
    copy blocks no more than FlashInfer's measured 3.0 us."""
    model = load_model()
    for m in model.decode_rows():
        if m["pairing"] == "half" and m["kv_layout"] == "NHD":
            assert m["rows_fitted_us"] == pytest.approx([model.DECODE_MEASURED_US] * 2), m
        if m["cache"] == "bf16":
            assert max(m["fitted_us"]) <= model.DECODE_FLASHINFER_US + 1e-9, m


def test_norm_launch_is_the_ops_grid():
    q = torch.empty(3, 4, 5, 64, dtype=torch.bfloat16)
    k = torch.empty(3, 2, 5, 64, dtype=torch.bfloat16)
    f = rotary.freqs_table(64, 16)
    s = rotary._C._cuda_norm_launch(q, k, f, "head", 132)
    assert s == {"rows": 15, "blocks": 15, "block_threads": 128, "batch": 8, "vector_items": 4, "vector_rotated": 4,
                 "vector_lanes": 4, "vector_lane_heads": 2, "l2_prefetch": 0, "fp8_q": 0}, s  # bf16 D 64: 4 items
    # of 8 pairs, 4 lanes a head; a block per row: no next row to prefetch
    for scale in (torch.tensor(0.5), torch.linspace(0.1, 0.4, 4)):  # fp8 q, per tensor or per head: the vector path
        fp8 = rotary._C._cuda_norm_launch(q, k, f, "head", 132, q_fp8_scale=scale)
        assert fp8 == dict(s, fp8_q=1), fp8
    assert rotary._C._cuda_norm_launch(q.double(), k.double(), f, "head", 132,
                                       q_fp8_scale=torch.tensor(0.5))["vector_items"] == 0  # fp64: element path
    half = rotary._C._cuda_norm_launch(q, k, f, "head", 132, interleaved=False)
    assert (half["vector_items"], half["vector_lanes"]) == (4, 4), half  # a vector from each half per lane
    assert rotary._C._cuda_norm_launch(q, k, f, "heads", 132) == s  # across heads: the same vector path
    strided = torch.empty(3, 4, 64, 5, dtype=torch.bfloat16).transpose(-1, -2)
    assert rotary._C._cuda_norm_launch(strided, k, f, "head", 132)["vector_items"] == 0
    wide = torch.empty(1, 2, 5, 640, dtype=torch.bfloat16)  # 40 items: wider than a warp
    assert rotary._C._cuda_norm_launch(wide, wide, rotary.freqs_table(640, 16), "head", 132)["vector_items"] == 0
    assert rotary._C._cuda_norm_launch(q, k, f, "heads", 1)["blocks"] == 15  # at most 16 blocks per SM
    strides = rotary._C._cuda_norm_launch(torch.empty(2, 4, 9, 64, dtype=torch.bfloat16),
                                          torch.empty(2, 2, 9, 64, dtype=torch.bfloat16), f, "head", 1)
    assert strides["blocks"] == 16 and strides["l2_prefetch"] == 1  # blocks stride: the vector path prefetches
    across = rotary._C._cuda_norm_launch(torch.empty(2, 4, 9, 64, dtype=torch.bfloat16),
                                         torch.empty(2, 2, 9, 64, dtype=torch.bfloat16), f, "heads", 1)
    assert across["l2_prefetch"] == 1  # norm "heads" takes the vector path too
    element = rotary._C._cuda_norm_launch(torch.empty(2, 4, 9, 64, dtype=torch.double),
                                          torch.empty(2, 2, 9, 64, dtype=torch.double), f, "heads", 1)
    assert element["blocks"] == 16 and element["l2_prefetch"] == 0  # the element path (fp64) does not prefetch
    with pytest.raises(ValueError, match="norm"):  # validated as the op validates
        rotary._C._cuda_norm_launch(q, k, f, "tokens", 132)
    with pytest.raises(ValueError, match="sms must be at least 1, got 0"):
        rotary._C._cuda_norm_launch(q, k, f, "head", 0)


def test_the_prologue_vector_path_never_models_slower():
    rows = list(load_model().prologue_rows())
    # 2 shapes x 2 dtypes x (head: both pairings, heads), and decode with a cache and with fp8 q per dtype.
    assert len(rows) == 16
    for m in rows:
        assert m["vector"], m  # contiguous BHSD rows: either norm takes the vector path
        assert 1.0 <= m["now"][0] <= m["now"][1], m
        assert m["now_kb"] >= m["before_kb"] and m["now"][1] < m["before"][1], m


def test_counts_past_the_kernels_32_bit_range_are_refused_by_name():
    """A row's heads and a head's elements are counted in 32 bits on CUDA:
    past 2^30 the launch is refused by name (the op's check on CUDA tensors,
    tests/python/test_ops_devices.py), never a grid that drops heads or
    divides by zero."""
    def m(*shape):
        return torch.empty(*shape, device="meta", dtype=torch.float16)
    f = torch.empty(4, 1, dtype=torch.complex64, device="meta")
    heads = r"q heads \+ k heads = {} \+ {} is more than the CUDA kernels take in one call, 2\^30"
    for q, k, want in [
        (m(1, 2**30 + 1, 1, 2), m(1, 0, 1, 2), heads.format(2**30 + 1, 0)),
        (m(1, 2**29 + 1, 1, 2), m(1, 2**29, 1, 2), heads.format(2**29 + 1, 2**29)),
        (m(1, 2**31, 1, 2), m(1, 0, 1, 2), heads.format(2**31, 0)),  # a negative block size in 32 bits
        (m(1, 1, 1, 2**30 + 2), m(1, 1, 1, 2**30 + 2), r"head_dim = 1073741826 is more than the CUDA kernels take"),
        (m(1, 1, 1, 2**31 + 2), m(1, 0, 1, 2**31 + 2), r"head_dim = 2147483650"),  # a division by zero in 32 bits
    ]:
        for in_place in (False, True):
            with pytest.raises(ValueError, match="_cuda_launch_shape: " + want):
                rotary._C._cuda_launch_shape(q, k, f, interleaved=False, in_place=in_place)
        with pytest.raises(ValueError, match="_cuda_norm_launch: " + want):
            rotary._C._cuda_norm_launch(q, k, f, interleaved=False)
    assert rotary._C._cuda_launch_shape(m(1, 2**30, 1, 2), m(1, 0, 1, 2), f, in_place=True)["heads"] == 2**30
    # The prologue's L2 prefetch counts a row's 128-byte slots (two a 144-byte head here) in 32 bits: 2^30
    # heads would make 2^31, so it does not prefetch there.
    rows = torch.empty(4096, 32, dtype=torch.complex64, device="meta")
    for heads, prefetch in ((2**29 - 1, 1), (2**29, 0)):
        launch = rotary._C._cuda_norm_launch(m(1, heads, 4096, 72), m(1, heads, 4096, 72), rows, sms=1, interleaved=False)
        assert (launch["vector_items"], launch["l2_prefetch"]) == (5, prefetch), launch
    # The fused cache write: v's head_dim too.
    q, k, v = m(1, 1, 1, 2), m(1, 1, 1, 2), m(1, 1, 1, 2**30 + 2)
    kc, vc = m(1, 1, 4, 2), m(1, 1, 4, 2**30 + 2)
    with pytest.raises(ValueError, match=r"_cuda_kv_launch: v's head_dim = 1073741826 is more than the CUDA kernels"):
        rotary._C._cuda_kv_launch(q, k, v, kc, vc, f, interleaved=False)
