"""Multimodal RoPE through the module: the pair -> axis maps (Qwen2-VL
sections, Qwen3-VL interleaved), from_hf_config, parity with transformers'
rotary classes, and tiny random-weight Qwen2-VL / Qwen3-VL models patched
through rotary.integrations.transformers."""

import re

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference_nd
from rotary_testing.hf_sweep import tiny_vl
from rotary_testing.rope_testing import assert_close_ref, gen, randn

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl  # noqa: E402

pytestmark = pytest.mark.usefixtures("reset_dynamo")


def test_pair_axes_rules():
    assert rotary._C.mrope_pair_axes([2, 3, 3], 16) == [0, 0, 1, 1, 1, 2, 2, 2]
    # Qwen3-VL: j % 3 == 1 -> H and j % 3 == 2 -> W below 3 * section, else T.
    assert rotary._C.mrope_pair_axes([4, 2, 2], 16, True) == [0, 1, 2, 0, 1, 2, 0, 0]
    full = rotary._C.mrope_pair_axes([24, 20, 20], 128, True)
    assert full[:6] == [0, 1, 2, 0, 1, 2] and full[57:] == [0, 1, 2, 0, 0, 0, 0] and full.count(1) == 20
    with pytest.raises(ValueError, match=r"mrope_section \[16, 24, 20\] must sum to rotary_dim / 2 = 64 .*got 60"):
        rotary.RotaryEmbedding(128, mrope_section=[16, 24, 20])
    # Each entry is checked before the sum, so none can wrap it; an empty
    # section (an axis no pair reads) is refused too.
    with pytest.raises(ValueError, match=r"mrope_section\[1\] must be in \[1, rotary_dim / 2 = 8\].*got -1"):
        rotary._C.mrope_pair_axes([7, -1], 16)
    with pytest.raises(ValueError, match=r"mrope_section\[0\] must be in \[1, rotary_dim / 2 = 8\].*got 9"):
        rotary._C.mrope_pair_axes([9, -1], 16)
    with pytest.raises(ValueError, match=r"mrope_section\[1\] must be in \[1, .*got 4611686018427387904"):
        rotary._C.mrope_pair_axes([4, 2**62, 2**62 + 4], 16)
    for make in (rotary.RotaryEmbedding, rotary.CppRotaryEmbedding):
        with pytest.raises(ValueError, match=r"mrope_section\[2\] must be in \[1, rotary_dim / 2 = 4\].*got 0"):
            make(8, mrope_section=[2, 2, 0])
    # rotary_dim itself: an odd one was floored, a non-positive one blamed on the sections
    for d in (7, 15, 0, -16):
        with pytest.raises(ValueError, match=rf"mrope_pair_axes: rotary_dim must be even and > 0 .*got {d}"):
            rotary._C.mrope_pair_axes([1, 1, 1], d)


def test_module_mrope_and_offset():
    """The module gives each pair its axis for [3, B, S] ids, the 1-D rotation
    for 2-D ids (a text token), and rotates the span at rotary_offset."""
    rope = rotary.RotaryEmbedding(16, 64, interleaved=False, mrope_section=[4, 2, 2], rotary_offset=4)
    assert "mrope_section=[4, 2, 2]" in repr(rope) and "rotary_offset=4" in repr(rope)
    q, k = randn((2, 3, 5, 24), seed=1), randn((2, 1, 5, 24), seed=2)
    pos = torch.randint(0, 64, (3, 2, 5), generator=gen(3))
    oq, ok = rope(q, k, position_ids=pos)
    assert_close_ref(oq, rope_reference_nd(q, pos.numpy(), rope.pair_axes, 16, 4, False), torch.float32)
    assert_close_ref(ok, rope_reference_nd(k, pos.numpy(), rope.pair_axes, 16, 4, False), torch.float32)
    text = pos[0]
    assert torch.equal(rope(q, position_ids=text.expand(3, 2, 5)), rope(q, position_ids=text))
    with pytest.raises(ValueError, match=r"head_dim must be >= rotary_offset \+ dim = 20 \(the rotated span\)"):
        rope(randn((1, 1, 2, 18)))


