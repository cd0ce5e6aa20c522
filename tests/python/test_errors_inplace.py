"""Bad inputs added with "Exact, hard to misuse": in-place ops (inputs must be
bitwise unchanged), cu_seqlens, layout, inv_freq, angle_dtype, loading tables
the options would not build, a real second device, and sparse / mkldnn /
nested tensors. The right exception type, a message that names the argument,
and no input modified. Split from test_errors.py (which holds the table for
the out-of-place ops and modules, and the case helpers) to keep files short."""

import pytest
import torch

import rotary
from rotary_testing.rope_testing import op_positions, randn
from rotary_testing.devices import needs_cuda
from test_errors import CASES as OP_CASES
from test_errors import F, I, X, _qk, _rope, case, check_bad_input

CASES = [
    # ==== added with "Exact, hard to misuse": in-place ops, cu_seqlens,
    # layout, inv_freq, angle_dtype, loading mismatched tables, CUDA devices.
    # ---- apply_rope_ / apply_rope_qk_ (inputs must be bitwise unchanged)
    case("inplace-leaf-requires-grad", ValueError, r"apply_rope_: x requires grad; in-place rotation is not differentiable",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 8).requires_grad_(), F()])),
    case("inplace-view-of-leaf-requires-grad", ValueError, r"apply_rope_: x requires grad",
         lambda: (lambda x, f: rotary.apply_rope_(x[:, :1], f), [X(1, 2, 3, 8).requires_grad_(), F()])),
    case("qk-inplace-k-requires-grad", ValueError, r"apply_rope_qk_: k requires grad",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 2, 3, 8).requires_grad_(), F()])),
    case("qk-inplace-same-tensor", ValueError, r"apply_rope_qk_: q and k overlap in memory; in place, each element must belong to one of them",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t, t, f), [X(1, 2, 3, 8), F()])),
    case("qk-inplace-overlapping-head-slices", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t[:, :2], t[:, 1:], f), [X(1, 3, 3, 8), F()])),
    case("qk-inplace-overlapping-packed-qkv", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda t, f: rotary.apply_rope_qk_(t[:, :, :3].transpose(1, 2), t[:, :, 2:5].transpose(1, 2), f),
                  [X(2, 4, 6, 8), F()])),
    case("inplace-expanded", ValueError, r"apply_rope_: x has elements sharing memory \(an expanded view\?\); an in-place write needs distinct elements",
         lambda: (lambda t, f: rotary.apply_rope_(t.expand(2, 2, 3, 8), f), [X(1, 1, 3, 8), F()])),
    case("qk-inplace-expanded-k", ValueError, r"apply_rope_qk_: k has elements sharing memory",
         lambda: (lambda q, t, f: rotary.apply_rope_qk_(q, t.expand(1, 2, 3, 8), f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F()])),
    # any strides, decided exactly: a partial overlap at an odd offset, a view
    # that overlaps itself, and an input the rotation reads (the whole buffer
    # is the snapshot, so a refused call must leave every byte of it alone)
    case("qk-inplace-partial-overlap-last-dim", ValueError, r"apply_rope_qk_: q and k overlap in memory; in place, each element must belong to one of them",
         lambda: (lambda b, f: rotary.apply_rope_qk_(b[..., 0:8], b[..., 4:12], f), [X(1, 2, 4, 12), F()])),
    case("qk-inplace-strided-overlap", ValueError, r"apply_rope_qk_: q and k overlap in memory",
         lambda: (lambda b, f: rotary.apply_rope_qk_(b.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 0),
                                                      b.as_strided((1, 2, 3, 8), (96, 48, 16, 1), 4), f), [X(128), F()])),
    case("inplace-as-strided-self-overlap", ValueError, r"apply_rope_: x has elements sharing memory \(an expanded view\?\); an in-place write needs distinct elements",
         lambda: (lambda b, f: rotary.apply_rope_(b.as_strided((1, 1, 4, 8), (32, 32, 4, 1)), f), [X(64), F()])),
    case("qk-inplace-k-self-overlap", ValueError, r"apply_rope_qk_: k has elements sharing memory",
         lambda: (lambda q, b, f: rotary.apply_rope_qk_(q, b.as_strided((1, 2, 3, 8), (0, 8, 6, 1)), f), [X(1, 2, 3, 8), X(64), F()])),
    case("inplace-expanded-batch-as-strided", ValueError, r"apply_rope_: x has elements sharing memory",
         lambda: (lambda b, f: rotary.apply_rope_(b.as_strided((2, 1, 3, 8), (0, 24, 8, 1)), f), [X(24), F()])),
    case("inplace-x-aliases-freqs", ValueError, r"apply_rope_: x and freqs overlap in memory; in place, the rotation would overwrite an input it reads",
         lambda: (lambda f: rotary.apply_rope_(torch.view_as_real(f).view(1, 1, 16, 8), f), [F().clone()])),
    case("inplace-freqs-requires-grad", ValueError, r"rotary: freqs requires grad, but gradients with respect to the frequency table are not supported",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 8), F().requires_grad_()])),
    case("qk-inplace-freqs-requires-grad", ValueError, r"rotary: freqs requires grad",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F().requires_grad_()])),
    case("inplace-int32", TypeError, r"apply_rope_: x must be float32, float64, float16 or bfloat16, got Int",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [I(1, 2, 3, 8), F()])),
    case("inplace-odd-head-dim", ValueError, r"apply_rope_: x\.size\(-1\) \(head_dim\) must be even and > 0, got 7",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 7), F()])),
    case("inplace-rotary-dim-gt-head-dim", ValueError, r"apply_rope_: freqs must have shape \[max_seq_len, rotary_dim / 2\] with 0 < rotary_dim <= head_dim = 6",
         lambda: (lambda x, f: rotary.apply_rope_(x, f), [X(1, 2, 3, 6), F()])),
    case("qk-inplace-rotary-dim-gt-head-dim", ValueError, r"apply_rope_qk_: freqs must have shape .*head_dim = 8 .*got \[16, 6\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(1, 2, 3, 8), X(1, 1, 3, 8), F(12)])),
    case("inplace-offsets-float", TypeError, r"apply_rope_: offsets must have an integer dtype .*got Float",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, offsets=p), [X(2, 2, 3, 8), F(), torch.tensor([1.0, 2.0])])),
    case("inplace-ids-wrong-shape", ValueError, r"apply_rope_: position_ids must have shape \[seq_len\] or \[batch, seq_len\].*got \[2, 4\]",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, position_ids=p), [X(2, 2, 3, 8), F(), torch.zeros(2, 4, dtype=torch.int64)])),
    case("inplace-ids-with-start-pos", ValueError, r"apply_rope_: start_pos must be 0 with position_ids",
         lambda: (lambda x, f, p: rotary.apply_rope_(x, f, 2, position_ids=p), [X(2, 2, 3, 8), F(), torch.zeros(3, dtype=torch.int64)])),
    case("qk-inplace-batch-mismatch", ValueError, r"apply_rope_qk_: k must match q in batch, seq_len and head_dim.*k has shape \[1, 2, 3, 8\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(2, 2, 3, 8), X(1, 2, 3, 8), F()])),
    case("qk-inplace-seq-mismatch", ValueError, r"apply_rope_qk_: k must match q.*k has shape \[2, 2, 4, 8\]",
         lambda: (lambda q, k, f: rotary.apply_rope_qk_(q, k, f), [X(2, 2, 3, 8), X(2, 2, 4, 8), F()])),
    case("inplace-start-pos-out-of-table", IndexError, r"apply_rope_: start_pos \+ seq_len = 14 \+ 3 = 17 exceeds the freqs table length",
         lambda: (lambda x, f: rotary.apply_rope_(x, f, 14), [X(1, 2, 3, 8), F()])),
    case("qk-inplace-positions-out-of-table", IndexError, r"apply_rope_qk_: token \(batch 1, seq 2\) has position 16",
         lambda: (lambda q, k, f, p: rotary.apply_rope_qk_(q, k, f, offsets=p), [X(2, 2, 3, 8), X(2, 1, 3, 8), F(), torch.tensor([0, 14])])),
    # ---- cu_seqlens (packed varlen)
    case("cu-seqlens-not-monotonic", ValueError, r"apply_rope: cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[0, 3, 2, 5\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 3, 2, 5])), [X(5, 2, 8), F()])),
    case("cu-seqlens-not-starting-at-0", ValueError, r"cu_seqlens must start at 0.*got \[1, 3, 5\]",
         lambda: (_rope(cu_seqlens=torch.tensor([1, 3, 5])), [X(5, 2, 8), F()])),
    case("cu-seqlens-not-ending-at-T", ValueError, r"cu_seqlens must start at 0, never decrease, and end at total_tokens = 5; got \[0, 3, 4\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)), [X(5, 2, 8), F()])),
    case("qk-inplace-cu-seqlens-past-T", ValueError, r"apply_rope_qk_: cu_seqlens must start at 0.*got \[0, 3, 6\]",
         lambda: (lambda q, k, f, cu: rotary.apply_rope_qk_(q, k, f, cu_seqlens=cu), [X(5, 2, 8), X(5, 1, 8), F(), torch.tensor([0, 3, 6])])),
    case("cu-seqlens-float", TypeError, r"apply_rope: cu_seqlens must be int32 or int64, got Float",
         lambda: (_rope(cu_seqlens=torch.tensor([0.0, 5.0])), [X(5, 2, 8), F()])),
    case("cu-seqlens-2d", ValueError, r"cu_seqlens must be 1-D \[num_seqs \+ 1\].*got shape \[1, 2\]",
         lambda: (_rope(cu_seqlens=torch.tensor([[0, 5]])), [X(5, 2, 8), F()])),
    case("cu-seqlens-with-4d-x", ValueError, r"with cu_seqlens, x must be 3-D \[total_tokens, heads, head_dim\], got shape \[1, 5, 2, 8\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 5])), [X(1, 5, 2, 8), F()])),
    case("cu-seqlens-ids-wrong-shape", ValueError, r"with cu_seqlens, position_ids must have shape \[total_tokens\] = \[5\].*got \[6\]",
         lambda: (_rope(cu_seqlens=torch.tensor([0, 2, 5]), position_ids=torch.zeros(6, dtype=torch.int64)), [X(5, 2, 8), F()])),
    # ---- layout, inv_freq
    case("bad-layout", ValueError, r"apply_rope: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'BHDS'",
         lambda: (_rope(layout="BHDS"), [X(1, 2, 3, 8), F()])),
    case("inv-freq-float32", TypeError, r"apply_rope: inv_freq must be float64, got Float",
         lambda: (_rope(inv_freq=torch.ones(4)), [X(1, 2, 3, 8), F()])),
    case("inv-freq-wrong-shape", ValueError, r"inv_freq must have shape \[rotary_dim / 2\] = \[4\] to match freqs, got \[3\]",
         lambda: (_rope(inv_freq=torch.ones(3, dtype=torch.float64)), [X(1, 2, 3, 8), F()])),
    # ---- angle_dtype
    case("rope-freqs-angle-dtype", ValueError, r"freqs_table: angle_dtype must be 'float64' .* or 'float32' .*got 'float16'",
         lambda: (lambda: rotary.freqs_table(8, 4, angle_dtype="float16"), [])),
    case("module-angle-dtype", ValueError, r"RotaryEmbedding: angle_dtype must be 'float64'.*got torch\.float16",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16, angle_dtype=torch.float16), [])),
    case("cpp-angle-dtype", ValueError, r"RotaryEmbedding: angle_dtype must be 'float64'.*got 'bfloat16'",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16, angle_dtype="bfloat16"), [])),
    case("module-fp32-angles-past-table", IndexError, r"RotaryEmbedding\(angle_dtype=float32\): start_pos \+ seq_len = 14 \+ 3 = 17 exceeds max_seq_len 16",
         lambda: (lambda x: rotary.RotaryEmbedding(8, 16, angle_dtype="float32")(x, start_pos=14), [X(1, 2, 3, 8)])),
    case("cpp-fp32-angles-past-table", IndexError, r"RotaryEmbedding\(angle_dtype=float32\): start_pos \+ seq_len = 14 \+ 3 = 17",
         lambda: (lambda x: rotary.CppRotaryEmbedding(8, 16, angle_dtype="float32")(x, start_pos=14), [X(1, 2, 3, 8)])),
    # ---- loading tables the options would not build
    case("module-load-other-theta", RuntimeError, r"RotaryEmbedding\.load_state_dict: the saved tables do not match this module \(dim=8, max_seq_len=16, theta=10000.*'inv_freq'\[1\]",
         lambda: (lambda: rotary.RotaryEmbedding(8, 16).load_state_dict(rotary.RotaryEmbedding(8, 16, 500.0).state_dict()), [])),
    case("cpp-load-other-max-seq-len", RuntimeError, r"CppRotaryEmbedding\.load_state_dict: the saved 'freqs' has 32 rows but this module's max_seq_len is 16",
         lambda: (lambda: rotary.CppRotaryEmbedding(8, 16).load_state_dict(rotary.CppRotaryEmbedding(8, 32).state_dict()), [])),
    # ---- a real second device (CUDA builds with a GPU only)
    pytest.param(lambda: (_rope(), [X(1, 2, 3, 8).cuda(), F()]), ValueError,
                 r"apply_rope: freqs is on cpu but q/x is on cuda:0; move both to the same device",
                 id="freqs-on-cpu-x-on-cuda", marks=pytest.mark.skipif("not _cuda_kernels()")),
    pytest.param(lambda: (_qk(), [X(1, 2, 3, 8).cuda(), X(1, 2, 3, 8), F().cuda()]), ValueError,
                 r"apply_rope_qk: k is on cpu but q/x is on cuda:0",
                 id="k-on-cpu-q-on-cuda", marks=pytest.mark.skipif("not _cuda_kernels()")),
]


