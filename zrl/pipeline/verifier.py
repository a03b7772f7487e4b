"""Verifier: scores finished groups off the generation path (a Ray actor pool hosts it).

A plain class so it runs in-process in tests (docs/design.md, style rule 1).

Environments are built once per verifier from the stage's specs, one instance per entry, and a prompt
is verified by the instance that made it: the entry whose key the prompt source stamped on it
(`Prompt.env`, zrl/prompts.py). A verifier that raises or returns something that is not a reward costs
the rollout its reward (`safe_verify`: reward 0, error recorded).

Hangs. Each response is verified in a worker thread, one call at a time, and waited on for at most
`timeout_s`:
- a timeout measures the call's own execution: the thread is idle when a call is handed to it, so
  nothing queues in front of it, and time a group spent queued for this verifier does not count;
- a call that does not return in time gets reward 0 with the error `timeout after {timeout_s:g} s`.
  Its thread cannot be killed: it is abandoned (a daemon thread, so it never keeps the process alive)
  and the next call gets a new thread, so a hang costs the calls behind it at most one timeout;
- an environment that verifies whole groups (`Environment.verify_group`, e.g. a batching reward model)
  gets one call per group, timed at `timeout_s` per response; its timeout costs the group's rewards;
- no thread is created per call while nothing hangs: one thread serves every call until it hangs.
Abandoned threads that are still running are reported with every group (`VerifiedGroup.hung_threads`);
each may keep spinning a CPU or holding memory, so the stage loop replaces a verifier whose count reaches
`MAX_HUNG_THREADS`. A hang that holds the GIL (C code that never releases it) stops this process's
waiting too; the stage loop's backstop for it times each call from when it could start on its actor.
A Verifier is used by one caller at a time (a Ray actor runs its calls in order).
"""

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from zrl.config.schema import EnvironmentSpec
from zrl.env import safe_verify, safe_verify_group, verifies_groups
from zrl.prompts import stage_environments
from zrl.types import Prompt, Verification

# Abandoned (hung) verify threads still running in one verifier process at which the stage loop replaces
# the process: a few hangs cost a thread each; more suggest a verifier that hangs systematically, whose
# spinning threads would starve the rest of the process.
MAX_HUNG_THREADS = 4


@dataclass(frozen=True)
class VerifiedGroup:
    verifications: tuple[Verification, ...]  # one per response, in order
    seconds: float                           # time spent verifying the group (execution, not queueing)
    hung_threads: int                        # abandoned verify threads still running in this process
    timeouts: int                            # responses of this group that ran out of time
    env: str                                 # the key of the entry that made the group's prompt (Prompt.env)


class _CallThread:
    """One daemon thread running handed-in calls in order. Not a ThreadPoolExecutor: its threads are
    joined at interpreter exit, so an abandoned hung call would keep the process from exiting."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="zrl-verify", daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self._calls.put((future, fn, args))
        return future

    def abandon(self) -> None:
        """Let the thread end once its current call returns (if it ever does)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, who re-raises it
                    future.set_exception(exc)


class Verifier:
    def __init__(self, environments: list[EnvironmentSpec], timeout_s: float):
        self.envs = stage_environments(environments)
        self.timeout_s = timeout_s
        self._worker = _CallThread()
        self._abandoned: list[threading.Thread] = []
        self.timeouts = 0                            # responses that ran out of time, in this process's life

    @property
    def hung_threads(self) -> int:
        """Abandoned verify threads still running (a hung call that has since returned no longer counts)."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def verify(self, prompt: Prompt, texts: list[str]) -> tuple[Verification, ...]:
        env = self.envs[prompt.env]
        if verifies_groups(env):  # one call for the group, timed as len(texts) calls
            return self._call(safe_verify_group, (env, prompt, texts), self.timeout_s * len(texts), len(texts))
        return tuple(self._call(safe_verify, (env, prompt, text), self.timeout_s, 1)[0] for text in texts)

    def verify_text(self, group) -> VerifiedGroup:
        """Verify a group's `GroupText` (the stage loop passes an object reference, which Ray resolves
        here: the responses go from the object store to this process, never through the driver); a
        multi-turn group comes with its episodes' rewards, which it returns as they are."""
        if group.verifications is not None:  # a multi-turn group: its environment scored the episodes
            return VerifiedGroup(group.verifications, 0.0, self.hung_threads, 0, group.prompt.env)
        start = time.perf_counter()
        timeouts_before = self.timeouts
        verifications = self.verify(group.prompt, list(group.texts))
        return VerifiedGroup(verifications, time.perf_counter() - start, self.hung_threads,
                             self.timeouts - timeouts_before, group.prompt.env)

    def _call(self, fn, args: tuple, timeout_s: float, responses: int) -> tuple[Verification, ...]:
        """`fn(*args)` on the worker thread: its Verification(s), or reward 0 for each of the call's
        `responses` when it runs past `timeout_s`."""
        future = self._worker.submit(fn, *args)
        try:
            result = future.result(timeout=timeout_s)
            return result if isinstance(result, tuple) else (result,)
        except FutureTimeout:
            self.timeouts += responses
            self._worker.abandon()
            self._abandoned.append(self._worker.thread)
            self._worker = _CallThread()
            return tuple(Verification(reward=0.0, error=f"timeout after {timeout_s:g} s") for _ in range(responses))
