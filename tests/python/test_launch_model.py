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
        assert max(m["now"]) <= 1.05, m
        assert min(m["two"]) >= min(m["now"]), m  # two round trips per row never model faster
