"""Runs the gtest binary so that a hung test is named, not just timed out:
a test that runs past --per-test seconds is killed and reported, and the
binary runs again over the tests it had not reached (each thread's stack of
the hung process printed first, where gdb or cuda-gdb is there). Exit status 0 only when
every test ran and none failed or hung. benchmarks/gpu_check.sh runs the
gtests through it.

    python3 tests/cpp/gtest_watchdog.py BINARY [--per-test 60] [gtest args...]
"""

import argparse
import shutil
import subprocess
import sys
import threading
import time


def backtrace(pid: int) -> None:
    """Every thread's stack of the hung process, where a debugger is there
    (the GPU machine has cuda-gdb and no gdb)."""
    for dbg in ("gdb", "cuda-gdb"):
        if shutil.which(dbg):
            cmd = [dbg, "-batch", "-p", str(pid), "-ex", "thread apply all bt 12"]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
            except subprocess.TimeoutExpired:
                out = f"{dbg}: no backtrace within 60 s"
            print(f"gtest_watchdog: {dbg} backtrace of the hung test\n{out}", flush=True)
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binary")
    ap.add_argument("--per-test", type=float, default=60.0, help="seconds one test may run")
    a, extra = ap.parse_known_args()
    wanted = next((x.split("=", 1)[1] for x in extra if x.startswith("--gtest_filter=")), "*")
    extra = [x for x in extra if not x.startswith("--gtest_filter=")]
    done, hung, failed = set(), [], []
    while True:
        skip = ":".join(sorted(done | set(hung)))
        filt = wanted if not skip else wanted + (":" if "-" in wanted else "-") + skip
        args = [a.binary, *extra, f"--gtest_filter={filt}"]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        state = {"test": None, "since": time.monotonic()}

        def watch(proc=proc, state=state):  # bound now: the next run rebinds both names
            while proc.poll() is None:
                if state["test"] and time.monotonic() - state["since"] > a.per_test:
                    backtrace(proc.pid)
                    proc.kill()
                    return
                time.sleep(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            if line.startswith("[ RUN      ] "):
                state["test"], state["since"] = line.split("] ", 1)[1].strip(), time.monotonic()
            elif line.startswith(("[       OK ] ", "[  FAILED  ] ", "[  SKIPPED ] ")) and " ms)" in line:
                name = line.split("] ", 1)[1].split(" (")[0].strip()
                done.add(name)
                if line.startswith("[  FAILED"):
                    failed.append(name)
                state["test"] = None
        rc = proc.wait()
        watcher.join()  # its backtrace printed and its kill done before the next run starts
        if state["test"] and rc != 0 and state["test"] not in done:
            print(f"gtest_watchdog: {state['test']} ran past {a.per_test:.0f} s (or died): killed; the rest runs again",
                  flush=True)
            hung.append(state["test"])
            continue
        break
    for name in hung:
        print(f"gtest_watchdog: HUNG {name}")
    for name in failed:
        print(f"gtest_watchdog: FAILED {name}")
    print(f"gtest_watchdog: {len(done)} tests ran, {len(failed)} failed, {len(hung)} hung; the last run exited {rc}")
    return 1 if hung or failed or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
