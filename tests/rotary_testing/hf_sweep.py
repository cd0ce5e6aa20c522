"""The Hugging Face sweep: every causal-LM family of the installed transformers
whose modeling code uses rotary embeddings, as a tiny random-weight model,
unpatched vs patched. A family is supported exactly when it passes; every
other one is refused by name with the reason found here.

    PYTHONPATH=python:tests python -m rotary_testing.hf_sweep --write

rewrites the generated table (python/rotary/integrations/hf_support.py) and
its copy in docs/transformers.md; tests/python/test_hf_sweep.py reruns the
sweep and fails when either differs from what it finds.
"""

import argparse
import importlib
import inspect
import pathlib
import sys
import warnings

import torch

from .rope_testing import gen

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "python" / "rotary" / "integrations" / "hf_support.py"
DOC = ROOT / "docs" / "transformers.md"
DOC_BEGIN, DOC_END = "<!-- hf-sweep: begin -->", "<!-- hf-sweep: end -->"

VOCAB, SEQ, NEW_TOKENS = 128, 12, 4
MAX_PARAMS = 3_000_000
TOL = 2e-5  # fp32 logits, patched vs unpatched (one rounding of q and k apart)

# Small everything: each field a family's config has (attribute_map sends the
# standard names to its own spelling).
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, rotary_dim=8,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, moe_topk=2,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # hybrids: an attention layer among the two (the one RoPE is tested on)
    attn_layer_period=2, attn_layer_offset=1, attn_layer_indices=[1],
)
# Mamba mixers sized to the tiny hidden size: a second try, for the hybrids
# whose first build fails (others, e.g. Falcon-H1, build with their own).
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_n_groups=1, mamba_d_state=16)


def rotary_families():
    """{model_type: causal-LM class name} of the families whose modeling code
    builds or applies rotary embeddings."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        import transformers

        try:
            src = inspect.getsource(sys.modules[getattr(transformers, cls_name).__module__])
        except Exception:  # not importable here (a missing optional dependency)
            out[model_type] = cls_name
            continue
        if "rotary_emb" in src or "RotaryEmbedding" in src or "apply_rotary" in src:
            out[model_type] = cls_name
    return out


# A family whose defaults need a wider head than TINY's: Qwen3.5's M-RoPE
# sections (11, 11, 10) cover 64 rotated dims, a quarter of the head.
TINY_FOR = {"qwen3_5_text": dict(head_dim=256), "qwen3_5_moe_text": dict(head_dim=256)}


def _shrink(config, extra=None):
    for name, value in {**TINY, **TINY_FOR.get(config.model_type, {}), **(extra or {})}.items():
        if name in getattr(config, "attribute_map", {}) or hasattr(config, name):  # only fields it has
            try:
                setattr(config, name, value)
            except Exception:
                pass
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "head_dim", None):
        config.head_dim = config.qk_rope_head_dim  # MLA: the rotary module's width is the rope part
    if getattr(config, "kv_lora_rank", None):
        config.num_key_value_heads = config.num_attention_heads  # MLA: k has every head
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        kinds = list(dict.fromkeys(types))  # one layer of each kind, at least two layers
        if all(k in ("linear_attention", "mamba") for k in kinds):
            kinds.append("full_attention")  # a hybrid's attention layer, where RoPE is
        kinds = kinds if len(kinds) > 1 else kinds * 2
        try:
            config.layer_types = kinds
            config.num_hidden_layers = len(kinds)
        except Exception:
            pass
    config._attn_implementation = "eager"
    return config


def _config_of(model_type):
    """The family's default config."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def tiny_model(model_type, cls_name, extra=None):
    import transformers
    from transformers import AutoConfig

    config = _shrink(AutoConfig.for_model(model_type), extra)
    cls = getattr(transformers, cls_name)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{n} parameters with the tiny settings (a composite or unusual config)")
    torch.manual_seed(0)
    return cls(config).eval()


# Multimodal-RoPE families, outside the causal-LM mapping: a hand-built tiny
# model each (a vision tower too), swept like the rest.
VL_FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def tiny_vl(family):
    """A random-weight multimodal-RoPE model and inputs with an image (so
    get_rope_index builds image-grid positions)."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen2_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        cfg = transformers.Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2,
                                                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, mlp_ratio=2),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
    elif family == "qwen2_5_vl":
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                 in_channels=3, out_hidden_size=64, window_size=8,
                                                 fullatt_block_indexes=[0]),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                   "rope_theta": 10000.0}
        text["head_dim"] = 16
        cfg = transformers.Qwen3VLConfig(
            text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                 in_channels=3, out_hidden_size=64, num_position_embeddings=16,
                                                 deepstack_visual_indexes=[]),
            image_token_id=100, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
        model = transformers.Qwen3VLForConditionalGeneration(cfg)
    ids = torch.tensor([[5, 6, 102] + [100] * 4 + [103, 7, 8]])
    inputs = dict(input_ids=ids, pixel_values=torch.randn(16, 24, generator=gen(6)),
                  image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 100).long())
    return model.eval(), inputs


def _calls(model_type, cls_name):
    """(model, forward kwargs, generate kwargs): plain ids, and ids at shifted
    positions (rows 40.. and 7..); a multimodal model gets its image."""
    if model_type in VL_FAMILIES:
        model, inputs = tiny_vl(model_type)
        return model, [inputs], inputs
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=gen(1))
    try:
        model = tiny_model(model_type, cls_name)
        with torch.no_grad():
            model(input_ids=ids[:, :2])
    except Exception:
        if not any(hasattr(_config_of(model_type), name) for name in MAMBA):
            raise
        model = tiny_model(model_type, cls_name, MAMBA)
    pos = torch.arange(SEQ).expand(2, SEQ) + torch.tensor([[40], [7]])
    return model, [dict(input_ids=ids), dict(input_ids=ids, position_ids=pos)], dict(input_ids=ids[:1, :6])


@torch.no_grad()
def _outputs(model, calls, prompt):
    logits = [model(**kw).logits for kw in calls]
    tokens = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, pad_token_id=0)
    return logits, tokens


class SweepResults(dict):
    """{model_type: reason or None}; .fused: the families whose patched model
    with fused q/k norms (fuse_qk_norm) also equals the unpatched one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = set()


