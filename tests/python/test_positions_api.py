"""offsets vs position_ids: the two meanings of "positions" have their own
names, any integer dtype, one rule for start_pos, and the deprecated
``positions=`` keeps its old deterministic meaning with a warning. Every
result is compared with the float64 reference (reference.positions_grid:
offsets [] / [B] add to start_pos + s, ids [B, S] are absolute)."""

import inspect
import warnings

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference
from rotary_testing.rope_testing import PAIRINGS, PAIRING_IDS, assert_close_ref, make_heads

INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
INT_IDS = ["int64", "int32", "int16", "int8", "uint8"]


def _modules():
    return {"py": rotary.RotaryEmbedding(16, 64), "cpp": rotary.CppRotaryEmbedding(16, 64)}


@pytest.mark.parametrize("kind", ["py", "cpp", "op"])
def test_position_ids_seq_shape_with_batch_equal_to_seq(kind):
    """batch == seq == 4 with position_ids = arange(S) + 7: formerly read as
    per-batch offsets (silently wrong). Now absolute ids, the same for every
    batch row, as in Hugging Face."""
    B = S = 4
    q, k = make_heads(B, 2, S, 16, seed=1), make_heads(B, 1, S, 16, seed=2)
    ids = torch.arange(S) + 7
    want_q = rope_reference(q, 0, True, ids.expand(B, S))
    want_k = rope_reference(k, 0, True, ids.expand(B, S))
    if kind == "op":
        oq, ok = rotary.apply_rope_qk(q, k, rotary.freqs_table(16, 64), position_ids=ids)
    else:
        oq, ok = _modules()[kind](q, k, position_ids=ids)
    assert_close_ref(oq, want_q, torch.float32)
    assert_close_ref(ok, want_k, torch.float32)
    # The old reading (offsets[b] + s) is a different rotation: the test can fail.
    assert not torch.allclose(oq.double(), rope_reference(q, 0, True, ids))


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=INT_IDS)
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_integer_dtypes(dtype, interleaved):
    f = rotary.freqs_table(16, 200)
    x, k = make_heads(2, 3, 5, 16, seed=3), make_heads(2, 1, 5, 16, seed=4)
    ids = torch.tensor([[0, 9, 3, 120, 7], [5, 5, 1, 0, 99]])
    offsets = torch.tensor([3, 90])
    out = rotary.apply_rope(x, f, 0, interleaved, position_ids=ids.to(dtype))
    assert_close_ref(out, rope_reference(x, 0, interleaved, ids), torch.float32)
    oq, ok = rotary.apply_rope_qk(x, k, f, 4, interleaved, offsets=offsets.to(dtype))
    assert_close_ref(oq, rope_reference(x, 4, interleaved, offsets), torch.float32)
    assert_close_ref(ok, rope_reference(k, 4, interleaved, offsets), torch.float32)
    # In place, and through both modules.
    y = x.clone()
    rotary.apply_rope_(y, f, 0, interleaved, position_ids=ids.to(dtype)[:, :].t().contiguous().t())
    assert torch.equal(y, out)
    for m in (rotary.RotaryEmbedding(16, 200, interleaved=interleaved),
              rotary.CppRotaryEmbedding(16, 200, interleaved=interleaved)):
        assert torch.equal(m(x, position_ids=ids.to(dtype)), out)
        assert torch.equal(m(x, 4, offsets=offsets.to(dtype)), oq)


