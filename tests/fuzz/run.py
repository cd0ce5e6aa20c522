"""Run the fuzzer: ``PYTHONPATH=python:tests python -m fuzz.run [--cases N] [--seed S]``
(``make fuzz`` does so).

Cases S .. S+N-1 (plus the regression cases) run in child processes of
``--batch`` cases each; a child that dies (a signal, an abort) is reported
as a crash of the case it had started, and the rest of its batch reruns in a
new child. Every case is reproducible alone: ``--items 1234`` (a random
case) or ``--items r5`` (regression 5). Exit status 1 when anything was found.

Defaults come from the environment: ROTARY_FUZZ_CASES (300), ROTARY_FUZZ_SEED
(0), ROTARY_FUZZ_DEVICE (cpu; "cuda" runs the op cases on the GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import traceback

# Share of random cases per family (the op cases dominate: five entry points).
FAMILIES = [("op", 30), ("kv", 14), ("rotary_offset", 5), ("pair_axes", 6), ("freqs_real", 4), ("views", 7),
            ("index_dtypes", 7), ("scalars", 5), ("module", 8), ("module_options", 6), ("kv_module", 4), ("hf", 4),
            ("state", 4), ("scheme", 3), ("concurrent", 3), ("norm", 6), ("cos_sin", 4)]


def _schedule():
    """One cycle of families, each as often as its share, spread evenly: case
    seed picks SCHEDULE[seed % len]; any run of len(SCHEDULE) cases (the
    smoke run's 300 included) runs every family."""
    total, credit, out = sum(w for _, w in FAMILIES), {f: 0 for f, _ in FAMILIES}, []
    for _ in range(total):
        for f, w in FAMILIES:
            credit[f] += w
        best = max(credit, key=lambda f: credit[f])
        credit[best] -= total
        out.append(best)
    return out


SCHEDULE = _schedule()


def family_of(seed: int) -> str:
    return SCHEDULE[seed % len(SCHEDULE)]


def run_item(item: str):
    """-> (kind, status, detail); status is accepted / refused / finding."""
    from fuzz import arg_cases, cos_sin_cases, kv_cases, module_cases, norm_cases, op_cases, regressions
    from fuzz.common import Finding, current

    current["kind"] = "?"
    try:
        if item.startswith("r"):
            kind, outcome = regressions.run(int(item[1:]))
        else:
            seed = int(item)
            fn = {"op": op_cases.run, "kv": kv_cases.run_kv, "rotary_offset": arg_cases.run_rotary_offset,
                  "pair_axes": arg_cases.run_pair_axes, "freqs_real": arg_cases.run_freqs_real,
                  "views": arg_cases.run_views, "index_dtypes": arg_cases.run_index_dtypes,
                  "scalars": arg_cases.run_scalars, "module": module_cases.run_module,
                  "module_options": module_cases.run_module_options, "kv_module": kv_cases.run_kv_module,
                  "hf": module_cases.run_hf, "state": module_cases.run_state, "scheme": module_cases.run_scheme,
                  "concurrent": module_cases.run_concurrent, "norm": norm_cases.run_norm,
                  "cos_sin": cos_sin_cases.run_cos_sin}[family_of(seed)]
            kind, outcome = fn(seed)
    except Finding as f:
        return current["kind"], "finding", str(f)
    except Exception:  # noqa: BLE001 - a bug of the case itself is reported, never hidden
        return current["kind"], "finding", "fuzzer error: " + traceback.format_exc(limit=3).replace("\n", " | ")[-600:]
    status = "refused" if outcome.startswith("refused") else "accepted"
    return kind, status, outcome


def child(items):
    import torch

    torch.set_num_threads(1)
    for item in items:
        print("START " + item, flush=True)
        t0 = time.perf_counter()
        kind, status, detail = run_item(item)
        fam = "regression" if item.startswith("r") else family_of(int(item))
        r = {"item": item, "kind": kind, "family": fam, "status": status, "detail": detail,
             "s": time.perf_counter() - t0}
        print("RESULT " + json.dumps(r), flush=True)


def run_batch(items, timeout, env):
    """Yields result dicts; a crash or hang becomes a finding of its case."""
    pending = list(items)
    while pending:
        cmd = [sys.executable, "-m", "fuzz.run", "--child", "--items", ",".join(pending)]
        started, done = None, set()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            out, rc, why = proc.stdout, proc.returncode, f"exit status {proc.returncode}"
            if rc < 0:
                why = f"signal {-rc}"
            err = proc.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, why, err = -1, f"no result within {timeout} s (hang?)", ""
        for line in out.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                done.add(r["item"])
                yield r
        rest = [i for i in pending if i not in done]
        if not rest:
            return
        if rc == 0 and started is None:
            raise SystemExit(f"fuzz child produced no results: {err[-2000:]}")
        crashed = started if started in rest else rest[0]
        tail = " | ".join(err.strip().splitlines()[-3:])[-400:]
        fam = "regression" if crashed.startswith("r") else family_of(int(crashed))
        yield {"item": crashed, "kind": "crash", "family": fam, "status": "finding",
               "detail": f"the child died ({why}) in case {crashed}: {tail}"}
        pending = [i for i in rest if i != crashed]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=int(os.environ.get("ROTARY_FUZZ_CASES", "300")))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("ROTARY_FUZZ_SEED", "0")))
    ap.add_argument("--batch", type=int, default=250, help="cases per child process")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    ap.add_argument("--no-regressions", action="store_true")
    ap.add_argument("--items", help="comma-separated case ids to run (r<k> for regression k)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write every result to this file (JSON lines)")
    ap.add_argument("--require-coverage", action="store_true",
                    help="exit 1 unless every family ran at least one case")
    args = ap.parse_args(argv)
    if args.child:
        child(args.items.split(","))
        return 0

    from fuzz import regressions

    if args.items:
        items = args.items.split(",")
    else:
        items = [] if args.no_regressions else [f"r{i}" for i in range(len(regressions.CASES))]
        items += [str(s) for s in range(args.seed, args.seed + args.cases)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    counts = collections.defaultdict(collections.Counter)
    seconds = collections.Counter()
    findings = []
    families = collections.Counter()
    t0 = time.time()
    sink = open(args.json, "w") if args.json else None
    for start in range(0, len(items), args.batch):
        for r in run_batch(items[start : start + args.batch], args.timeout, env):
            category = r["kind"].split(":")[0] if r["kind"].startswith("regression") else r["kind"]
            counts[category][r["status"]] += 1
            families[r.get("family", "?")] += 1
            seconds[category] += r.get("s", 0.0)
            if r["status"] == "finding":
                findings.append(r)
            if sink:
                sink.write(json.dumps(r) + "\n")
    if sink:
        sink.close()
    width = max([len(k) for k in counts] + [8])
    print(f"{'category':<{width}}  accepted  refused  finding  seconds")
    for k in sorted(counts):
        c = counts[k]
        print(f"{k:<{width}}  {c['accepted']:>8}  {c['refused']:>7}  {c['finding']:>7}  {seconds[k]:>7.1f}")
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    print(f"{'total':<{width}}  {total['accepted']:>8}  {total['refused']:>7}  {total['finding']:>7}"
          f"   ({len(items)} cases in {time.time() - t0:.0f} s)")
    print("families: " + ", ".join(f"{f} {families[f]}" for f, _ in FAMILIES))
    missing = [f for f, _ in FAMILIES if not families[f]]
    if missing:
        print("UNCOVERED families: " + ", ".join(missing))
    for r in findings:
        print(f"FINDING [{r['kind']}] case {r['item']}: {r['detail']}")
    return 1 if findings or (args.require_coverage and missing) else 0


if __name__ == "__main__":
    sys.exit(main())
