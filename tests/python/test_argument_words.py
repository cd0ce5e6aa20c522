"""Arguments a trial found read the wrong way or answered in another layer's
words: flags read by truthiness ("no" let a refused rotation through), tensor
arguments that reached pybind's or Python's own errors, a non-model given to
the transformers patch, and a wrong value echoed whole (a 22 MB message)."""

import numpy as np
import pytest
import torch

import rotary
from rotary.hf import rope_kwargs_from_hf_config

NANOCHAT = {"model_type": "nanochat", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 32}


@pytest.mark.parametrize("flag", ["no", "False", 0, 1, None, np.bool_(True)])
def test_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=rf"from_hf_config: allow_inverse must be a bool, got {flag!r}"):
        rope_kwargs_from_hf_config(NANOCHAT, allow_inverse=flag)
    with pytest.raises(TypeError, match=rf"from_hf_config: allow_unverified must be a bool, got {flag!r}"):
        rotary.RotaryEmbedding.from_hf_config({"model_type": "my_new_llama", "hidden_size": 64,
                                               "num_attention_heads": 4}, allow_unverified=flag)
    with pytest.raises(TypeError, match=rf"RopeScaling\.from_dict: strict must be a bool, got {flag!r}"):
        rotary.RopeScaling.from_dict({"rope_type": "linear", "factor": 2.0, "fctor": 4.0}, strict=flag)
    # The gate itself: a negative-angle family is refused unless allow_inverse=True.
    with pytest.raises(ValueError, match="negative"):
        rope_kwargs_from_hf_config(NANOCHAT)


def test_the_transformers_patch_takes_a_model():
    from rotary.integrations.transformers import apply_rotary_to_model, unpatch

    for call, who in ((lambda: apply_rotary_to_model(None), "apply_rotary_to_model"), (lambda: unpatch(1), "unpatch")):
        with pytest.raises(TypeError, match=rf"rotary: {who} takes a transformers model \(an nn.Module\), got"):
            call()
    with pytest.raises(TypeError, match="apply_rotary_to_model: fuse_qk_norm must be a bool, got 'False'"):
        apply_rotary_to_model(torch.nn.Linear(2, 2), fuse_qk_norm="False")


def test_tensor_arguments_are_named():
    f, q = rotary.freqs_table(8, 16), torch.randn(1, 2, 3, 8)
    cases = ((lambda: rotary.apply_rope_cos_sin(q, q, torch.ones(3, 8), [1, 2]),
              "apply_rope_cos_sin: sin must be a tensor or None, got list [1, 2]"),
             (lambda: rotary.apply_rope(q, f, positions=[1, 2]),
              "apply_rope: positions must be a tensor or None, got list [1, 2]"),
             (lambda: rotary.apply_rope(q, f, position_ids=np.zeros(3)),
              "apply_rope: position_ids must be a tensor or None, got ndarray of shape (3,)"))
    for call, words in cases:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == words


def test_a_long_wrong_value_is_shown_by_its_length():
    big = torch.randn(64, 8, 256, 8).tolist()
    rope = rotary.RotaryEmbedding(8, 16)
    calls = {"apply_rope: x": lambda: rotary.apply_rope(big, rotary.freqs_table(8, 16)),
             "RotaryEmbedding: q (or x)": lambda: rope(big),
             "RotaryEmbedding: k": lambda: rope(torch.randn(1, 2, 3, 8), big)}
    for who, call in calls.items():
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value).startswith(who) and str(e.value).endswith("got list of length 64"), str(e.value)[:300]