@pytest.mark.parametrize("build,exc,match", CASES)
def test_bad_input(build, exc, match):
    check_bad_input(build, exc, match)


def _cuda_kernels():
    """A GPU and a CUDA build of rotary (the device cases above need both)."""
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("rotary::apply_rope", "CUDA")


def test_bad_input_matrix_size():
    """The table above: at least 30 distinct bad inputs across apply_rope,
    apply_rope_qk, apply_rope_, apply_rope_qk_, rope_freqs and both modules."""
    ids = [p.id for p in OP_CASES + CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30
    for prefix in ("inplace-", "qk-inplace-", "qk-", "rope-freqs-", "module-", "cpp-", "cu-seqlens-"):
        assert any(i.startswith(prefix) for i in ids), prefix


@needs_cuda
def test_cross_device_errors():
    f_cpu = rotary.freqs_table(8, 16)
    x = randn((1, 2, 3, 8), seed=282, device="cuda")
    with pytest.raises(ValueError, match=r"freqs is on cpu but q/x is on cuda"):
        rotary.apply_rope(x, f_cpu)
    with pytest.raises(ValueError, match=r"offsets is on cpu"):
        rotary.apply_rope(x, f_cpu.cuda(), **op_positions(0, torch.tensor(1)))
    with pytest.raises(ValueError, match=r"k is on cpu"):
        rotary.apply_rope_qk(x, x.cpu(), f_cpu.cuda())
    with pytest.raises(ValueError, match=r"head_dim"):
        rotary.apply_rope(randn((1, 2, 3, 7), device="cuda"), f_cpu.cuda())
    with pytest.raises(IndexError, match=r"start_pos \+ seq_len"):
        rotary.apply_rope(x, f_cpu.cuda(), 14)


def _quantize(t):
    return torch.quantize_per_tensor(t, 0.1, 0, torch.qint8)


def _in_inference_mode(call):
    with torch.inference_mode():  # no autograd kernel runs first
        return call()


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}


