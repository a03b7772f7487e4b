"""The part of the sandboxed executor that runs inside the sandbox (see zrl/sandbox.py).

zrl/sandbox.py starts it as `python3 -I -S -c <this file's source>` inside a fresh bubblewrap sandbox and
writes one JSON request to its stdin: {"program": str, "inputs": [str], "limits": {...}}. It writes the
program to the scratch directory, runs `python3 -I main.py` once per input (the input on stdin) under
resource limits, and answers with one JSON list on stdout: per input its stdout, stderr, exit code,
status and seconds. Standard library only: nothing of zrl is visible inside the sandbox.

Invariants:
- The harness is PID 1 of the sandbox's PID namespace (bwrap --as-pid-1): the kernel delivers no signal
  from inside the namespace to it that it does not handle, so a program cannot kill it, and when it
  exits the kernel kills everything else in the namespace.
- The program cannot forge the answer: it gets its own pipes (never the harness's stdout), and the
  harness makes itself non-dumpable first, so a process of the same user can neither open the harness's
  /proc/<pid>/fd nor ptrace it.
- Every output is read up to a byte budget; a program that writes more is killed ("output_limit").
- After each input every other process of the sandbox is killed and reaped, so nothing a program starts
  (a daemon in its own session included) runs into the next input.
zrl/sandbox.py imports `read_capped` from here, so the executor bounds the harness's answer the same way.
"""

import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time

PR_SET_DUMPABLE = 4
STDERR_BYTES = 64 * 1024  # the tail of an error message is all a verifier or a reader needs


def read_capped(proc: subprocess.Popen, caps: dict, deadline: float) -> tuple[dict, str | None]:
    """Read `proc`'s pipes (caps: {pipe: max bytes}) until `proc` exited and the pipes are drained, a pipe
    passes its cap, or the monotonic `deadline`; returns ({pipe: bytes}, None | "output_limit" | "timeout").
    Reading stops at `proc`'s exit even when a process it started still holds the pipes open. The caller
    kills what is left."""
    chunks = {pipe: bytearray() for pipe in caps}
    exited = os.pidfd_open(proc.pid)
    selector = selectors.DefaultSelector()
    for pipe in caps:
        selector.register(pipe, selectors.EVENT_READ)
    selector.register(exited, selectors.EVENT_READ)
    why, drain = None, False
    while why is None:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        events = selector.select(timeout=0 if drain else left)
        if drain and not any(key.fileobj is not exited for key, _ in events):
            break  # exited, and nothing more is buffered
        for key, _ in events:
            if key.fileobj is exited:
                drain = True
                continue
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
                continue
            chunks[key.fileobj] += data
            if len(chunks[key.fileobj]) > caps[key.fileobj]:
                why = "output_limit"
    selector.close()
    os.close(exited)
    return {pipe: bytes(chunks[pipe][:caps[pipe]]) for pipe in caps}, why


def _limit(limits: dict):
    """preexec_fn of a program: its rlimits (processes count in the sandbox's own user namespace)."""
    def apply():
        mib = 1024 * 1024
        cpu = max(1, int(limits["cpu_s"]))
        for name, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, limits["memory_mb"] * mib),
                            (resource.RLIMIT_NPROC, limits["processes"]),
                            (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mib),
                            (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(name, (value, value))
    return apply


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the program exited or closed its stdin
        pass


def _reap_orphans() -> None:
    """Collect the processes the program left behind (reparented to PID 1, already killed)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run_one(program_path: str, stdin: str, limits: dict) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-I", "-S", program_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, close_fds=True, start_new_session=True,
                            preexec_fn=_limit(limits))
    # A program that does not read its stdin must not block the harness: feed it from a thread.
    threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
    out, why = read_capped(proc, {proc.stdout: limits["output_bytes"], proc.stderr: STDERR_BYTES},
                           start + limits["wall_s"])
    os.kill(-1, signal.SIGKILL)  # as PID 1: every other process of the sandbox, daemons included
    code = proc.wait()
    _reap_orphans()
    if why is None:
        why = "ok" if code == 0 else ("timeout" if code == -signal.SIGXCPU or code == -signal.SIGKILL else "error")
    return {"stdout": out[proc.stdout].decode(errors="replace"), "stderr": out[proc.stderr].decode(errors="replace"),
            "exit_code": code, "status": why, "seconds": time.monotonic() - start}


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("harness: prctl(PR_SET_DUMPABLE) failed")
    request = json.loads(sys.stdin.buffer.read())
    path = os.path.join(os.getcwd(), "main.py")
    with open(path, "w") as f:
        f.write(request["program"])
    runs = [run_one(path, stdin, request["limits"]) for stdin in request["inputs"]]
    sys.stdout.write(json.dumps(runs))


if __name__ == "__main__":
    main()
