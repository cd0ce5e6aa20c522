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
import copy
import inspect
import pathlib
import re
import sys
import warnings

import torch

from rotary._hf_refusals import ROTARY_CODE

from .hf_rotations import ROT_TOL, rotation_diff, rotation_outputs
from .hf_tiny import MAMBA, VL_FAMILIES, VOCAB, _config_of, draw_zero_parameters, tiny_model, tiny_vl  # noqa: F401
from .rope_testing import gen

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "python" / "rotary" / "integrations" / "hf_support.py"
DOC = ROOT / "docs" / "transformers.md"
DOC_BEGIN, DOC_END = "<!-- hf-sweep: begin -->", "<!-- hf-sweep: end -->"

SEQ, NEW_TOKENS = 12, 4
TOL = 2e-5  # fp32 logits, patched vs unpatched (one rounding of q and k apart)




def causal_lm_classes():
    """{model_type: causal-LM class name}: the causal-LM auto mapping, and the
    *ForCausalLM classes transformers exports outside it (Mistral 4's)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    mapped = set(out.values())
    for name in dir(transformers):
        if name.endswith("ForCausalLM") and not name.startswith("Auto") and name not in mapped:
            try:
                model_type = getattr(getattr(transformers, name).config_class, "model_type", None)
            except Exception:  # not importable here (a missing optional dependency)
                continue
            if model_type and model_type not in out:
                out[model_type] = name
    return out


def rotary_families():
    """{model_type: causal-LM class name} of the families whose modeling code
    builds or applies rotary embeddings."""
    import transformers

    out = {}
    for model_type, cls_name in sorted(causal_lm_classes().items()):
        try:
            src = inspect.getsource(sys.modules[getattr(transformers, cls_name).__module__])
        except Exception:  # not importable here (a missing optional dependency)
            out[model_type] = cls_name
            continue
        if ROTARY_CODE.search(src):
            out[model_type] = cls_name
    for model_type, cls_name in list(out.items()):  # a composite's causal LM is its text model: swept as that
        text = getattr(getattr(getattr(transformers, cls_name, None), "config_class", None), "model_type", None)
        if text and text != model_type and text not in out and text in _composite_parts(model_type):
            out[text] = cls_name
    return dict(sorted(out.items()))


def swept_families():
    """{model_type: class name} of every family the sweep runs: the rotary
    causal LMs and the multimodal-RoPE models."""
    return {**rotary_families(), **VL_FAMILIES}


def _composite_parts(model_type):
    try:
        config = _config_of(model_type)
    except Exception:
        return ()
    return {getattr(getattr(config, n, None), "model_type", None) for n in getattr(config, "sub_configs", {})}


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


class _RotaryOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the rotary ops a forward runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "rotary"
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def _rotary_calls(model, kw):
    with _RotaryOps() as mode:
        model(**kw)
    return mode.count


class SweepResults(dict):
    """{model_type: reason or None}; .fused: the families whose patched model
    with fused q/k norms (fuse_qk_norm) also equals the unpatched one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = set()
        self.bf16 = {}  # family: (patched, unpatched) bf16 error against fp32


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


# Families also checked in bf16: one per pairing, span and table kind.
BF16 = frozenset({"llama", "qwen3", "gemma3_text", "gptj", "glm4", "phi3", "deepseek_v3", "llama4_text", "olmo2",
                  "deepseek_v4"})


@torch.no_grad()
def check_bf16(model, kw, ref32):
    """(patched, unpatched) mean |logit - fp32 logit| of the model in bf16:
    rotary rounds q and k once where transformers rounds each product, so
    its error must not exceed transformers' own by more than chance (1.5x)."""
    from rotary.integrations.transformers import _patch, unpatch

    model = copy.deepcopy(model).to(torch.bfloat16)  # a copy: the fp32 weights stay exact
    theirs = (model(**kw).logits.double() - ref32.double()).abs().mean().item()
    _patch(model)
    try:
        ours = (model(**kw).logits.double() - ref32.double()).abs().mean().item()
    finally:
        unpatch(model)
    return ours, theirs


