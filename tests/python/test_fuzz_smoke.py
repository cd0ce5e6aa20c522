"""The fuzzer's smoke run, as part of the suite: the regression cases of
tests/fuzz plus the fixed random cases 0 .. 299, in child processes (a crash
names its case). Every accepted call is checked against the float64
reference, every refused one for untouched inputs and module state; one
finding fails the test and is printed with the command that replays it."""

import os
import subprocess
import sys

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "run.py")


def test_fuzz_smoke():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTARY_FUZZ_")}
    cmd = [sys.executable, RUN, "--cases", "300", "--seed", "0", "--batch", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    print(proc.stdout)
    replay = "replay one case with: python tests/fuzz/run.py --items <case>"
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}\n{replay}"
