"""The RL stage's scheduling policy, apart from its transport: what to start next, given what finished.

`StageSchedule` decides; it never calls Ray, vLLM or torch. The transport (zrl.pipeline.rl_stage) tells
it what finished and carries out what it answers, so the same policy can be driven by simulated
workers on a simulated clock.

Decisions (the buffer keeps its own: admission credit, staleness, capacity, readiness):
- Rounds. A worker is idle when it runs no round and no sync. Idle workers wait for one credit answer
  from the buffer (`wants_credit`), which `plan_rounds` shares out evenly: each idle worker fills up to
  ceil((in flight + credit) / workers) groups, at most `prompts_per_batch` new ones per round, and a
  worker with groups still in its engine runs a round even with none new. In synchronous mode (max_staleness_steps = 0) no new group starts while a step trains or
  weights sync; groups already in an engine continue.
- Training. One step at a time: a batch is asked for when no step trains and no request is pending
  (synchronous mode: and no sync runs). The policy version is the trainer's optimizer step count.
- Weight sync. After every `sync_every_steps`-th step except the stage's last, every worker gets the
  new weights (`step_done` says when). A worker that died and was restarted by Ray holds unknown
  weights: every worker is synced again at once (a sync is one collective over all of them).
- Faults. The groups in a dead worker's engine are lost (counted); Ray restarts the worker (the loop
  bounds how often).
- Quiet. An answer that starts nothing (no credit, no batch) is not asked again until something
  progressed (`progressed`: a round, an admission, a step, a sync, a fault). This never stalls: while
  the trainer waits at a step, the buffer's credit covers `min_ready_batches`, so "no credit and no
  batch" implies groups in flight, whose progress wakes the loop.

Tracked per worker (`WorkerState`): the policy version its engine holds (-1: unknown, after a
restart), the groups in its engine, whether a round or a sync is in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    policy_version: int
    groups_in_engine: int = 0
    in_round: bool = False
    syncing: bool = False
    restarted: bool = False       # died and restarted, weights not yet synced


@dataclass
class StageSchedule:
    num_workers: int
    policy_version: int           # the trainer's: optimizer steps done
    end_version: int              # the stage ends when the trainer reaches it
    prompts_per_batch: int
    sync_every_steps: int
    synchronous: bool
    workers: list[WorkerState] = field(init=False)
    verifying: int = 0            # groups reported and not yet handed to the buffer
    credit_requested: bool = False
    batch_requested: bool = False
    training: bool = False
    trainer_syncing: bool = False
    resync_needed: bool = False   # a restarted worker must get the weights
    waiting: bool = False         # the last answers changed nothing: ask again after some progress
    lost_groups: int = 0
    worker_restarts: int = 0
    # Kept up to date by the methods below, which alone change `workers` (the planner asks these
    # ~10^5 times a plan; summed over the pool per question they took ~14% of its time):
    _in_engines: int = field(init=False, default=0)        # sum of the workers' groups_in_engine
    _idle: set[int] = field(init=False)                     # workers running no round and no sync
    _generating_version: int | None = field(init=False, default=None)  # None: to be recomputed

    def __post_init__(self):
        self.workers = [WorkerState(self.policy_version) for _ in range(self.num_workers)]
        self._idle = set(range(self.num_workers))

    # ------------------------------------------------------------------ queries

    @property
    def done(self) -> bool:
        return self.policy_version >= self.end_version

    @property
    def syncing(self) -> bool:
        return self.trainer_syncing or any(w.syncing for w in self.workers)

    @property
    def paused(self) -> bool:
        """Synchronous mode holds new groups back while a step trains or weights sync."""
        return self.synchronous and (self.training or self.syncing)

    def in_flight_groups(self) -> int:
        """Groups started and not yet handed to the buffer (in engines or being verified)."""
        return self._in_engines + self.verifying

    def generating_version(self) -> int:
        """The oldest policy version workers generate new groups with (a restarted worker will hold
        the latest version before it generates again)."""
        if self._generating_version is None:
            self._generating_version = min([w.policy_version if w.policy_version >= 0 else self.policy_version
                                            for w in self.workers])
        return self._generating_version

    def wants_credit(self) -> bool:
        return (not self.credit_requested and not self.waiting and not self.paused
                and bool(self._idle))

    def wants_batch(self) -> bool:
        return (not self.done and not self.training and not self.batch_requested and not self.waiting
                and not (self.synchronous and self.syncing))

    def wants_resync(self) -> bool:
        return self.resync_needed and not self.syncing

    # ------------------------------------------------------------------ decisions and events

    def plan_rounds(self, credit: int | None) -> list[tuple[int, int]]:
        """(worker, new groups) for every idle worker that should run a round now; `credit` is the
        buffer's answer, None when there is none to share (only groups in engines continue)."""
        if credit is not None:
            self.credit_requested = False
        left = 0 if credit is None or self.paused else credit
        # Even share-out: a worker fills up to its share of everything queued, so the credit (at most
        # (staleness + 1) batches) spreads over the whole pool instead of filling the first workers'
        # engines far past their running slots while the rest stand idle.
        share = math.ceil((self.in_flight_groups() + left) / len(self.workers))
        launches = []
        for index in sorted(self._idle):
            worker = self.workers[index]
            new = max(0, min(left, self.prompts_per_batch, share - worker.groups_in_engine)) if left else 0
            if new == 0 and worker.groups_in_engine == 0:
                continue
            left -= new
            worker.in_round = True
            self._idle.discard(index)
            worker.groups_in_engine += new
            self._in_engines += new
            launches.append((index, new))
        if credit is not None and not launches and not self.paused:  # a pause ends with its own event
            self.waiting = True
        return launches

    def progressed(self) -> None:
        """Something changed that may change the buffer's answers (an admission, a step, a sync, a fault)."""
        self.waiting = False

    def round_done(self, index: int, finished_groups: int, groups_in_engine: int, policy_version: int) -> None:
        worker = self.workers[index]
        worker.in_round = False
        if not worker.syncing:
            self._idle.add(index)
        self._in_engines += groups_in_engine - worker.groups_in_engine
        worker.groups_in_engine = groups_in_engine
        self._set_version(worker, policy_version)
        self.verifying += finished_groups

    def _set_version(self, worker: WorkerState, policy_version: int) -> None:
        if worker.policy_version != policy_version:
            worker.policy_version = policy_version
            self._generating_version = None

    def group_handed_on(self) -> None:
        """A reported group went to the buffer (or was lost on the way)."""
        self.verifying -= 1

    def worker_lost(self, index: int) -> int:
        """The worker died (Ray restarts it): its engine's groups are lost; returns how many."""
        worker = self.workers[index]
        lost = worker.groups_in_engine
        self.lost_groups += lost
        self.worker_restarts += 1
        self.workers[index] = WorkerState(policy_version=-1, restarted=True)
        self._in_engines -= lost
        self._idle.add(index)
        self._generating_version = None
        self.resync_needed = True
        self.waiting = False
        return lost

    def batch_answer(self, released: bool) -> None:
        self.batch_requested = False
        self.training = released
        if not released:
            self.waiting = True

    def step_done(self) -> bool:
        """The trainer finished a step; returns whether the workers get the new weights now."""
        self.training = False
        self.waiting = False
        self.policy_version += 1
        self._generating_version = None   # a restarted worker counts as the trainer's version
        return self.policy_version % self.sync_every_steps == 0 and not self.done

    def sync_started(self) -> None:
        self.resync_needed = False
        self.trainer_syncing = True
        for worker in self.workers:
            worker.syncing = True
        self._idle.clear()

    def trainer_synced(self, ok: bool = True) -> None:
        self.trainer_syncing = False
        self.resync_needed |= not ok
        self.waiting = False

    def worker_synced(self, index: int, policy_version: int | None) -> None:
        """A worker's part of a sync ended: with the version it now holds, or None when it failed (a
        member died or timed out), after which every worker gets the weights again."""
        worker = self.workers[index]
        worker.syncing = False
        if not worker.in_round:
            self._idle.add(index)
        if policy_version is None:
            self._set_version(worker, -1)
            self.resync_needed = True
        else:
            self._set_version(worker, policy_version)
            worker.restarted = False
        self.waiting = False