def _dense_refusal_cases():
    f = rotary.freqs_table(8, 16)
    q, w = randn((1, 2, 4, 8), seed=290), torch.ones(8)
    nested = torch.nested.nested_tensor([q[0], q[0]])
    ragged = torch.nested.nested_tensor([randn((2, 3, 8), seed=295), randn((2, 4, 8), seed=296)])
    jagged = torch.nested.nested_tensor([randn((3, 2, 8), seed=292), randn((2, 2, 8), seed=293)], layout=torch.jagged)
    jagged_ids = torch.nested.nested_tensor([torch.arange(4), torch.arange(4)], layout=torch.jagged)
    cache = torch.zeros(1, 2, 16, 8)
    quantized = _quantize(q)
    sparse, fix = "a sparse COO tensor", r"\(\.to_dense\(\)\)"
    return [
        ("apply_rope", "x", sparse, lambda: rotary.apply_rope(q.to_sparse(), f)),
        ("apply_rope", "x", "a sparse compressed tensor", lambda: rotary.apply_rope(q[0, 0].to_sparse_csr(), f)),
        ("apply_rope", "x", "an mkldnn tensor", lambda: rotary.apply_rope(q.to_mkldnn(), f)),
        ("apply_rope", "x", "a nested tensor", lambda: rotary.apply_rope(nested, f)),
        ("apply_rope", "freqs", sparse, lambda: rotary.apply_rope(q, torch.view_as_real(f).to_sparse())),
        ("apply_rope", "position_ids", sparse,
         lambda: rotary.apply_rope(q, f, position_ids=torch.arange(4).view(1, 4).to_sparse())),
        ("apply_rope_qk", "k", sparse, lambda: rotary.apply_rope_qk(q, q.to_sparse(), f)),
        ("apply_rope_", "x", sparse, lambda: rotary.apply_rope_(q.to_sparse(), f)),
        ("apply_rope", "x", sparse, lambda: rotary.RotaryEmbedding(8, 16)(q.to_sparse())),
        ("RotaryEmbedding", r"q \(or x\)", sparse, lambda: rotary.CppRotaryEmbedding(8, 16)(q.to_sparse())),
        # A jagged nested tensor's own dispatch ran first: NotImplementedError naming only the op.
        ("apply_rope", "x", "a nested tensor", lambda: rotary.apply_rope(jagged, f, layout="BSHD")),
        ("apply_rope_", "x", "a nested tensor", lambda: torch.ops.rotary.apply_rope_(jagged, f, 0, True)),
        ("apply_rope", "position_ids", "a nested tensor", lambda: rotary.apply_rope(q, f, position_ids=jagged_ids)),
        ("apply_rope_qk_", "k", "a nested tensor", lambda: rotary.apply_rope_qk_(q, jagged, f)),
        ("apply_qk_norm_rope", "q", "a nested tensor", lambda: rotary.apply_qk_norm_rope(jagged, jagged, f)),
        ("apply_rope_with_kv_cache_", "v", "a nested tensor",
         lambda: rotary.apply_rope_with_kv_cache_(q, q.clone(), jagged, cache, cache, f)),
        # The module's own check: the Python one read q.size(seq) first (torch's "irregular" words).
        ("RotaryEmbedding", r"q \(or x\)", "a nested tensor", lambda: rotary.RotaryEmbedding(8, 16)(jagged, layout="BSHD")),
        ("RotaryEmbedding", r"q \(or x\)", "a nested tensor", lambda: rotary.RotaryEmbedding(8, 16)(ragged)),
        ("RotaryEmbedding", r"q \(or x\)", "a nested tensor", lambda: rotary.RotaryEmbedding(8, 16)(ragged, ragged)),
        ("RotaryEmbedding", r"q \(or x\)", "a nested tensor", lambda: rotary.CppRotaryEmbedding(8, 16)(jagged)),
        ("apply_rope", "x", "a nested tensor", lambda: _in_inference_mode(lambda: rotary.apply_rope(jagged, f))),
        # A host-driven rule reads the largest position first: that read got torch's words (aten::max).
        ("apply_rope", "position_ids", sparse,
         lambda: rotary.RotaryEmbedding(8, 16, scaling=DYNAMIC)(q, position_ids=torch.arange(4).view(1, 4).to_sparse())),
        ("apply_rope", "offsets", sparse, lambda: rotary.RotaryEmbedding(8, 16, scaling=DYNAMIC)(
            q, offsets=torch.tensor([3]).to_sparse())),
        ("apply_rope", "position_ids", "a nested tensor",
         lambda: rotary.RotaryEmbedding(8, 16, scaling=DYNAMIC)(q, position_ids=jagged_ids)),
        # Sparse meta tensors: torch's words named the SparseMeta backend.
        ("apply_rope", "x", sparse, lambda: rotary.apply_rope(q.to_sparse().to("meta"), f.to("meta"))),
        ("apply_rope", "position_ids", sparse, lambda: rotary.apply_rope(
            q.to("meta"), f.to("meta"), position_ids=torch.arange(4).to_sparse().to("meta"))),
        # Quantized tensors: torch's words named a backend.
        ("apply_rope", "x", "a quantized tensor", lambda: rotary.apply_rope(quantized, f)),
        ("apply_rope", "position_ids", "a quantized tensor",
         lambda: rotary.apply_rope(q, f, position_ids=torch.quantize_per_tensor(torch.arange(4.0), 1.0, 0, torch.qint32))),
        ("apply_rope_with_kv_cache_", "k_cache", "a quantized tensor",
         lambda: rotary.apply_rope_with_kv_cache_(q, q.clone(), q.clone(), _quantize(cache), cache, f)),
        ("apply_qk_norm_rope", "q_weight", "a quantized tensor",
         lambda: rotary.apply_qk_norm_rope(q, q, f, q_weight=_quantize(w))),
        ("RotaryEmbedding", r"q \(or x\)", "a quantized tensor", lambda: rotary.CppRotaryEmbedding(8, 16)(quantized)),
        ("apply_qk_norm_rope", "q_weight", sparse, lambda: rotary.apply_qk_norm_rope(q, q, f, q_weight=w.to_sparse())),
        ("apply_rope_with_kv_cache_", "k_cache", sparse,
         lambda: rotary.apply_rope_with_kv_cache_(q, q.clone(), q.clone(), cache.to_sparse(), cache, f, 0, True)),
        ("apply_rope_cos_sin", "cos", sparse,
         lambda: rotary.apply_rope_cos_sin(q, q, torch.randn(4, 8).to_sparse(), torch.randn(4, 8))),
        ("apply_rope_cos_sin", "q", "a nested tensor",
         lambda: rotary.apply_rope_cos_sin(nested, q, torch.randn(4, 8), torch.randn(4, 8))),
    ], fix


