"""Traces that would keep a host-side decision as a constant are refused by
name, before anything is written: torch.jit.trace of a host-driven
rule (the tables of the traced call's reach served every later call),
forward_with_cache under torch.jit.trace or a non-strict torch.export (the
cache's length baked in, and the user's cache advanced while tracing), a
patched transformers model whose rule reads max(position_ids), and
torch.fx.symbolic_trace of the modules (its Proxies were "not a tensor")."""

import warnings

import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}
MODULES = {"py": rotary.RotaryEmbedding, "cpp": rotary.CppRotaryEmbedding}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Rotate(torch.nn.Module):
    def __init__(self, rope, at=None):
        super().__init__()
        self.rope, self.at = rope, at

    def forward(self, q, ids):
        # at: an int start_pos and nothing else, the decode step's fast path
        return self.rope(q, position_ids=ids) if self.at is None else self.rope(q, ids, start_pos=self.at)


@pytest.mark.parametrize("at", [None, 20])
@pytest.mark.parametrize("kind", list(MODULES))
def test_jit_trace_of_a_host_driven_rule_is_refused(kind, at):
    """With an int start_pos the Python module's decode fast path ran before
    the check: the trace kept the tables of its reach (28, past
    max_position_embeddings) for every later call, and switched the state."""
    rope = MODULES[kind](32, 64, scaling=DYNAMIC)
    q = randn(1, 2, 8, 32, seed=1)
    k = torch.arange(8)[None] if at is None else randn(1, 1, 8, 32, seed=4)
    q0, k0 = q.clone(), k.clone()
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match=r"rebuilds the tables on the host from each "
                                                                     r"call's reach, which torch.jit.trace would "
                                                                     r"freeze at the traced call's; use "
                                                                     r"rotary.RotaryEmbedding under torch.compile"):
        warnings.simplefilter("ignore")
        torch.jit.trace(Rotate(rope, at), (q, k), check_trace=False)
    assert rope.rope_state == 0  # nothing switched
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("kind", list(MODULES))
def test_jit_trace_of_a_fixed_rule_serves_other_positions(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Rotate(MODULES[kind](32, 64)), (randn(1, 2, 8, 32, seed=2), torch.arange(8)[None]),
                                 check_trace=False)
    q, ids = randn(1, 2, 12, 32, seed=3), torch.arange(40, 52)[None]
    torch.testing.assert_close(traced(q, ids).double(), rope_reference(q, positions=ids), rtol=0, atol=2e-6)


class CacheStep(torch.nn.Module):
    def __init__(self, rope, cache):
        super().__init__()
        # Out of the module tree: export refuses a C++ module's child by name (its buffers cannot be swapped).
        self.parts = [rope, cache]

    def forward(self, q, k, v):
        rope, cache = self.parts
        return rope.forward_with_cache(q, k, v, cache)[0]


def _trace(how, module, args):
    if how == "jit.trace":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.trace(module, args, check_trace=False)
    return torch.export.export(module, args, strict=False)


@pytest.mark.parametrize("how", ["jit.trace", "export"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_forward_with_cache_is_refused_under_a_trace_and_leaves_the_cache(kind, how):
    rope, cache = MODULES[kind](32, 64), rotary.KVCache(1, 2, 16, 32)
    rope.forward_with_cache(randn(1, 2, 3, 32, seed=4), randn(1, 2, 3, 32, seed=5), randn(1, 2, 3, 32, seed=6), cache)
    before = [t.clone() for t in cache.buffers()]
    args = tuple(randn(1, 2, 1, 32, seed=s) for s in (7, 8, 9))
    kept = [a.clone() for a in args]
    with pytest.raises(RuntimeError, match=r"forward_with_cache: it reads and advances the KVCache's length on the "
                                           r"host, which torch.jit.trace, torch.export and a FakeTensorMode would keep as a "
                                           r"constant"):
        _trace(how, CacheStep(rope, cache), args)
    assert cache.length == 3 and all(torch.equal(a, b) for a, b in zip(before, cache.buffers()))
    assert all(torch.equal(a, b) for a, b in zip(args, kept))


@pytest.mark.parametrize("how", ["jit.trace", "export"])
def test_keys_values_is_refused_under_a_trace(how):
    rope, cache = rotary.RotaryEmbedding(32, 64), rotary.KVCache(1, 2, 16, 32)
    rope.forward_with_cache(randn(1, 2, 3, 32, seed=20), randn(1, 2, 3, 32, seed=21), randn(1, 2, 3, 32, seed=22), cache)

    class Attend(torch.nn.Module):
        def forward(self, q):
            keys, values = cache.keys_values()
            return torch.softmax(q @ keys.transpose(-1, -2), -1) @ values

    with pytest.raises(RuntimeError, match=r"KVCache.keys_values: it reads the cache's length on the host, which "
                                           r"torch.jit.trace, torch.export and a FakeTensorMode would keep as a constant"):
        _trace(how, Attend(), (randn(1, 2, 1, 32, seed=23),))
    assert cache.length == 3


def test_an_export_on_another_thread_leaves_eager_calls_alone():
    """torch.compiler.is_exporting() is process-wide: an eager decode step
    on this thread while another thread exported was refused."""
    import threading

    started, release = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            started.set()
            release.wait(30)
            return x + 1

    worker = threading.Thread(target=lambda: torch.export.export(Slow(), (torch.randn(2),), strict=False))
    worker.start()
    try:
        assert started.wait(30) and torch.compiler.is_exporting()
        rope, cache = rotary.RotaryEmbedding(32, 64, scaling=DYNAMIC), rotary.KVCache(1, 2, 64, 32)
        q, k, v = (randn(1, 2, 20, 32, seed=s) for s in (24, 25, 26))
        want_q = rotary.RotaryEmbedding(32, 64, scaling=DYNAMIC)(q, k)[0]
        got_q = rope.forward_with_cache(q.clone(), k.clone(), v, cache)[0]
        assert cache.length == 20 and rope.rope_state == 20 and torch.equal(got_q, want_q)
        assert len(cache.keys_values()[0][0, 0]) == 20
    finally:
        release.set()
        worker.join()


@pytest.mark.parametrize("kind", list(MODULES))
def test_fx_symbolic_trace_is_refused_by_name_and_a_leaf_traces(kind):
    block = Rotate(MODULES[kind](32, 64))
    with pytest.raises(TypeError, match=rf"rotary.{MODULES[kind].__name__} cannot be traced by "
                                        r"torch.fx.symbolic_trace .* keep it a leaf module"):
        torch.fx.symbolic_trace(block)

    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, tuple(MODULES.values())) or super().is_leaf_module(m, name)

    graph = torch.fx.GraphModule(block, Leaf().trace(block))
    q, ids = randn(1, 2, 5, 32, seed=13), torch.arange(9, 14)[None]
    torch.testing.assert_close(graph(q, ids).double(), rope_reference(q, positions=ids), rtol=0, atol=2e-6)


def test_a_patched_models_host_driven_rule_is_refused_under_export():
    transformers = pytest.importorskip("transformers")
    from rotary.integrations.transformers import apply_rotary_to_model

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    apply_rotary_to_model(model)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, pos):
            return self.m(input_ids=ids, position_ids=pos, use_cache=False).logits

    ids, pos = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(14)), torch.arange(40)[None]
    with pytest.raises(RuntimeError, match=r"reads max\(position_ids\) on the host once per forward pass to choose "
                                           r"its tables, which torch.jit.trace and torch.export would keep"):
        torch.export.export(Logits(model), (ids, pos), strict=False)