def _max_diff(got, ref):
    """The largest logit difference of two _outputs results."""
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(got[0], ref[0]))


def _matches(got, ref):
    diff = _max_diff(got, ref)
    return diff if diff <= TOL and torch.equal(got[1], ref[1]) else None


def check_fused(model, calls, prompt, ref):
    """Whether the model has q/k norms the patch fuses, and then still passes."""
    from rotary.integrations.transformers import _patch, unpatch

    try:
        _patch(model, fuse_qk_norm=True)
        if not model._rotary_integration_state.norms:
            return False
        return _matches(_outputs(model, calls, prompt), ref) is not None
    except Exception:
        return False
    finally:
        unpatch(model)


def check_family(model_type, cls_name):
    """(None, max logit difference, fused) when the family passes, else
    (reason, None, False); fused: it passes with fused q/k norms too."""
    from rotary.integrations.transformers import _patch, unpatch

    try:
        model, calls, prompt = _calls(model_type, cls_name)
        ref = _outputs(model, calls, prompt)
    except Exception as e:
        return f"the sweep builds no tiny model ({type(e).__name__}: {_short(e)})", None, False
    try:
        _patch(model)
    except Exception as e:
        return f"{_short(e)}", None, False
    try:
        got = _outputs(model, calls, prompt)
    except Exception as e:
        return f"the patched model fails ({type(e).__name__}: {_short(e)})", None, False
    finally:
        unpatch(model)
    diff = _max_diff(got, ref)
    if not diff <= TOL:
        return ("patched logits differ from the unpatched model's (its pairing or span is not the one rotary reads)",
                None, False)
    if not torch.equal(got[1], ref[1]):
        return "greedy decode with a KV cache differs", None, False
    return None, diff, check_fused(model, calls, prompt, ref)


def _short(e, n=160):
    text = " ".join(str(e).replace("from_hf_config: ", "").replace("rotary: ", "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def sweep(verbose=False):
    """SweepResults over rotary_families()."""
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        out = SweepResults()
        for model_type, cls_name in {**rotary_families(), **VL_FAMILIES}.items():
            out[model_type], diff, fused = check_family(model_type, cls_name)
            if fused:
                out.fused.add(model_type)
            if verbose:
                ok = f"ok {diff:.1e}{' (fused q/k norm too)' if fused else ''}" if diff is not None else out[model_type]
                print(f"{model_type:28s} {ok}")
        return out
    finally:
        torch.set_num_threads(threads)


def render_table(results):
    import transformers

    supported = sorted(k for k, v in results.items() if v is None)
    refused = sorted((k, v) for k, v in results.items() if v is not None)
    lines = [DOC_BEGIN, "",
             f"transformers {transformers.__version__}: {len(results)} causal-LM families with rotary embeddings, "
             f"**{len(supported)} supported**, {len(refused)} refused.", "",
             "Supported: " + ", ".join(f"`{k}`" for k in supported) + ".", "",
             f"Their q/k RMSNorm runs inside the rotation (`apply_qk_norm_rope`) for {len(results.fused)}: "
             + ", ".join(f"`{k}`" for k in sorted(results.fused)) + ".", "",
             "| refused family | why |", "| --- | --- |"]
    lines += [f"| `{k}` | {v.replace('|', '/')} |" for k, v in refused]
    return "\n".join(lines + ["", DOC_END])


def render_module(results):
    import transformers

    body = ["# Generated by tests/rotary_testing/hf_sweep.py (python -m rotary_testing.hf_sweep --write);",
            "# tests/python/test_hf_sweep.py fails when the sweep finds otherwise. Do not edit.",
            '"""The families the Hugging Face sweep found rotary serves, and why it refuses the rest."""', "",
            f"TRANSFORMERS_VERSION = {transformers.__version__!r}", "",
            "SUPPORTED = frozenset({"]
    body += [f"    {k!r}," for k in sorted(k for k, v in results.items() if v is None)]
    body += ["})", "", "# Supported families whose q/k norms fuse into the rotation (fuse_qk_norm's default).",
             "QK_NORM_FUSED = frozenset({"]
    body += [f"    {k!r}," for k in sorted(results.fused)]
    body += ["})", "", "REFUSED = {"]
    body += [f"    {k!r}: {v!r}," for k, v in sorted(results.items()) if v is not None]
    return "\n".join(body + ["}", ""])


def splice_doc(text, table):
    head, rest = text.split(DOC_BEGIN)
    _, tail = rest.split(DOC_END)
    return head + table + tail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite hf_support.py and the docs table")
    args = parser.parse_args()
    results = sweep(verbose=True)
    print(render_table(results))
    if args.write:
        TABLE.write_text(render_module(results))
        DOC.write_text(splice_doc(DOC.read_text(), render_table(results)))


if __name__ == "__main__":
    main()
