"""The patch adds no torch.compile graph break, for each form of the
patched rotation function: GPT-J's one-tensor form (codegen), complex
freqs_cis (deepseek_v2), q and k rotated apart (gemma3n_text), whole heads'
trailing spans and the (cos, -sin) inverse (deepseek_v4), packed qkv with
partial rotary (phi3), fused q/k norms (qwen3) and M-RoPE (qwen2_vl).
``python -m rotary_testing.hf_graph_breaks`` runs every served family."""

import pytest

pytest.importorskip("transformers")

from rotary_testing import hf_graph_breaks, hf_sweep  # noqa: E402

FAMILIES = ["codegen", "deepseek_v2", "deepseek_v4", "gemma3n_text", "phi3", "qwen3", "qwen2_vl"]


@pytest.fixture(scope="module")
def families():
    return hf_sweep.swept_families()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_patch_adds_no_graph_break(model_type, families):
    line, worse = hf_graph_breaks.check(model_type, families[model_type])
    assert not worse, line


def test_a_patched_model_compiles_once():
    """Three identical calls of a compiled patched model (fused q/k norms)
    make one graph. Run on a fresh thread: the deferred norms' per-thread
    state once came into being inside the first compiled call, and cost a
    recompile."""
    import threading

    import torch
    from torch._dynamo.utils import counters

    from rotary.integrations.transformers import rotary_patched

    model = hf_sweep.tiny_model("qwen3", "Qwen3ForCausalLM").eval()
    ids = torch.randint(3, hf_sweep.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    graphs, errors = [], []

    def body():
        try:
            counters.clear()
            torch._dynamo.reset()
            with rotary_patched(model), torch.no_grad():
                assert model._rotary_integration_state.norms
                f = torch.compile(lambda i: model(input_ids=i, use_cache=False).logits, backend="eager",
                                  fullgraph=True)
                for _ in range(3):
                    f(ids)
            graphs.append(counters["stats"].get("unique_graphs"))
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
        finally:
            torch._dynamo.reset()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    assert graphs == [1]


def test_a_host_driven_rule_breaks_the_graph_in_rotary_words():
    """A dynamic rule reads max(position_ids) on the host (docs/transformers.md,
    Limits): under fullgraph=True Dynamo named a skipped pybind function; the
    patched forward breaks the graph itself, saying why and the way out."""
    import torch

    from rotary.integrations.transformers import rotary_patched

    model = hf_sweep.tiny_model("llama", "LlamaForCausalLM").eval()
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    ids = torch.randint(3, hf_sweep.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        with rotary_patched(model), torch.no_grad():
            with pytest.raises(torch._dynamo.exc.Unsupported, match=r"rotary: the patched model's dynamic or longrope "
                                                                    r"rule reads max\(position_ids\) on the host"):
                torch.compile(lambda i: model(input_ids=i).logits, backend="eager", fullgraph=True)(ids)
    finally:
        torch._dynamo.reset()


def test_a_model_patched_on_meta_names_the_first_compiled_build():
    """Patched on the meta device, the table is built in C++ on the first
    forward (docs/transformers.md, Limits): under fullgraph=True Dynamo said it
    could not trace RopeTables.state_of. The break names the way out; without
    fullgraph the compiled model runs, and after one forward it traces whole."""
    import torch

    from rotary.integrations.transformers import apply_rotary_to_model, unpatch

    ref = hf_sweep.tiny_model("llama", "LlamaForCausalLM").eval()
    ids = torch.randint(3, hf_sweep.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = type(ref)(ref.config).eval()
    apply_rotary_to_model(model)
    apply_rotary_to_model(ref)
    torch._dynamo.reset()
    try:
        model.to_empty(device="cpu")
        model.load_state_dict(ref.state_dict())
        with torch.no_grad():
            with pytest.raises(torch._dynamo.exc.Unsupported, match=r"rotary: this model was patched on the meta "
                                                                    r"device.*run one eager forward pass first"):
                torch.compile(lambda i: model(input_ids=i).logits, backend="eager", fullgraph=True)(ids)
            torch._dynamo.reset()
            got = torch.compile(lambda i: model(input_ids=i).logits, backend="eager")(ids)
            assert torch.equal(got, ref(ids).logits)
            torch._dynamo.reset()
            full = torch.compile(lambda i: model(input_ids=i).logits, backend="eager", fullgraph=True)(ids)
            assert torch.equal(full, got)
    finally:
        torch._dynamo.reset()
        unpatch(model)
        unpatch(ref)
