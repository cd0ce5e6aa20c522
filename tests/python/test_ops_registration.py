"""How apply_rope / apply_rope_qk are registered with torch: the schema
(keyword-only arguments), the Python wrappers against the raw ops, the Meta
and fake kernels' shapes and strides against the eager ones, and
torch.library.opcheck on the CPU and every device. (Split from the old
test_ops.py and test_autograd_compile.py by concern.)"""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import op_positions, make_heads, make_packed_qkv, randn
from test_ops_compile import _reset_dynamo  # noqa: F401  (autouse: dynamo reset around every test)


# ---------------------------------------------------------------------------
# Schema / wrappers
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["apply_rope", "apply_rope_qk"])
def test_schema_keyword_only(name):
    schema = getattr(torch.ops.rotary, name).default._schema
    args = {a.name: a for a in schema.arguments}
    assert args["offsets"].kwarg_only and args["position_ids"].kwarg_only and args["inverse"].kwarg_only
    assert "positions" not in args
    assert not args["start_pos"].kwarg_only and not args["interleaved"].kwarg_only
    assert not schema.is_mutable


def test_wrappers_equal_raw_ops(tables):
    freqs = tables(16, 32)
    q = make_heads(2, 3, 5, 16, seed=40)
    k = make_heads(2, 1, 5, 16, seed=41)
    pos = torch.tensor([1, 2])
    assert torch.equal(
        rotary.apply_rope(q, freqs, interleaved=False, inverse=True, **op_positions(3, pos)),
        torch.ops.rotary.apply_rope(q, freqs, interleaved=False, inverse=True, **op_positions(3, pos)),
    )
    a = rotary.apply_rope_qk(q, k, freqs, interleaved=False, **op_positions(3, pos))
    b = torch.ops.rotary.apply_rope_qk(q, k, freqs, interleaved=False, **op_positions(3, pos))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Defaults: start_pos 0, interleaved.
    assert torch.equal(torch.ops.rotary.apply_rope(q, freqs), rotary.apply_rope(q, freqs, 0, True))


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (1, 0, 4, 8), (1, 2, 0, 8), (1, 1, 1, 8), (1, 2, 1, 8), (2, 3, 5, 8)])
def test_meta_outputs_have_the_kernels_strides(shape):
    """Meta allocates the outputs as the kernels do (the input's strides where
    it is dense, size-1 and empty dims included; torch's empty_like re-derives
    those on Meta), so a traced graph's strides are the eager ones."""
    f = rotary.freqs_table(8, 16)
    b, h, s, d = shape
    inputs = {"contiguous": torch.randn(shape), "transposed": torch.randn(b, s, h, d).transpose(1, 2),
              "strided": torch.randn(b, h, s, 2 * d)[..., ::2]}
    calls = {
        "apply_rope": lambda x, f: [rotary.apply_rope(x, f)],
        "apply_rope_qk": lambda x, f: list(rotary.apply_rope_qk(x, x.clone(), f)),
        "apply_qk_norm_rope": lambda x, f: list(rotary.apply_qk_norm_rope(x, x.clone(), f)),
        "apply_qk_norm_rope fp8 q": lambda x, f: list(rotary.apply_qk_norm_rope(
            x, x.clone(), f, q_fp8_scale=torch.tensor(0.1, device=x.device))),
    }
    for layout, x in inputs.items():
        for name, call in calls.items():
            eager, meta = call(x, f), call(x.to("meta"), f.to("meta"))
            for e, m in zip(eager, meta):
                assert (m.shape, m.stride(), m.dtype) == (e.shape, e.stride(), e.dtype), (layout, name)


# ---------------------------------------------------------------------------
# torch.library.opcheck
# ---------------------------------------------------------------------------
def _opcheck_samples():
    f8 = rotary.freqs_table(8, 32)
    s = []
    s.append(("fp32", (make_heads(2, 3, 5, 8, seed=90).requires_grad_(), f8, 2, True), {}))
    s.append(("bf16-half", (make_heads(2, 3, 5, 8, torch.bfloat16, seed=91), f8, 0, False), {}))
    s.append((
        "fp32-positions-batch-inverse-transposed",
        (make_heads(2, 3, 5, 8, layout="transposed", seed=92).requires_grad_(), f8, 1, False),
        {"offsets": torch.tensor([3, 7]), "inverse": True},
    ))
    s.append((
        "bf16-ids-stride2",
        (make_heads(2, 2, 4, 8, torch.bfloat16, "stride2", seed=93).requires_grad_(), f8, 0, True),
        {"position_ids": torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(1))},
    ))
    s.append(("fp32-scalar-pos", (make_heads(1, 2, 3, 8, seed=94), f8), {"offsets": torch.tensor(5)}))
    s.append(("fp32-int32-ids-seq", (make_heads(2, 2, 3, 8, seed=102), f8),
              {"position_ids": torch.tensor([9, 0, 4], dtype=torch.int32)}))
    return s


