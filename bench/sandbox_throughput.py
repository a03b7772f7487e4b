"""Sandboxed executions per second (zrl/sandbox.py) against bare subprocesses, in the same run.

Two programs: a trivial one (one input, prints a constant) and a 10-test one (a stdin/stdout solution
run on 10 inputs, as a code environment verifies a response). Each is run by `workers` threads at once
(the verifier actors of a 2-core machine), as
- sandboxed: `Sandbox.run(program, inputs)`, one fresh bubblewrap sandbox per call;
- bare: `python3 -I -S main.py` per input in a plain subprocess (no namespaces, no limits).
Prints calls/s and program runs/s for both and the overhead ratio (bare rate / sandboxed rate).

Usage: .venv/bin/python bench/sandbox_throughput.py [--seconds 10] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from zrl.sandbox import Sandbox

TRIVIAL = ("print(42)", [""])
TEN_TESTS = ("n = int(input())\nprint(sum(i * i for i in range(n)))", [str(1000 * k) for k in range(10)])


def bare_run(python: str, path: str, inputs: list[str]) -> None:
    for stdin in inputs:
        subprocess.run([python, "-I", "-S", path], input=stdin.encode(), capture_output=True, check=True)


def rate(call, seconds: float, workers: int) -> float:
    """Calls per second over `seconds`, `workers` threads calling at once."""
    deadline = time.monotonic() + seconds

    def loop() -> int:
        done = 0
        while time.monotonic() < deadline:
            call()
            done += 1
        return done

    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(lambda _: loop(), range(workers)))
    return total / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sandbox = Sandbox()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.workers} workers, "
          f"sandbox Python {sandbox.python}, {time.strftime('%Y-%m-%d')}")
    print(f"{'program':<10} {'sandboxed calls/s':>18} {'runs/s':>8} {'bare calls/s':>13} {'runs/s':>8} {'overhead':>9}")
    with tempfile.TemporaryDirectory() as scratch:
        for name, (program, inputs) in (("trivial", TRIVIAL), ("10 tests", TEN_TESTS)):
            statuses = {r.status for r in sandbox.run(program, inputs)}
            if statuses != {"ok"}:
                raise SystemExit(f"{name}: the sandbox runs end {statuses}, not ok")
            path = os.path.join(scratch, "main.py")
            with open(path, "w") as f:
                f.write(program)
            boxed = rate(lambda: sandbox.run(program, inputs), args.seconds, args.workers)
            bare = rate(lambda: bare_run(sandbox.python, path, inputs), args.seconds, args.workers)
            n = len(inputs)
            print(f"{name:<10} {boxed:>18.1f} {boxed * n:>8.1f} {bare:>13.1f} {bare * n:>8.1f} {bare / boxed:>8.2f}x")


if __name__ == "__main__":
    main()
