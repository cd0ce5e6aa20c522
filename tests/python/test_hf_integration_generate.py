"""rotary.integrations.transformers beyond single forward calls: greedy
generate with a KV cache (left-padded batch, with and without the cache, and
decoding across max_position_embeddings with a 64-row table), and
torch.compile(fullgraph=True) tracing of a patched model. Split from
test_hf_integration.py, whose tiny models, inputs and tolerances (stated in
its docstring) these tests use.
"""

import pytest
import torch

pytest.importorskip("transformers")
from rotary.integrations import rotary_patched  # noqa: E402
from test_hf_integration import (  # noqa: E402,F401 - the autouse fixtures apply here too
    CASE_IDS,
    CASES,
    FP32_ATOL,
    FP32_ATOL_FAR,
    MAX_POS,
    VOCAB,
    _nothing_left_patched,
    _one_thread,
    inputs,
    make_model,
)

pytestmark = pytest.mark.filterwarnings("ignore")


# ----------------------------------------------------------------------------
# Generation with a KV cache
# ----------------------------------------------------------------------------
def _generate(model, ids, mask, use_cache=True, n=8):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             use_cache=use_cache, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, [x.float() for x in out.logits]


@pytest.mark.parametrize("family,rope,extra", [CASES[i] for i in (0, 2, 4, 6, 8, 9)],
                         ids=[CASE_IDS[i] for i in (0, 2, 4, 6, 8, 9)])
def test_greedy_generate_with_cache(family, rope, extra):
    model = make_model(family, rope, extra)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding
    ref_seq, ref_logits = _generate(model, ids, mask)
    with rotary_patched(model):
        seq, logits = _generate(model, ids, mask)
        nocache_seq, nocache_logits = _generate(model, ids, mask, use_cache=False)
    assert torch.equal(seq, ref_seq)
    assert torch.equal(nocache_seq, seq)
    for step, (r, o, n) in enumerate(zip(ref_logits, logits, nocache_logits)):
        torch.testing.assert_close(o, r, atol=FP32_ATOL, rtol=0.0, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(n, o, atol=FP32_ATOL, rtol=0.0, msg=lambda m: f"step {step} (no cache): {m}")


def test_generate_past_max_position_embeddings():
    """Decode with the cache across max_position_embeddings (yarn): positions
    past the table rows are computed from inv_freq."""
    model = make_model("llama", "yarn")
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefix = torch.randint(3, VOCAB, (1, MAX_POS - 24), generator=torch.Generator().manual_seed(3))
        ids = torch.cat([prefix, ids], 1)
    ref_seq, ref_logits = _generate(model, ids, torch.ones_like(ids), n=20)
    with rotary_patched(model, max_seq_len=64):  # table rows end far before the sequence
        seq, logits = _generate(model, ids, torch.ones_like(ids), n=20)
    assert seq.shape[1] > MAX_POS and torch.equal(seq, ref_seq)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=FP32_ATOL_FAR, rtol=0.0)


def test_compile_fullgraph():
    """A patched model with a static rule traces into one graph: the
    positions handle and our op go through dynamo without a break (the eager
    backend keeps this fast; inductor is exercised by the op's own tests)."""
    model = make_model("llama", "yarn")
    ids = inputs()[0][0]
    with rotary_patched(model), torch.no_grad():
        eager = model(input_ids=ids).logits
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids).logits
        finally:
            torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=0.0)
