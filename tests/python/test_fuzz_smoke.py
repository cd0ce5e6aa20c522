"""The fuzzer's smoke run, as part of the suite: the regression cases of
tests/fuzz plus the fixed random cases 0 .. 299, in child processes (a crash
names its case). Every accepted call is checked against the float64
reference, every refused one for untouched inputs and module state; one
finding fails the test and is printed with the command that replays it.
Cases are dealt round-robin over the families (tests/fuzz/run.py SCHEDULE),
so 300 cases run every one of them; --require-coverage fails otherwise."""

import os
import subprocess
import sys



def test_schedule_covers_every_family_in_300_cases():
    from fuzz.run import FAMILIES, family_of

    assert {family_of(s) for s in range(300)} == {f for f, _ in FAMILIES}


def test_fuzz_smoke():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTARY_FUZZ_")}
    cmd = [sys.executable, "-m", "fuzz.run", "--cases", "300", "--seed", "0", "--batch", "400", "--require-coverage"]
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this run's rotary and tests/
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    print(proc.stdout)
    replay = "replay one case with: PYTHONPATH=python:tests python -m fuzz.run --items <case>"
    assert "UNCOVERED" not in proc.stdout, proc.stdout[-4000:]
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}\n{replay}"