def _text_config(cls, sections, **extra):
    return cls(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16,
               num_key_value_heads=2, max_position_embeddings=128,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections, **extra})


def _hf_rotate(emb, q, k, pos, apply):
    cos, sin = emb(q, pos)
    return apply(q, k, cos, sin)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_parity_with_transformers_rotary(family):
    """Against Qwen2VLRotaryEmbedding / Qwen3VLTextRotaryEmbedding + their
    apply_rotary_pos_emb: within their fp32-angle error; the float64
    reference first."""
    if family == "qwen2_vl":
        cfg = _text_config(transformers.Qwen2VLTextConfig, [2, 3, 3])
        emb, apply = qwen2_vl.Qwen2VLRotaryEmbedding(cfg), qwen2_vl.apply_rotary_pos_emb
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

        cfg = _text_config(transformers.Qwen3VLTextConfig, [4, 2, 2], mrope_interleaved=True)
        emb, apply = qwen3_vl.Qwen3VLTextRotaryEmbedding(cfg), qwen3_vl.apply_rotary_pos_emb
    rope = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert rope.mrope_interleaved == (family == "qwen3_vl")
    q, k = randn((2, 4, 9, 16), seed=4), randn((2, 2, 9, 16), seed=5)
    # An image-grid-like pattern: text, then a 1 x 2 x 3 grid at t = 2, then text.
    t = [0, 1, 2, 2, 2, 2, 2, 2, 5]
    h = [0, 1, 2, 2, 2, 3, 3, 3, 5]
    w = [0, 1, 2, 3, 4, 2, 3, 4, 5]
    pos = torch.tensor([t, h, w])[:, None].expand(3, 2, 9) + torch.tensor([0, 7])[None, :, None]
    oq, ok = rope(q, k, position_ids=pos)
    assert_close_ref(oq, rope_reference_nd(q, pos.numpy(), rope.pair_axes, 16, 0, False), torch.float32)
    hq, hk = _hf_rotate(emb, q, k, pos, apply)
    torch.testing.assert_close(oq, hq, rtol=0, atol=2e-5)
    torch.testing.assert_close(ok, hk, rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tiny_vl_model_patched(family):
    """A random-weight model with an image (so get_rope_index builds
    image-grid positions): logits within 2e-5 in fp32 and the same greedy
    tokens, patched through rotary.integrations.transformers."""
    from rotary.integrations.transformers import rotary_patched, rotary_embedding_of

    try:
        model, inputs = tiny_vl(family)
    except (TypeError, ValueError) as e:  # pragma: no cover - a transformers without this family
        pytest.skip(f"{family} does not build small here: {e}")
    with torch.no_grad():
        ref_logits = model(**inputs).logits
        ref_tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        with rotary_patched(model):
            assert rotary_embedding_of(model).pair_axes is not None
            logits = model(**inputs).logits
            tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-5)
    assert torch.equal(tokens, ref_tokens)


