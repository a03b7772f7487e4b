"""Which sandboxes are alive on the machine, for tests that check a run left none behind.

A sandbox is a process in a PID namespace other than the test's own (bubblewrap makes one per program).
With parallel test workers, the other worker's tests run sandboxes of their own: a sandbox below another
live pytest worker is that worker's, not a leak of the test looking.
"""

import os
from pathlib import Path


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _other_workers() -> set[int]:
    """pids of the other pytest-xdist workers (the children of our controller, us excluded)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return set()
    controller, found = os.getppid(), set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != os.getpid() and _parent(int(entry.name)) == controller:
                found.add(int(entry.name))
        except (OSError, ValueError):  # exited while we looked
            continue
    return found


def _below(pid: int, ancestors: set[int]) -> bool:
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            pid = _parent(pid)
        except OSError:
            return False
    return False


def sandbox_processes() -> list[str]:
    """Live, non-zombie processes in a PID namespace other than ours and not another worker's: "pid cmdline"."""
    ours, others, found = os.readlink("/proc/self/ns/pid"), _other_workers(), []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if os.readlink(entry / "ns" / "pid") != ours and not _below(int(entry.name), others):
                found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:80]!r}")
        except OSError:  # exited while we looked
            continue
    return found
