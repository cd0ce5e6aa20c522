"""Tables and modules built inside torch.func transforms, in-place ops under
nested transforms, and the refusals that name what autograd cannot take:
each call gives the float64 reference's result or a named error."""

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jvp, vmap

import rotary
from rotary_testing.reference import rope_reference_nd
from rotary_testing.rope_testing import randn, ref_rope4
from rotary_testing.scaling_reference import ref_frequencies

D = 8


@pytest.mark.parametrize("build", ["freqs_table", "inv_frequencies", "RotaryEmbedding", "CppRotaryEmbedding"])
def test_tables_built_inside_jvp_and_grad(build):
    """The builders write a new CPU tensor through its pointer: under grad /
    jvp at::empty gave a wrapper with no storage ("Cannot access data pointer")."""
    x, t = randn((1, 2, 4, D), torch.float64, 1), randn((1, 2, 4, D), torch.float64, 2)

    def rotate(xx):
        if build == "freqs_table":
            return rotary.apply_rope(xx, rotary.freqs_table(D, 16), 3)
        if build == "inv_frequencies":  # rows 20.. past the 4-row table, from inv_freq
            return rotary.apply_rope(xx, rotary.freqs_table(D, 4), 3, inv_freq=rotary.inv_frequencies(D)[0])
        module = rotary.RotaryEmbedding(D, 16) if build == "RotaryEmbedding" else rotary.CppRotaryEmbedding(D, 16)
        return module(xx, 3)

    out, tangent = jvp(rotate, (x,), (t,))
    torch.testing.assert_close(out, ref_rope4(x, start=3))
    torch.testing.assert_close(tangent, ref_rope4(t, start=3))  # linear: the jvp is the tangent rotated
    g = grad(lambda xx: (rotate(xx) * t).sum())(x)
    torch.testing.assert_close(g, ref_rope4(t, start=3, inverse=True))  # R^T t


