"""torch.compile graph breaks of every family the sweep serves, unpatched vs
patched (fused q/k norms where the sweep fuses them): the patch must add
none. One family takes 10-30 s (dynamo traces each forward twice), so the
whole list is a maintainer's check, not part of make test:

    PYTHONPATH=python:tests python -m rotary_testing.hf_graph_breaks [model_type ...]

Exit status 1 when a patched forward breaks more often than the unpatched one
or fails to trace.
"""

import sys
import warnings

import torch

from rotary.integrations import hf_support
from rotary.integrations.transformers import rotary_patched

from . import hf_sweep


def breaks(model, kw):
    """(graph breaks, their distinct first lines) of one no-grad forward."""
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(**kw)
    return ex.graph_break_count, sorted({str(b.reason).split("\n")[0][:160] for b in ex.break_reasons})


def check(model_type, cls_name):
    """A line for model_type, and whether the patch added a break."""
    model, calls, _ = hf_sweep._calls(model_type, cls_name)
    before, reasons = breaks(model, calls[0])
    with rotary_patched(model):
        after, patched_reasons = breaks(model, calls[0])
    line = f"{model_type}: {before} graph breaks unpatched, {after} patched"
    if after > before:
        line += f"; new: {sorted(set(patched_reasons) - set(reasons))}"
    return line, after > before


def main(argv):
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    families = hf_sweep.swept_families()
    failed = 0
    for model_type in argv or sorted(hf_support.SUPPORTED):
        try:
            line, worse = check(model_type, families[model_type])
        except Exception as e:  # a patched forward that does not trace at all
            line, worse = f"{model_type}: {type(e).__name__}: {hf_sweep._short(e)}", True
        failed += worse
        print(line, flush=True)
    print(f"{failed} families with breaks the patch added")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
