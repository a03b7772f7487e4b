"""The sandboxed executor against a corpus of hostile programs (tests/unit/sandbox/hostile/, one attack
each; a program prints "ESCAPED: ..." when its attack worked, and its `# expect:` line lists the statuses
its run may end with).

Checked for every program: nothing escaped (no ESCAPED line, no host secret in its output, no file
written on the host, no connection reached the test's listener); the run ended within its limits; no
process of the sandbox is left once `run` returns (each program's first line of stderr names its
sandbox's PID namespace, which must be empty then). Afterwards the executor still gives correct verdicts.
"""

import json
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from zrl.sandbox import STARTUP_S, Limits, Sandbox

HOSTILE = Path(__file__).with_name("hostile")
PROGRAMS = sorted(p.name for p in HOSTILE.glob("*.py"))
LIMITS = Limits(wall_s=3.0, cpu_s=2.0, memory_mb=256, processes=16, file_size_mb=8, open_files=64,
                output_bytes=64 * 1024, scratch_mb=16)
PROJECT = Path(__file__).resolve().parents[3]
SECRET_NAME = "ZRL_SANDBOX_CANARY"
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What the programs attack on the host: a secret in the environment and in a world-readable file,
    a writable path in /tmp, and a TCP listener on 127.0.0.1."""
    secret = secrets.token_hex(16)
    fd, canary = tempfile.mkstemp(prefix="zrl-canary-", dir="/tmp")
    os.write(fd, secret.encode())
    os.close(fd)
    os.chmod(canary, 0o644)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    os.environ[SECRET_NAME] = secret
    ctx = {"project": str(PROJECT), "canary_file": canary, "secret": secret, "secret_name": SECRET_NAME,
           "host_write": f"/tmp/zrl-escape-{secrets.token_hex(8)}", "port": listener.getsockname()[1],
           "scratch_secret": secrets.token_hex(16)}
    yield ctx, listener
    del os.environ[SECRET_NAME]
    os.unlink(canary)
    listener.close()


# Put before each program: its first line of stderr names the sandbox's PID namespace.
REPORT_NAMESPACE = 'import os, sys; sys.stderr.write(os.readlink("/proc/self/ns/pid") + "\\n"); sys.stderr.flush()\n'


def processes_in(namespace: str) -> list[str]:
    """Processes on this machine in the PID namespace `namespace` (e.g. "pid:[4026532301]")."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
                found.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:60]!r}")
        except OSError:  # it exited while we looked
            pass
    return found


def expected_statuses(name: str) -> set[str]:
    return set(re.search(r"^# expect: (.+)$", (HOSTILE / name).read_text(), re.M).group(1).split())


def check_contained(name: str, runs, seconds: float, host) -> None:
    ctx, listener = host
    for run in runs:
        text = run.stdout + run.stderr
        assert "ESCAPED" not in run.stdout, f"{name}: {run.stdout[:300]}"
        assert ctx["secret"] not in text and ctx["scratch_secret"] not in run.stdout, name
        assert run.seconds <= LIMITS.wall_s + 1.0, f"{name} ran {run.seconds:.1f} s"
    assert runs[0].status in expected_statuses(name), f"{name}: {runs[0]}"
    assert seconds <= len(runs) * LIMITS.wall_s + STARTUP_S, f"{name}: the call took {seconds:.1f} s"
    assert not os.path.exists(ctx["host_write"]) and not (PROJECT / "ESCAPED").exists(), name
    with pytest.raises(BlockingIOError):
        listener.accept()
    namespaces = {run.stderr.split("\n", 1)[0] for run in runs}
    assert all(ns.startswith("pid:[") for ns in namespaces), f"{name}: {runs}"
    assert [p for ns in namespaces for p in processes_in(ns)] == [], f"{name} left processes behind"
    log.info("%s: %s in %.2f s", name, runs[0].status, seconds)  # the figures of bench/results/sandbox_cpu.md


def timed_run(sandbox, program: str, ctx: dict, inputs: int = 1):
    start = time.monotonic()
    runs = sandbox.run(REPORT_NAMESPACE + program, [json.dumps(ctx)] * inputs)
    return runs, time.monotonic() - start


def test_the_corpus_is_complete():
    assert len(PROGRAMS) >= 25
    for name in PROGRAMS:
        assert expected_statuses(name) <= {"ok", "error", "timeout", "output_limit", "lost"}, name


@pytest.mark.parametrize("name", [p for p in PROGRAMS if not p.startswith(("06_", "07_"))])
def test_hostile_program_is_contained(sandbox, host, name):
    killer = name.startswith(("20_", "21_"))  # the harness must survive them and run the next input
    inputs = 2 if killer else 1
    runs, seconds = timed_run(sandbox, (HOSTILE / name).read_text(), host[0], inputs)
    check_contained(name, runs, seconds, host)
    if name.startswith("25_"):
        assert int(runs[0].stdout.split()[-1]) <= LIMITS.scratch_mb << 20
    if name.startswith("27_"):
        assert int(runs[0].stdout.split()[-1]) < LIMITS.open_files
    if killer:
        assert [(r.status, r.stdout) for r in runs] == [("ok", "alive\n")] * 2


def test_a_rollout_cannot_read_another_rollouts_scratch(sandbox, host):
    """06 keeps a secret in its scratch directory while 07, in a second sandbox, searches for it."""
    owner = {}
    thread = threading.Thread(target=lambda: owner.update(result=timed_run(
        sandbox, (HOSTILE / "06_scratch_owner.py").read_text(), host[0])))
    thread.start()
    thief = timed_run(sandbox, (HOSTILE / "07_scratch_thief.py").read_text(), host[0])
    thread.join()
    assert owner["result"][0][0].status == "ok"
    check_contained("07_scratch_thief.py", *thief, host)


def test_correct_verdicts_after_the_corpus(sandbox):
    runs = sandbox.run("a, b = map(int, input().split())\nprint(a + b)", ["1 2", "40 2", "-5 5"])
    assert [(r.status, r.stdout) for r in runs] == [("ok", "3\n"), ("ok", "42\n"), ("ok", "0\n")]
    failing = sandbox.run("raise SystemExit(3)", [""])[0]
    assert (failing.status, failing.exit_code) == ("error", 3)