@pytest.mark.parametrize("transform", ["jvp", "grad"])
def test_host_driven_module_grows_inside_a_transform(transform):
    """A dynamic rule's call past its table rebuilds the tables inside the
    transform: the rotation by the frequencies of the call's reach (31),
    against the float64 re-derivation of the rule."""
    rule = {"rope_type": "dynamic", "factor": 2.0}
    rope = rotary.RotaryEmbedding(D, 16, scaling=rule)
    inv = np.array(ref_frequencies(D, 10000.0, dict(rule, max_position_embeddings=16), 31)[0])
    x, t = randn((1, 2, 4, D), torch.float64, 3), randn((1, 2, 4, D), torch.float64, 4)
    ids = torch.tensor([[0, 9, 20, 30]])

    def ref(v, inverse=False):
        return rope_reference_nd(v, ids[None].numpy(), [0] * (D // 2), D, inv=inv, inverse=inverse)

    if transform == "jvp":
        out, tangent = jvp(lambda xx: rope(xx, position_ids=ids), (x,), (t,))
        torch.testing.assert_close(out, ref(x))
        torch.testing.assert_close(tangent, ref(t))
    else:
        g = grad(lambda xx: (rope(xx, position_ids=ids) * t).sum())(x)
        torch.testing.assert_close(g, ref(t, inverse=True))  # R^T t
    torch.testing.assert_close(rope.inv_freq, torch.from_numpy(inv), rtol=1e-12, atol=0)


@pytest.mark.parametrize("angle_dtype", ["float64", "float32"])
def test_functional_call_leaves_the_module_at_the_tables_it_holds(angle_dtype):
    """functional_call puts the caller's buffers back after a call that grew
    the rule: the module follows the tables it holds (state 0), and its next
    call grows to that call's reach (30), not the one inside (40)."""
    rule = {"rope_type": "dynamic", "factor": 2.0}
    rope = rotary.RotaryEmbedding(D, 16, scaling=rule, angle_dtype=angle_dtype)
    torch.func.functional_call(rope, dict(rope.named_buffers()), (randn((1, 1, 40, D), seed=5),))
    assert rope.rope_state == 0
    x = randn((1, 2, 4, D), torch.float32, 6)
    inv = np.array(ref_frequencies(D, 10000.0, dict(rule, max_position_embeddings=16), 30)[0])
    want = rope_reference_nd(x, np.arange(26, 30)[None, None], [0] * (D // 2), D, inv=inv)
    torch.testing.assert_close(rope(x, 26), want.float(), rtol=0, atol=2e-6)
    assert rope.rope_state == 30


def test_the_state_is_that_of_the_tables_passed_or_copied():
    """functional_call with another state's tables (a checkpoint's) rotates
    from that state, and a copy taken after functional_call put the caller's
    tables back holds their state (it pickled the switched one)."""
    import copy

    rule = {"rope_type": "dynamic", "factor": 2.0}
    full = dict(rule, max_position_embeddings=16)
    x = randn((1, 2, 4, D), torch.float32, 7)

    def want(seen):
        inv = np.array(ref_frequencies(D, 10000.0, full, seen)[0])
        return rope_reference_nd(x, np.arange(20, 24)[None, None], [0] * (D // 2), D, inv=inv).float()

    fresh = rotary.RotaryEmbedding(D, 16, scaling=rule)
    state0 = {name: t.clone() for name, t in fresh.named_buffers()}  # a state-0 checkpoint's tables
    grown = rotary.RotaryEmbedding(D, 16, scaling=rule)
    grown(randn((1, 1, 40, D), seed=8))  # state 40
    out = torch.func.functional_call(grown, state0, (x, 20))  # from state 0, reach 24: grows to 24
    torch.testing.assert_close(out, want(24), rtol=0, atol=2e-6)
    assert grown.rope_state == 40  # its own tables, back
    torch.testing.assert_close(grown(x, 20), want(40), rtol=0, atol=2e-6)

    rope = rotary.RotaryEmbedding(D, 16, scaling=rule)
    torch.func.functional_call(rope, dict(rope.named_buffers()), (randn((1, 1, 40, D), seed=9),))
    for made in (copy.deepcopy(rope), pickle_round_trip(rope)):
        assert made.rope_state == 0
        torch.testing.assert_close(made(x, 20), want(24), rtol=0, atol=2e-6)


def pickle_round_trip(m):
    import pickle

    return pickle.loads(pickle.dumps(m))


def test_in_place_ops_under_nested_transforms():
    """The vmap rule's overlap check read the tensors at its own level, which
    under an outer vmap / jvp / grad are wrappers with no storage."""
    f = rotary.freqs_table(D, 16)
    x = randn((2, 3, 1, 2, 4, D), torch.float64, 5)
    y = x.clone()
    vmap(vmap(lambda t: rotary.apply_rope_(t, f, 2)))(y)
    torch.testing.assert_close(y, ref_rope4(x.reshape(6, 2, 4, D), start=2).reshape(x.shape))
    q, k = x.clone(), randn((2, 3, 1, 1, 4, D), torch.float64, 6)
    k0 = k.clone()
    vmap(vmap(lambda a, b: rotary.apply_rope_qk_(a, b, f)))(q, k)
    torch.testing.assert_close(k, ref_rope4(k0.reshape(6, 1, 4, D)).reshape(k0.shape))
    ids = torch.tensor([[1, 5, 2, 7]]).expand(3, 1, 4)  # batched ids: one call per slice

    def rotated(t):
        return vmap(lambda a, i: rotary.apply_rope_(a.clone(), f, position_ids=i))(t, ids)

    xs, ts = x[0], randn((3, 1, 2, 4, D), torch.float64, 7)
    want = torch.stack([ref_rope4(xs[i], positions=ids[i]) for i in range(3)])
    out, tangent = jvp(rotated, (xs,), (ts,))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(tangent, torch.stack([ref_rope4(ts[i], positions=ids[i]) for i in range(3)]))
    with pytest.raises(ValueError, match=r"apply_rope_: x requires grad; in-place rotation is not differentiable"):
        grad(lambda t: (rotated(t) * ts).sum())(xs)  # reverse mode of an in-place op: refused by name


def test_inference_tensors_autograd_would_save_are_named():
    with torch.inference_mode():
        f = rotary.freqs_table(D, 16)
        qi = randn((1, 2, 4, D), seed=8)
    x = randn((1, 2, 4, D), seed=9).requires_grad_()
    with pytest.raises(ValueError, match=r"rotary: freqs is an inference tensor .* pass freqs.clone\(\)"):
        rotary.apply_rope(x, f)
    w = torch.ones(D, requires_grad=True)
    with pytest.raises(ValueError, match=r"rotary: q is an inference tensor .* cannot save for backward"):
        rotary.apply_qk_norm_rope(qi, randn((1, 1, 4, D), seed=10), f.clone(), q_weight=w)


def test_fp8_q_with_a_tangent_names_the_tangent():
    f = rotary.freqs_table(D, 16)
    q, k = randn((1, 2, 4, D), seed=11), randn((1, 1, 4, D), seed=12)
    with fwAD.dual_level(), torch.no_grad():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(ValueError, match=r"an input carries a forward-mode tangent \(torch.no_grad\(\) does not "
                                             r"remove it\)"):
            rotary.apply_qk_norm_rope(dual, k, f, q_fp8_scale=torch.tensor(1.0))


def test_functionalize_serves_the_out_of_place_ops_and_leaves_the_in_place_ones_untouched():
    """As docs/api.md says: torch.func.functionalize skips the keys where a
    rule could name an op that writes its arguments, so those get torch's
    words, with nothing written; the out-of-place ops are served."""
    from torch.func import functionalize
    f = rotary.freqs_table(D, 16)
    x = randn((2, 3, 5, D), torch.float64, 8)
    torch.testing.assert_close(functionalize(lambda t: rotary.apply_rope(t, f, 2))(x), ref_rope4(x, start=2))
    saved = x.clone()
    with pytest.raises(RuntimeError, match=r"custom \(non-ATen\) operator whose output has alias annotations"):
        functionalize(lambda t: rotary.apply_rope_(t, f, 2))(x)
    assert torch.equal(x, saved)


@pytest.mark.parametrize("cls", [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding])
@pytest.mark.parametrize("angle_dtype", ["float64", "float32"])
def test_a_module_inv_freq_that_requires_grad_is_refused_inside_the_table_too(cls, angle_dtype):
    """The op refuses an inv_freq that requires grad; a module passed it only
    for positions past its table, so a call inside it served it, and
    torch.func.grad through functional_call got zeros."""
    from torch.func import functional_call

    m = cls(8, 32, angle_dtype=angle_dtype)
    q = randn((1, 2, 4, 8), seed=501)
    words = r"rotary: inv_freq requires grad, but gradients with respect to the frequencies are not supported"
    if cls is rotary.RotaryEmbedding:
        with pytest.raises(ValueError, match=words):
            grad(lambda w: functional_call(m, {"freqs": m.freqs, "inv_freq": w}, (q,), dict(start_pos=1)).sum())(
                m.inv_freq.clone())
    m.inv_freq.requires_grad_()
    with pytest.raises(ValueError, match=words):
        m(q, start_pos=1)
    m.inv_freq.requires_grad_(False)
    torch.testing.assert_close(m(q, start_pos=1).double(), ref_rope4(q, None, 1, True), rtol=0, atol=1e-5)