def test_packed_int32_ids_and_offsets():
    f = rotary.freqs_table(8, 64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    x = torch.randn(7, 2, 8, dtype=torch.float64)
    ids = torch.tensor([4, 0, 9, 30, 31, 2, 2], dtype=torch.int32)
    out = rotary.apply_rope(x, f, 0, position_ids=ids, cu_seqlens=cu)
    for a, b in ((0, 3), (3, 7)):
        seg = x[a:b].permute(1, 0, 2)[None]  # [1, H, len, D]
        want = rope_reference(seg, 0, True, ids[a:b].long()[None])[0].permute(1, 0, 2)
        torch.testing.assert_close(out[a:b], want, rtol=1e-6, atol=1e-6)
    off = rotary.apply_rope(x, f, 2, offsets=torch.tensor(5, dtype=torch.int16), cu_seqlens=cu)
    want = rope_reference(x[3:7].permute(1, 0, 2)[None], 7)[0].permute(1, 0, 2)  # 2 + 5 + local
    torch.testing.assert_close(off[3:7], want, rtol=1e-6, atol=1e-6)


def test_start_pos_with_position_ids_is_refused():
    f = rotary.freqs_table(8, 16)
    x = torch.randn(1, 2, 3, 8)
    snap = x.clone()
    ids = torch.tensor([[1, 2, 3]])
    for call in (lambda: rotary.apply_rope(x, f, 2, position_ids=ids),
                 lambda: rotary.apply_rope_(x, f, 2, position_ids=ids),
                 lambda: rotary.RotaryEmbedding(8, 16)(x, 2, position_ids=ids),
                 lambda: rotary.CppRotaryEmbedding(8, 16)(x, 2, position_ids=ids)):
        with pytest.raises(ValueError, match=r"start_pos must be 0 with position_ids .*got start_pos = 2; add it to the ids"):
            call()
    assert torch.equal(x, snap)
    # The documented way: fold the origin into the ids.
    assert torch.equal(rotary.apply_rope(x, f, position_ids=ids + 2), rotary.apply_rope(x, f, 3))


def test_offsets_and_position_ids_together_are_refused():
    x = torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match="pass offsets .* or position_ids .*, not both"):
        rotary.apply_rope(x, rotary.freqs_table(8, 16), offsets=torch.tensor([0, 1]), position_ids=torch.arange(3))


@pytest.mark.parametrize("kind", ["op", "py", "cpp"])
def test_deprecated_positions_keeps_its_old_meaning_with_a_warning(kind):
    """[B] offsets (here with batch == seq, the ambiguous case) and [B, S] ids
    added to start_pos, as before; never without a DeprecationWarning."""
    B = S = 3
    x = make_heads(B, 2, S, 16, seed=5)
    f = rotary.freqs_table(16, 64)
    m = {"py": rotary.RotaryEmbedding(16, 64), "cpp": rotary.CppRotaryEmbedding(16, 64)}.get(kind)
    call = (lambda s, p: rotary.apply_rope(x, f, s, positions=p)) if kind == "op" else (lambda s, p: m(x, s, positions=p))
    off = torch.tensor([0, 10, 20])
    ids = torch.tensor([[0, 1, 2], [9, 8, 7], [30, 0, 4]])
    with pytest.warns(DeprecationWarning, match=r"positions= is deprecated.*offsets=.*position_ids="):
        out_off = call(2, off)
    with pytest.warns(DeprecationWarning):
        out_ids = call(2, ids)
    assert_close_ref(out_off, rope_reference(x, 2, True, off), torch.float32)
    assert_close_ref(out_ids, rope_reference(x, 2, True, ids), torch.float32)
    assert torch.equal(out_off, rotary.apply_rope(x, f, 2, offsets=off))
    assert torch.equal(out_ids, rotary.apply_rope(x, f, position_ids=ids + 2))