def check_family(model_type, cls_name, bf16=None):
    """(None, max logit difference, fused) when the family passes, else
    (reason, None, False); fused: it passes with fused q/k norms too. With a
    dict bf16, a family of BF16 is also checked in bf16 (its errors stored
    there)."""
    from rotary.integrations.transformers import _patch, unpatch

    try:
        model, calls, prompt = _calls(model_type, cls_name)
    except Exception as e:
        return f"the sweep builds no tiny model ({type(e).__name__}: {_short(e)})", None, False
    built = getattr(model.config, "model_type", model_type)
    if built != model_type:  # AutoModelForCausalLM gives its text model, not one of this model_type
        return (f"its causal LM is its text model, model_type {built!r} (swept under that name); its multimodal "
                f"model is not swept"), None, False
    try:
        ref = _outputs(model, calls, prompt)
        if len(calls) > 1 and torch.equal(ref[0][0], ref[0][1]):
            # Logits that do not depend on position prove nothing (Zaya's
            # qk_norm temperature starts at 0): draw the zero parameters.
            draw_zero_parameters(model)
            ref = _outputs(model, calls, prompt)
        flat = len(calls) > 1 and torch.equal(ref[0][0], ref[0][1])
        rotated = rotation_outputs(model, calls[-1])
    except Exception as e:
        return f"the sweep builds no tiny model ({type(e).__name__}: {_short(e)})", None, False
    try:
        _patch(model)
    except Exception as e:
        return f"{_short(e)}", None, False
    if flat:
        unpatch(model)
        return "its tiny model's logits do not depend on position (equal logits would prove nothing)", None, False
    try:
        got = _outputs(model, calls, prompt)
        served = _rotary_calls(model, calls[0])
        rotated_by_us = rotation_outputs(model, calls[-1])
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
    if served == 0 or served < len(rotated):  # equal logits prove nothing where transformers' code still rotates
        return (f"the patched model rotates through rotary {served} times a forward, the unpatched one "
                f"{len(rotated)} times", None, False)
    if not rotation_diff(rotated_by_us, rotated) <= ROT_TOL:
        return (f"a patched rotation differs from transformers' by {rotation_diff(rotated_by_us, rotated):.2g} "
                f"(relative; the logits hid it)", None, False)
    if bf16 is not None and model_type in BF16:
        ours, theirs = check_bf16(model, calls[0], ref[0][0])
        if not ours <= 1.5 * theirs:
            return (f"bf16 logits are {ours:.2g} from fp32 (mean), transformers' own bf16 forward {theirs:.2g}",
                    None, False)
        bf16[model_type] = (ours, theirs)
    return None, diff, check_fused(model, calls, prompt, ref)


def _short(e, n=160):
    text = " ".join(str(e).replace("from_hf_config: ", "").replace("rotary: ", "").split())
    text = re.sub(r"^model_type '[^']*' is not supported: ", "", text)  # the table names the family
    return text if len(text) <= n else text[: n - 3] + "..."


def sweep(verbose=False):
    """SweepResults over rotary_families()."""
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        out = SweepResults()
        for model_type, cls_name in swept_families().items():
            out[model_type], diff, fused = check_family(model_type, cls_name, out.bf16)
            if fused:
                out.fused.add(model_type)
            if verbose:
                ok = f"ok {diff:.1e}{' (fused q/k norm too)' if fused else ''}" if diff is not None else out[model_type]
                if model_type in out.bf16:
                    ok += " bf16 %.2g vs transformers' %.2g" % out.bf16[model_type]
                print(f"{model_type:28s} {ok}")
        return out
    finally:
        torch.set_num_threads(threads)


_KINDS = (("its causal LM is its text model", "composite: its causal LM is a text model swept under its own name"),
          ("the sweep builds no tiny model", "no tiny model builds"),
          ("is not supported", "a rotation rotary does not serve"),
          ("has no rotary embedding module", "no rotary module to patch"))


def _reasons(refused):
    """[(kind of reason, count)] of the refused families."""
    counts = {}
    for _, why in refused:
        kind = next((k for prefix, k in _KINDS if prefix in why), "other")
        counts[kind] = counts.get(kind, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


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
             f"Also checked in bf16 (patched logits no further from the fp32 ones than 1.5x transformers' own bf16 "
             f"forward, mean): " + ", ".join(f"`{k}`" for k in sorted(results.bf16)) + ".", "",
             "Refused, by reason: " + "; ".join(f"{n} {why}" for why, n in _reasons(refused)) + ".", "",
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
