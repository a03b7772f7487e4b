"""Rollout-worker deaths in an RL stage: which failed calls a death already handled, how often each
worker may die, and waiting for Ray's restart.

Every worker call the loop starts gets a sequence number (`next_seq`). When a worker dies, each of its
calls in flight fails; the first failure is the death (`died` says so and counts it), the others carry a
sequence number from before it and are ignored. A worker that died more than `max_worker_restarts`
times stops the stage; otherwise Ray restarts it (the actor's `max_restarts`) and `await_restart`
blocks until it answers again (calls to a restarting actor fail at once).

What a death costs (the stage loop, zrl/pipeline/rl_stage.py, carries it out): the groups in its engine
are lost and counted; their prompts are not drawn again. The new worker continues its prompt stream
from its last reported round (the prompts drawn in the round that died are drawn again: they never
made a group), and every worker is synced again. The buffer's prompt ledger drops any group whose
stream place was received before, so no place is trained twice; the ledger is reported at the end of
the stage and checked against the worker positions on resume.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from zrl.pipeline.faults import StageStopped, reason_of

log = logging.getLogger("zrl")

RESTART_POLL_S = 1.0  # between calls to a restarting worker (they fail at once until it is back)


class WorkerRestarts:
    def __init__(self, stage_name: str, num_workers: int, max_worker_restarts: int, restart_timeout_s: float):
        self.stage_name, self.limit, self.timeout_s = stage_name, max_worker_restarts, restart_timeout_s
        self.deaths = [0] * num_workers
        self.lost_at_seq: list[int | None] = [None] * num_workers  # call seq at which a worker's death was handled
        self._seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def died(self, w: int, seq: int, exc: RayActorError) -> bool:
        """Whether the failure of worker w's call `seq` is a death not handled yet (counted; past the
        limit the stage stops)."""
        lost_at = self.lost_at_seq[w]
        if lost_at is not None and seq < lost_at:
            return False  # a call that failed with the same death, already handled
        self.deaths[w] += 1
        if self.deaths[w] > self.limit:
            raise StageStopped(f"stage {self.stage_name!r} stopped: rollout worker {w} died {self.deaths[w]} times "
                               f"(asynchrony.max_worker_restarts {self.limit}); last: {reason_of(exc)}") from None
        return True

    def handled(self, w: int, lost_groups: int) -> None:
        """Worker w's death is handled: its calls started before now are ignored."""
        self.lost_at_seq[w] = self.next_seq()
        log.warning("rollout worker %d died (%d of %d restarts); %d group(s) in its engine lost, their prompts are "
                    "not drawn again; Ray restarts it, it continues its prompt stream after its last reported round "
                    "and every worker is synced again", w, self.deaths[w], self.limit, lost_groups)

    def await_restart(self, w: int, actor) -> None:
        """Block until Ray has restarted worker w (`actor`: its handle)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ray.get(actor.state_dict.remote())
                return
            except ActorDiedError as exc:
                raise StageStopped(f"stage {self.stage_name!r} stopped: rollout worker {w} could not be restarted: "
                                   f"{reason_of(exc)}") from None
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise StageStopped(f"stage {self.stage_name!r} stopped: rollout worker {w} did not come back "
                                       f"within {self.timeout_s:g} s of its restart") from None
                time.sleep(RESTART_POLL_S)