@pytest.mark.parametrize("kind", ["op", "py"])
def test_deprecated_positions_under_fullgraph_compile(kind, reset_dynamo):
    """The deprecated spelling still works for one release, compiled too: its
    warning (a graph break) is left to eager calls."""
    x = make_heads(2, 2, 3, 16, seed=6)
    f = rotary.freqs_table(16, 64)
    m = rotary.RotaryEmbedding(16, 64)
    call = (lambda p: rotary.apply_rope(x, f, 2, positions=p)) if kind == "op" else (lambda p: m(x, 2, positions=p))
    off, ids = torch.tensor([0, 10]), torch.tensor([[0, 1, 2], [9, 8, 7]])
    compiled = torch.compile(call, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for p in (off, ids):
            assert_close_ref(compiled(p), rope_reference(x, 2, True, p), torch.float32)


def test_deprecated_positions_with_a_new_name_is_refused():
    x = torch.randn(1, 1, 2, 8)
    with pytest.raises(ValueError, match="positions= is deprecated; pass offsets= or position_ids= alone"):
        rotary.apply_rope(x, rotary.freqs_table(8, 16), positions=torch.tensor(0), offsets=torch.tensor(0))


def test_deprecated_positions_out_of_range_are_named_as_given():
    """Refused as `positions`, the argument the caller passed, not as the
    position_ids it becomes."""
    x = torch.randn(1, 1, 2, 8)
    with pytest.warns(DeprecationWarning), pytest.raises(
            IndexError, match=r"apply_rope: positions must lie in \(-2\^60, 2\^60\), got 2305843009213693952"):
        rotary.apply_rope(x, rotary.freqs_table(8, 16), positions=torch.tensor([[0, 2**61]]))


def test_only_the_old_ops_take_the_deprecated_positions():
    """positions= stays where it was before offsets= / position_ids=; the
    later ops (KV cache, prologue, cos/sin tables) never had it."""
    old = {"apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_"}
    for name in old | {"apply_rope_with_kv_cache_", "apply_qk_norm_rope", "apply_qk_norm_rope_",
                       "apply_qk_norm_rope_with_kv_cache_", "apply_rope_cos_sin"}:
        takes = "positions" in inspect.signature(getattr(rotary, name)).parameters
        assert takes == (name in old), name


def test_new_names_emit_no_warning():
    x = torch.randn(2, 1, 3, 8)
    f = rotary.freqs_table(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rotary.apply_rope(x, f, offsets=torch.tensor([0, 1]))
        rotary.apply_rope(x, f, position_ids=torch.arange(3, dtype=torch.int32))
        rotary.RotaryEmbedding(8, 16)(x, position_ids=torch.arange(3))
        rotary.CppRotaryEmbedding(8, 16)(x, offsets=torch.tensor([0, 1]))


def test_int32_ids_gradcheck_and_opcheck():
    f = rotary.freqs_table(8, 32)
    ids = torch.tensor([[3, 0, 9], [1, 1, 30]], dtype=torch.int32)
    q = torch.randn(2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k: rotary.apply_rope_qk(q, k, f, 0, False, position_ids=ids), (q, k))
    assert torch.autograd.gradgradcheck(lambda q: rotary.apply_rope(q, f, 5, offsets=ids[:, 0]), (q,))
    torch.library.opcheck(torch.ops.rotary.apply_rope_qk.default, (q.float(), k.float(), f), dict(position_ids=ids))
    torch.library.opcheck(torch.ops.rotary.apply_rope.default, (q.float(), f, 2), dict(offsets=ids[:, 1].to(torch.int16)))


def test_compile_fullgraph_with_int32_position_ids():
    f = rotary.freqs_table(16, 64)
    m = rotary.RotaryEmbedding(16, 64, interleaved=False)
    fn = torch.compile(lambda q, k, ids: m(q, k, position_ids=ids), fullgraph=True, backend="aot_eager")
    q, k = make_heads(2, 2, 5, 16, seed=6), make_heads(2, 1, 5, 16, seed=7)
    ids = torch.tensor([[4, 5, 6, 7, 8], [40, 41, 42, 0, 1]], dtype=torch.int32)
    oq, ok = fn(q, k, ids)
    assert_close_ref(oq, rope_reference(q, 0, False, ids.long()), torch.float32)
    assert torch.equal(ok, rotary.apply_rope(k, f, 0, False, position_ids=ids))


def test_deprecated_table_builder_names():
    with pytest.warns(DeprecationWarning, match="use rotary.freqs_table"):
        old = rotary.rope_freqs(8, 16, 500.0)
    assert torch.equal(old, rotary.freqs_table(8, 16, 500.0))
    with pytest.warns(DeprecationWarning, match="use rotary.inv_frequencies"):
        inv, scale = rotary.rope_frequencies(8, 500.0)
    new_inv, new_scale = rotary.inv_frequencies(8, 500.0)
    assert torch.equal(inv, new_inv) and scale == new_scale == 1.0
    torch.testing.assert_close(new_inv, 500.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8), rtol=1e-15, atol=0)
