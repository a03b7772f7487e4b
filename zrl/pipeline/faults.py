"""How a run stops when it must: the stop request (SIGINT/SIGTERM), the reasons a stage cannot go on,
and the progress watchdog.

- `StopRequest`: the first SIGINT or SIGTERM (what a cluster scheduler sends before preemption) asks
  the stages to stop at the next step boundary: they save a checkpoint there and raise `Interrupted`.
  A second signal stops at once (KeyboardInterrupt; the cascade's cleanup still runs).
- `StageStopped`: a stage cannot make progress (a rollout worker that keeps dying, no step for too
  long, every group discarded); the message is one line with the reason and the counts.
  `TrainerFailed`, a kind of it, means a trainer rank failed: the run restarts the trainer pool from
  the latest checkpoint when `resources.trainer_restarts` allows (zrl/run.py).
- `ProgressWatchdog` (pure, no Ray): stops a stage when no trainer step completes within
  `progress_timeout_s`, or when the last `max_discarded_batches * prompts_per_batch` groups were all
  discarded (zero signal: e.g. every reward 0 from a failing verifier; repeats) or skipped (prompts
  longer than `max_prompt_tokens`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("zrl")

RANK_FAILURE_GRACE_S = 30.0  # after one trainer rank failed, how long the others get to return or fail


class StageStopped(RuntimeError):
    """A stage cannot go on; str() is the one-line reason."""


class TrainerFailed(StageStopped):
    """A trainer rank failed (its process died or a collective broke)."""


class Interrupted(Exception):
    """The run stopped on a signal at a step boundary, after saving a checkpoint there."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"stopped on {signal.Signals(signum).name} at trainer step {step}")
        self.step, self.signum = step, signum


def reason_of(exc: Exception) -> str:
    """One line saying why a Ray call failed: the remote exception, not Ray's wrapper."""
    from ray.exceptions import RayTaskError

    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    text = repr(cause) if cause is not None else str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]


def trainer_results(refs, what: str, fetch, timeout_s: float | None = None) -> list:
    """Every rank's result of one collective call (`fetch`: ray.get or a counting wrapper of it), or
    TrainerFailed naming the rank that failed: a dead rank's process rather than the other ranks'
    collectives that broke with it. `timeout_s`: how long to wait for all ranks (None: no limit)."""
    import ray
    from ray.exceptions import RayActorError, RayError

    ready, unfinished = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    results, failures = [], []
    for rank, ref in enumerate(refs):
        if ref not in ready:
            continue
        try:
            results.append(fetch(ref))
        except RayError as exc:
            failures.append((not isinstance(exc, RayActorError), rank, exc))
    if failures:
        _, rank, exc = min(failures, key=lambda f: f[:2])
        raise TrainerFailed(f"trainer rank {rank} failed during {what}: {reason_of(exc)}")
    if unfinished:
        ranks = [rank for rank, ref in enumerate(refs) if ref in unfinished]
        raise TrainerFailed(f"trainer rank(s) {ranks} did not finish {what} within {timeout_s:g} s")
    return results


class StopRequest:
    """Process-wide: set by the first SIGINT/SIGTERM, read by the stage loops at step boundaries."""

    signum: int | None = None
    _lock = threading.Lock()

    @classmethod
    def requested(cls) -> bool:
        return cls.signum is not None

    @classmethod
    def clear(cls) -> None:
        cls.signum = None

    @classmethod
    def handle(cls, signum, frame) -> None:
        with cls._lock:
            first = cls.signum is None
            cls.signum = signum
        if not first:
            raise KeyboardInterrupt  # a second signal: stop now (cleanup in `finally` blocks still runs)
        log.warning("%s: stopping at the next step boundary after saving a checkpoint (send it again to stop "
                    "at once)", signal.Signals(signum).name)

    @classmethod
    def install(cls) -> None:
        cls.clear()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, cls.handle)


def raise_if_stop_requested(step: int, checkpoint) -> None:
    """At a step boundary: when a stop was requested, save a checkpoint at `step` (checkpoint(step) or
    None when there is nothing to save to) and raise Interrupted."""
    if StopRequest.requested():
        if checkpoint is not None:
            checkpoint(step)
        raise Interrupted(step, StopRequest.signum)


@dataclass
class ProgressWatchdog:
    progress_timeout_s: float
    max_discarded_groups: int
    last_progress: float = field(default_factory=time.monotonic)
    discarded_in_a_row: int = 0
    zero_signal: int = 0          # the kinds of the current run of discarded groups
    duplicates: int = 0
    skipped_prompts: int = 0
    verifier_errors: int = 0
    error_example: str = ""

    def step_done(self) -> None:
        self.last_progress = time.monotonic()

    def group_verified(self, errors: list[str]) -> None:
        """Verifier errors of a group that is on its way to the buffer (counted while groups are discarded)."""
        self.verifier_errors += len(errors)
        if errors and not self.error_example:
            self.error_example = errors[0]

    def group_admitted(self, status: str) -> None:
        """The buffer's verdict on one group (zrl.buffer.Admission.status)."""
        if status == "dropped_zero_signal":
            self.zero_signal += 1
        elif status == "duplicate":
            self.duplicates += 1
        else:
            self._reset()
            return
        self.discarded_in_a_row += 1

    def prompts_skipped(self, n: int) -> None:
        self.skipped_prompts += n
        self.discarded_in_a_row += n

    def _reset(self) -> None:
        self.discarded_in_a_row = self.zero_signal = self.duplicates = self.skipped_prompts = 0
        self.verifier_errors, self.error_example = 0, ""

    def reason(self, now: float | None = None) -> str | None:
        """Why the stage should stop now, or None."""
        now = time.monotonic() if now is None else now
        if self.discarded_in_a_row >= self.max_discarded_groups:
            parts = [f"{self.zero_signal} dropped with zero signal (all rewards equal; {self.verifier_errors} "
                     f"verifier error(s){', e.g. ' + repr(self.error_example) if self.error_example else ''})",
                     f"{self.skipped_prompts} prompt(s) skipped as longer than max_prompt_tokens",
                     f"{self.duplicates} repeat(s)"]
            return (f"the last {self.discarded_in_a_row} groups were all discarded: " + ", ".join(parts) +
                    " (asynchrony.max_discarded_batches)")
        waited = now - self.last_progress
        if waited > self.progress_timeout_s:
            return f"no trainer step completed in {waited:.0f} s (asynchrony.progress_timeout_s)"
        return None