def test_sparse_mkldnn_quantized_and_nested_tensors_are_refused_by_name():
    """They dispatch to their own keys before any kernel runs; each op
    refuses the first such argument by name, what it is and what to pass
    (the module calls as the op they make), and writes nothing."""
    cases, fix = _dense_refusal_cases()
    for op, name, what, call in cases:
        with pytest.raises(TypeError, match=rf"^{op}: {name} must be a dense \(strided\) tensor, got {what}; "):
            call()
    q = randn((1, 2, 4, 8), seed=291)
    saved = q.clone()
    with pytest.raises(TypeError, match=fix):
        rotary.apply_rope_qk_(q, q.to_sparse(), rotary.freqs_table(8, 16))
    jagged = torch.nested.nested_tensor([randn((3, 2, 8), seed=294)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"k must be a dense \(strided\) tensor, got a nested tensor; pad it"):
        rotary.apply_rope_qk_(q, jagged, rotary.freqs_table(8, 16))
    assert torch.equal(q, saved)


def test_elements_that_share_only_some_bytes_overlap():
    """In-place x and a read-only input of another width whose elements
    start apart (float32 x from byte 4 of int64 ids, int32 ids from byte 4 of
    float64 x) still share bytes: the rotated floats would overwrite
    positions the kernel reads. Aliasing tests lined the element starts up."""
    f = rotary.freqs_table(8, 16)
    buf = torch.zeros(64, dtype=torch.int64)
    ids = buf[:4]
    ids.copy_(torch.arange(4))
    x = buf.view(torch.float32).as_strided((1, 1, 4, 8), (64, 64, 16, 2), 1)  # each float32 in an id's high half
    xd = torch.zeros(32, dtype=torch.float64).view(1, 1, 4, 8)
    ids_in_x = xd.view(torch.int32).view(-1).as_strided((4,), (16,), 1)  # byte 4 of each row's first double
    for target, pos in ((x, ids), (xd, ids_in_x)):
        snap = [t.clone() for t in (buf, xd)]
        for op in (torch.ops.rotary.apply_rope_, rotary.apply_rope_):
            with pytest.raises(ValueError, match=r"apply_rope_: x and position_ids overlap in memory"):
                op(target, f, position_ids=pos)
        assert torch.equal(buf, snap[0]) and torch.equal(xd, snap[1])


def test_an_inference_tensor_is_not_rotated_in_place_outside_inference_mode():
    f = rotary.freqs_table(8, 16)
    with torch.inference_mode():
        x, q, k = (randn((1, 2, 4, 8), seed=s) for s in (3, 4, 5))
    for name, call, ts in (("apply_rope_: x", lambda: rotary.apply_rope_(x, f), [x]),
                           ("apply_rope_: x", lambda: torch.ops.rotary.apply_rope_(x, f), [x]),
                           ("apply_rope_qk_: q", lambda: rotary.apply_rope_qk_(q, k, f), [q, k])):
        before = [t.clone() for t in ts]
        with pytest.raises(ValueError, match=rf"{name} is an inference tensor \(made under torch.inference_mode\(\)\)"):
            call()
        assert all(torch.equal(a, b) for a, b in zip(before, ts))
    with torch.inference_mode():  # where it was made, it is served
        rotary.apply_rope_(x, f)