# ---------------------------------------------------------------------- axial
def test_axial_flux_per_axis_theta():
    """FLUX-style axes_dim with a theta per axis (interleaved pairs) against
    the float64 reference; one axis at the module's theta is the 1-D op."""
    import numpy as np

    dims, thetas = [4, 6, 6], [10000.0, 100.0, 1000.0]
    rope = rotary.RotaryEmbedding(16, 64, axes_dim=dims, axes_theta=thetas)
    assert rope.pair_axes == [0, 0, 1, 1, 1, 2, 2, 2] and "axes_dim=[4, 6, 6], axes_theta=[10000.0, 100.0, 1000.0]" in repr(rope)
    cpp = rotary.CppRotaryEmbedding(16, 64, axes_dim=dims, axes_theta=[1e4, 100.0, 1000.125])  # every digit shown
    assert "axes_dim=[4, 6, 6], axes_theta=[10000, 100, 1000.125])" in repr(cpp)
    inv = np.concatenate([t ** (-np.arange(0, d, 2) / d) for d, t in zip(dims, thetas)])
    torch.testing.assert_close(rope.inv_freq, torch.from_numpy(inv), rtol=1e-15, atol=0)
    x = randn((2, 3, 5, 16), torch.float64, seed=7)
    pos = torch.randint(0, 64, (3, 2, 5), generator=gen(8))
    out = rope(x, position_ids=pos)
    assert_close_ref(out, rope_reference_nd(x, pos.numpy(), rope.pair_axes, 16, 0, True, inv=inv), torch.float64)
    one = rotary.RotaryEmbedding(16, 64, axes_dim=[16])
    ids = pos[:1]
    assert torch.equal(one(x, position_ids=ids), rotary.RotaryEmbedding(16, 64)(x, position_ids=ids[0]))
    with pytest.raises(ValueError, match=r"axes_dim \[4, 6, 4\] must sum to dim = 16, got 14"):
        rotary.RotaryEmbedding(16, axes_dim=[4, 6, 4])
    with pytest.raises(ValueError, match=r"^RotaryEmbedding: axes_theta must hold one theta, or one per axis \(3\), "
                                         r"got 2 values"):
        rotary.RotaryEmbedding(16, axes_dim=dims, axes_theta=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"^RotaryEmbedding: axes_theta\[1\] must be finite and > 0, got nan"):
        rotary.RotaryEmbedding(16, axes_dim=dims, axes_theta=[1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match=r"^axial_rope: axes_dim\[0\] must be even"):
        rotary._C.axial_rope([3, 4], [1e4])
    with pytest.raises(ValueError, match=r"takes no scaling rule \(got 'linear'\)"):
        rotary.RotaryEmbedding(16, axes_dim=dims, scaling={"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_axial_module_needs_nd_ids(front):
    """Axial RoPE has no 1-D meaning: [2, seq] ids (the op's N-D form) with a
    batch of 2 were read as one position per token of each batch row, and a
    call without ids (forward_with_cache too) turned every axis alike.
    Refused by name; [n_axes, batch, seq] ids are served."""
    make = rotary.RotaryEmbedding if front == "python" else rotary.CppRotaryEmbedding
    rope = make(16, 64, interleaved=False, axes_dim=[8, 8], axes_shared_spectrum=True)
    assert re.search(r"axes_dim=\[8, 8\], axes_shared_spectrum=(True|true)\)", repr(rope))
    x = randn((2, 2, 5, 16), torch.float64, seed=30)
    ids = torch.randint(0, 64, (2, 5), generator=gen(31))
    for kw, got in ((dict(position_ids=ids), r"position_ids of shape \[2, 5\]"),
                    (dict(position_ids=ids[0]), r"position_ids of shape \[5\]"), ({}, "no position_ids")):
        with pytest.raises(ValueError, match=r"RotaryEmbedding\(dim=16, axes_dim=\[8, 8\]\): an axial module turns "
                                             r"pair j by its axis' row of position_ids; pass position_ids of shape "
                                             r"\[n_axes, batch, seq\] = \[2, batch, seq\], got " + got):
            rope(x, **kw)
    nd = ids[:, None].expand(2, 2, 5)
    inv = rope.inv_freq.numpy()
    assert_close_ref(rope(x, position_ids=nd), rope_reference_nd(x, nd.numpy(), rope.pair_axes, 16, 0, False, inv=inv),
                     torch.float64)
    cache = rotary.KVCache(2, 2, 8, 16, dtype=torch.float64)
    q, k = x.clone(), x.clone()
    with pytest.raises(ValueError, match=r"RotaryEmbedding.forward_with_cache: an axial module \(axes_dim=\[8, 8\]\) "
                                         r"turns pair j by its axis' row of position_ids, which forward_with_cache "
                                         r"does not take"):
        rope.forward_with_cache(q, k, x, cache)
    assert torch.equal(q, x) and torch.equal(k, x) and cache.length == 0


def test_axial_pixtral_parity():
    """Pixtral 2-D (one spectrum dealt to h and w) against transformers'
    PixtralVisionRotaryEmbedding + rotate_half, on a patch grid."""
    from transformers.models.pixtral import modeling_pixtral as pixtral

    cfg = transformers.PixtralVisionConfig(hidden_size=64, num_attention_heads=4, head_dim=16, image_size=16,
                                           patch_size=2, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    emb = pixtral.PixtralVisionRotaryEmbedding(cfg)
    rope = rotary.RotaryEmbedding(16, 64, interleaved=False, axes_dim=[8, 8], axes_shared_spectrum=True)
    h, w = torch.meshgrid(torch.arange(3), torch.arange(5), indexing="ij")
    hw = torch.stack([h.flatten(), w.flatten()], dim=-1)  # [P, 2], as Pixtral builds them
    q = randn((1, 4, hw.shape[0], 16), seed=9)
    cos, sin = emb(q, hw)
    expect = q * cos + pixtral.rotate_half(q) * sin
    out = rope(q, position_ids=hw.T[:, None])  # [2, 1, P]
    torch.testing.assert_close(out, expect, rtol=0, atol=2e-5)
    from_cfg = rotary.RotaryEmbedding.from_hf_config(cfg)
    assert from_cfg.axes_dim == [8, 8] and torch.equal(from_cfg.inv_freq, rope.inv_freq)
    assert torch.equal(from_cfg(q, position_ids=hw.T[:, None]), out)


def test_nd_modules_copy_pickle_and_load():
    """deepcopy, pickle and load_state_dict keep the N-D options (the axial
    frequencies come from the C++ state machine)."""
    import copy
    import pickle

    for kw in (dict(axes_dim=[4, 6, 6], axes_theta=[1e4, 100.0, 1e3]), dict(mrope_section=[2, 3, 3], rotary_offset=2)):
        m = rotary.RotaryEmbedding(16, 32, **kw)
        x = randn((1, 2, 4, 18), seed=10)
        pos = torch.randint(0, 32, (3, 1, 4), generator=gen(11))
        want = m(x, position_ids=pos)
        for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert torch.equal(c(x, position_ids=pos), want)
            assert c.pair_axes == m.pair_axes and torch.equal(c.inv_freq, m.inv_freq)
            c.load_state_dict(m.state_dict())  # the copy's state machine still builds these tables
        fresh = rotary.RotaryEmbedding(16, 32, **kw)
        fresh.load_state_dict(m.state_dict())
        assert torch.equal(fresh(x, position_ids=pos), want)
    with pytest.raises(RuntimeError, match="inv_freq"):  # tables of another spectrum are refused
        rotary.RotaryEmbedding(16, 32).load_state_dict(rotary.RotaryEmbedding(16, 32, axes_dim=[8, 8]).state_dict())


def test_cpp_module_matches_python():
    """rotary.CppRotaryEmbedding (the C++ module) takes the same N-D options,
    from the same from_hf_config kwargs, and pickles them."""
    import pickle

    from rotary.hf import rope_kwargs_from_hf_config

    cfg = _text_config(transformers.Qwen3VLTextConfig, [4, 2, 2], mrope_interleaved=True)
    cases = [rope_kwargs_from_hf_config(cfg), dict(dim=16, axes_dim=[4, 6, 6], axes_theta=[1e4, 100.0, 1e3]),
             dict(dim=16, axes_dim=[8, 8], axes_shared_spectrum=True, interleaved=False), dict(dim=16, rotary_offset=4)]
    q, k = randn((1, 2, 5, 20), seed=12), randn((1, 1, 5, 20), seed=13)
    pos = torch.randint(0, 32, (3, 1, 5), generator=gen(14))
    for kw in cases:
        py, cpp = rotary.RotaryEmbedding(**kw), rotary.CppRotaryEmbedding(**kw)
        ids = pos[: max(py.pair_axes) + 1] if py.pair_axes else pos[0]
        assert cpp.pair_axes == py.pair_axes
        for a, b in zip(py(q, k, position_ids=ids), pickle.loads(pickle.dumps(cpp))(q, k, position_ids=ids)):
            assert torch.equal(a, b)


def test_module_compiles_fullgraph():
    rope = rotary.RotaryEmbedding(16, 64, interleaved=False, mrope_section=[4, 2, 2], rotary_offset=2)
    q, k = randn((1, 2, 5, 20), seed=15), randn((1, 1, 5, 20), seed=16)
    pos = torch.randint(0, 64, (3, 1, 5), generator=gen(17))
    step = torch.compile(lambda q, k, p: rope(q, k, position_ids=p), fullgraph=True)
    for a, b in zip(step(q, k, pos), rope(q, k, position_ids=pos)):
        assert torch.equal(a, b)
