"""rotary.CppRotaryEmbedding under torch.compile, torch.export and
torch.func.functional_call: a graph break where Dynamo may break the graph,
and everywhere else a refusal that names the Python module to use instead
of an internal error (an AssertionError in Dynamo's trace rules, a TypeError
from torch's C++ binding of named_parameters)."""

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference

ADVICE = r"use rotary.RotaryEmbedding, the same module in Python \(docs/deploy.md\)"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rope = rotary.CppRotaryEmbedding(64, max_seq_len=128)

    def forward(self, q, k):
        q2, k2 = self.rope(q, k, 3)
        return q2 * 2, k2


def _inputs():
    torch.manual_seed(0)
    return torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64)


@pytest.mark.parametrize("whole", [False, True], ids=["child", "module"])
def test_compile_breaks_the_graph_and_rotates_as_eager(whole):
    torch._dynamo.reset()
    q, k = _inputs()
    model = Block() if not whole else rotary.CppRotaryEmbedding(64, max_seq_len=128)
    out = torch.compile(model)(q, k)
    want_q = rope_reference(q, 3).float() * 2 if not whole else rope_reference(q, 0).float()
    torch.testing.assert_close(out[0], want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], rope_reference(k, 3 if not whole else 0).float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("whole", [False, True], ids=["child", "module"])
def test_fullgraph_names_the_python_module(whole):
    torch._dynamo.reset()
    q, k = _inputs()
    model = Block() if not whole else rotary.CppRotaryEmbedding(64, max_seq_len=128)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"rotary.CppRotaryEmbedding runs its C\+\+ forward "
                                                              r"eagerly.*" + ADVICE):
        torch.compile(model, fullgraph=True)(q, k)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("whole", [False, True], ids=["child", "module"])
def test_export_is_refused_by_name(whole, strict):
    torch._dynamo.reset()
    q, k = _inputs()
    model = Block() if not whole else rotary.CppRotaryEmbedding(64, max_seq_len=128)
    with pytest.raises((TypeError, RuntimeError, torch._dynamo.exc.Unsupported), match=ADVICE):
        torch.export.export(model, (q, k), strict=strict)


def test_buffers_refuse_replacement_and_nn_module_methods_apply():
    q, k = _inputs()
    m = rotary.CppRotaryEmbedding(64, max_seq_len=128)
    table = m.freqs.clone()
    for call in (lambda: torch.func.functional_call(m, {"freqs": torch.zeros_like(m.freqs)}, (q, k)),
                 lambda: setattr(m, "freqs", torch.zeros_like(m.freqs)),
                 lambda: m.register_buffer("extra", torch.zeros(1)),
                 lambda: m.register_parameter("w", torch.nn.Parameter(torch.zeros(1))),
                 lambda: delattr(m, "freqs")):
        with pytest.raises(TypeError, match=r"rotary.CppRotaryEmbedding: cannot (set|delete) (buffer|parameter) '(freqs|extra|w)' "
                                            r"from Python.*load_tables or load_state_dict replaces the tables"):
            call()
    assert torch.equal(m.freqs, table) and [n for n, _ in m.named_buffers()] == ["freqs", "inv_freq"]
    # nn.Module's own signatures (torch's binding had none of these arguments).
    assert list(m.named_parameters(remove_duplicate=False)) == []
    assert [n for n, _ in m.named_buffers(prefix="rope")] == ["rope.freqs", "rope.inv_freq"]
    assert [mod for _, mod in m.named_modules()] == [m] and list(m.children()) == []
    assert m.to(torch.float64) is m and m.train(False) is m and not m.training
    # The cache's wrapper is fitted the same way.
    cache = rotary.KVCache(1, 2, 8, 64)
    assert [n for n, _ in cache.named_buffers(prefix="c")][:2] == ["c.k", "c.v"]
    with pytest.raises(TypeError, match=r"rotary.KVCache: cannot set buffer 'k' from Python.*use "
                                        r"rotary.apply_rope_with_kv_cache_ on cache tensors you hold.*; "
                                        r"load_state_dict replaces its state$") as refused:
        cache.k = torch.zeros(1)
    assert "load_tables" not in str(refused.value)  # a KVCache has no tables