def _opcheck_qk_samples():
    f8 = rotary.freqs_table(8, 32)
    s = []
    s.append((
        "fp32-gqa",
        (make_heads(2, 4, 5, 8, seed=95).requires_grad_(), make_heads(2, 2, 5, 8, seed=96).requires_grad_(), f8, 3, True),
        {},
    ))
    s.append((
        "bf16-half-inverse",
        (make_heads(2, 2, 5, 8, torch.bfloat16, seed=97), make_heads(2, 1, 5, 8, torch.bfloat16, seed=98), f8, 0, False),
        {"inverse": True},
    ))
    _, q, k, _ = make_packed_qkv(2, 6, 2, 8, seed=99)
    s.append((
        "fp32-packed-qkv-ids",
        (q.detach().requires_grad_(), k.detach().requires_grad_(), f8, 0, False),
        {"position_ids": torch.randint(0, 25, (2, 6), generator=torch.Generator().manual_seed(2))},
    ))
    s.append((
        "bf16-batch-positions",
        (make_heads(2, 3, 4, 8, torch.bfloat16, "transposed", seed=100).requires_grad_(),
         make_heads(2, 3, 4, 8, torch.bfloat16, seed=101).requires_grad_(), f8, 1, True),
        {"offsets": torch.tensor([0, 9])},
    ))
    return s


_ROPE_SAMPLES = _opcheck_samples()
_QK_SAMPLES = _opcheck_qk_samples()


@pytest.mark.parametrize("args,kwargs", [s[1:] for s in _ROPE_SAMPLES], ids=[s[0] for s in _ROPE_SAMPLES])
def test_opcheck_apply_rope(args, kwargs):
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, args, kwargs)


@pytest.mark.parametrize("args,kwargs", [s[1:] for s in _QK_SAMPLES], ids=[s[0] for s in _QK_SAMPLES])
def test_opcheck_apply_rope_qk(args, kwargs):
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk.default, args, kwargs)


def test_fake_tensor_shapes_and_strides():
    """The Meta kernel agrees with the CPU kernel on shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    f = rotary.freqs_table(8, 32)
    x = make_heads(2, 3, 5, 8, torch.bfloat16, "transposed", seed=102)
    k = make_heads(2, 1, 5, 8, torch.bfloat16, "stride2", seed=103)
    real = rotary.apply_rope_qk(x, k, f, 3)
    with FakeTensorMode() as mode:
        fx, fk, ff = mode.from_tensor(x), mode.from_tensor(k), mode.from_tensor(f)
        fake = rotary.apply_rope_qk(fx, fk, ff, 3)
        with pytest.raises(ValueError, match="head_dim"):
            rotary.apply_rope(mode.from_tensor(randn((1, 1, 2, 7))), ff)
    for r, fa in zip(real, fake):
        assert fa.shape == r.shape and fa.dtype == r.dtype and fa.stride() == r.stride()


def _device_opcheck_samples(device):
    f = rotary.freqs_table(64, 64).to(device)
    return [
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, seed=250, device=device).requires_grad_(), f, 2, True), {}),
        (torch.ops.rotary.apply_rope.default,
         (make_heads(2, 3, 5, 64, torch.bfloat16, "transposed", seed=251, device=device), f, 0, False),
         {"offsets": torch.tensor([1, 30], device=device), "inverse": True}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 4, 5, 64, seed=252, device=device).requires_grad_(),
          make_heads(2, 2, 5, 64, seed=253, device=device, layout="stride2").requires_grad_(), f, 0, False),
         {"position_ids": torch.randint(3, 53, (2, 5), generator=torch.Generator().manual_seed(3)).to(device)}),
        (torch.ops.rotary.apply_rope_qk.default,
         (make_heads(2, 2, 5, 64, torch.bfloat16, seed=254, device=device),
          make_heads(2, 2, 5, 64, torch.bfloat16, seed=255, device=device), f, 1, True), {}),
    ]


@pytest.mark.parametrize("i", range(4))
def test_opcheck(device, i):
    op, args, kwargs = _device_opcheck_samples(device)[i]
    torch.library.opcheck(op, args, kwargs)
