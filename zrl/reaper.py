"""The driver's reaper: a small process that outlives a killed `zrl run` and kills what it left running.

A SIGKILLed driver takes its embedded Ray head (GCS, raylet: kernel fate sharing) and the workers with
it, but the raylet's agents (dashboard agent, runtime-env agent) wait about a minute on the dead GCS
before they exit. Every process the driver starts inherits its tag (DRIVER_TAG in the environment),
which no other process carries (`driver_environment`); the reaper, started in its own session without the tag, waits for
the driver's pid to end and then kills every process that still carries the tag.

A driver that ends normally stops its reaper first (`Reaper.stop`): its Ray shut down cleanly.
`python -m zrl.reaper PID TAG` is the reaper's own entry point.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

DRIVER_TAG = "ZRL_DRIVER_TAG"  # set in the driver's environment: every process it starts inherits it
# Ray's agents rename themselves with setproctitle, which by default writes the title over the memory that
# /proc/PID/environ shows, hiding the tag; SPT_NOENV=1 keeps the title to the command line's own memory.
TAG_KEEPING_ENV = {"SPT_NOENV": "1"}
QUIET_SCANS = 4                # scans (0.5 s apart) that find no tagged process before the reaper exits
REAP_LIMIT_S = 120.0


@contextlib.contextmanager
def driver_environment(tag: str) -> Iterator[None]:
    """Within the block, processes started from this one carry the tag where the reaper can read it."""
    updates = {DRIVER_TAG: tag, **TAG_KEEPING_ENV}
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tagged_processes(tag: str) -> list[int]:
    """Live processes of this host whose environment carries DRIVER_TAG=`tag` (Linux /proc)."""
    needle = f"{DRIVER_TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process carrying the tag except this one; returns their pids."""
    pids = [p for p in tagged_processes(tag) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class Reaper:
    """Starts the reaper process for the calling driver (Linux only: it reads /proc)."""

    def __init__(self, tag: str):
        env = {k: v for k, v in os.environ.items() if k != DRIVER_TAG}
        self.process = subprocess.Popen([sys.executable, "-m", "zrl.reaper", str(os.getpid()), tag], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its parent has not collected it yet


def main(argv: list[str]) -> int:
    pid, tag = int(argv[0]), argv[1]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while _alive(pid):
        time.sleep(0.5)
    # Ray's dying processes may still start others (a raylet spawning a worker): kill until none appear
    # for QUIET_SCANS scans in a row.
    quiet, deadline = 0, time.monotonic() + REAP_LIMIT_S
    while quiet < QUIET_SCANS and time.monotonic() < deadline:
        quiet = 0 if kill_tagged(tag) else quiet + 1
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
