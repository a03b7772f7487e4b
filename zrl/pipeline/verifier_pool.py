"""The stage's verifier actors: which one takes the next group, when a hung one is restarted, and the
stage loop's backstop timer for a verify call.

A verifier times each response itself (zrl/pipeline/verifier.py); what it cannot cut off is a hang
that holds the GIL (C code). The backstop: a verifier runs its calls one at a time in submission order,
so a call's own execution starts when the call before it on that verifier finished; it gets one
timeout per response plus one, then the verifier is restarted (Ray restarts it, max_restarts=-1) and
the calls queued behind it fail and are verified again elsewhere. A verifier whose abandoned threads
reach MAX_HUNG_THREADS gets no new groups and is restarted once its queue drained.
"""

from __future__ import annotations

import logging
import time

import ray

from zrl.pipeline.stage_calls import VerifyCall
from zrl.pipeline.verifier import MAX_HUNG_THREADS, Verifier
from zrl.runtime_env import light_actor

log = logging.getLogger("zrl")


class VerifierPool:
    def __init__(self, environments, timeout_s: float, size: int, cpus: float = 0.0):
        self.actors = [light_actor(Verifier, environments, timeout_s, max_restarts=-1, num_cpus=cpus)
                       for _ in range(size)]
        self.timeout_s = timeout_s
        self.free_at = [0.0] * size       # when each verifier finished its last call
        self.replacing: set[int] = set()  # verifiers drained before a restart (hung threads)
        self._next = 0

    def submit(self, ticket, retried: bool = False) -> tuple:
        """Start verifying a group's text on the next usable verifier: (object reference, VerifyCall)."""
        usable = [v for v in range(len(self.actors)) if v not in self.replacing] or list(range(len(self.actors)))
        v = usable[self._next % len(usable)]
        self._next += 1
        return self.actors[v].verify_text.remote(ticket.text_ref), VerifyCall(ticket, v, time.perf_counter(), retried)

    def returned(self, v: int) -> None:
        self.free_at[v] = time.perf_counter()

    def check_health(self, v: int, hung_threads: int, busy: set[int]) -> None:
        """After a result of verifier `v`: mark it for a restart when its hung threads pile up, and restart
        the marked verifiers with nothing queued (`busy`: verifiers with calls pending)."""
        if hung_threads >= MAX_HUNG_THREADS:
            self.replace(v, f"{hung_threads} verify calls hang in it")
        for u in list(self.replacing - busy):
            self.replace(u, "its queue drained", now=True)

    def overdue(self, pending: dict) -> list[tuple]:
        """(reference, VerifyCall, limit in s) of every executing call past the backstop; each of their
        verifiers is restarted."""
        now = time.perf_counter()
        running: dict[int, tuple] = {}  # verifier -> its oldest pending call (the one executing)
        for ref, call in pending.items():
            if isinstance(call, VerifyCall) and call.verifier not in running:
                running[call.verifier] = (ref, call)
        late = []
        for v, (ref, call) in running.items():
            limit = self.timeout_s * (call.ticket.num_rollouts + 1)
            if now - max(call.submitted, self.free_at[v]) > limit:
                log.warning("verifier %d spent over %.0f s on group %s: reward 0, restarting the verifier", v, limit,
                            call.ticket.group_id)
                self.replace(v, "a verify call hung", now=True)
                self.free_at[v] = now
                late.append((ref, call, limit))
        return late

    def replace(self, v: int, why: str, now: bool = False) -> None:
        """Restart verifier `v`: at once, or once its queue drained."""
        if now:
            log.warning("restarting verifier %d: %s", v, why)
            ray.kill(self.actors[v], no_restart=False)
            self.replacing.discard(v)
        elif v not in self.replacing:
            log.warning("verifier %d will be restarted when its queue drains: %s", v, why)
            self.replacing.add(v)
