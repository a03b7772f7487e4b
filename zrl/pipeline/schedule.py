"""The RL stage's scheduling policy, apart from its transport: what to start next, given what finished.

`StageSchedule` decides; it never calls Ray, vLLM or torch. It speaks one protocol with the two
transports that drive it, the Ray loop (zrl.pipeline.rl_stage) and the planner's simulated clock
(zrl.plan.simulator):
- requests (what to start): `next_requests()` says what to start now, `start()` the stage's first
  request, and `take(answer)` what an answer makes due (credit: rounds; a step: a sync). A request is
  recorded as made when it is emitted (a question pending, a sync running). The types: `AskCredit`,
  `LaunchRound`, `AskBatch`, `StartSync`; a transport has one handler per type.
- answers (what finished), given to `take`: `CreditAnswer`, `BatchAnswer`, `RoundDone`,
  `GroupHandedOn`, `GroupAdmitted`, `StepDone`, `TrainerSynced`, `WorkerSynced`, `WorkerLost`.
Nothing outside this module assigns the schedule's fields; transports read them (done, training, ...).

Decisions (the buffer keeps its own: admission credit, staleness, capacity, readiness):
- Rounds. A worker is idle when it runs no round and no sync. Idle workers wait for one credit answer
  from the buffer (`AskCredit`), which `_plan_rounds` shares out evenly: each idle worker fills up to
  ceil((in flight + credit) / workers) groups, at most `prompts_per_batch` new ones per round, and a
  worker with groups still in its engine runs a round even with none new. In synchronous mode
  (max_staleness_steps = 0) no new group starts while a step trains or weights sync; groups already
  in an engine continue.
- Training. One step at a time: a batch is asked for when no step trains and no request is pending
  (synchronous mode: and no sync runs).
- Weight sync. At the stage's start, and after every `sync_every_steps`-th step except the stage's
  last, every worker gets the new weights (`StartSync`). A worker that died and was restarted by Ray
  holds unknown weights: every worker is synced again at once (a sync is one collective over all of them).
- Faults. The groups in a dead worker's engine are lost (counted); Ray restarts the worker (the loop
  bounds how often).
- Quiet. An answer that starts nothing (no credit, no batch) is not asked again until something
  progressed (a round, an admission, a step, a sync, a fault). This never stalls: while the trainer
  waits at a step, the buffer's credit covers `min_ready_batches`, so "no credit and no batch"
  implies groups in flight, whose progress wakes the loop.

Tracked per worker (`WorkerState`): the policy version its engine holds (-1: unknown, after a
restart), the groups in its engine, whether a round or a sync is in flight.

Two counts, two names: `trainer_step` is the optimizer steps the trainer has done; a `policy_version`
is the trainer step a set of weights came from, as held by a rollout worker or stamped on a token (it
reaches the workers at a sync, so a worker's lags the trainer step by up to `sync_every_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# ---------------------------------------------------------------------- requests: schedule -> transport


@dataclass(frozen=True)
class AskCredit:
    """Ask the buffer how many new groups may start. Answer: `CreditAnswer`."""
    in_flight_groups: int
    generating_version: int


@dataclass(frozen=True)
class LaunchRound:
    """Run one round on worker `worker`, starting `new_groups` new groups (0: only those in its engine
    continue). Answer: `RoundDone` (or `WorkerLost`)."""
    worker: int
    new_groups: int


@dataclass(frozen=True)
class AskBatch:
    """Ask the buffer for the batch of trainer step `trainer_step` (the step it trains is the next one).
    Answer: `BatchAnswer`, then `StepDone` when it was released and trained."""
    trainer_step: int


@dataclass(frozen=True)
class StartSync:
    """Send the trainer's weights to every worker, which then hold policy version `policy_version` (the
    trainer step they came from). Answers: `TrainerSynced`, and `WorkerSynced` from every worker."""
    policy_version: int


Request = AskCredit | LaunchRound | AskBatch | StartSync
REQUEST_TYPES = (AskCredit, LaunchRound, AskBatch, StartSync)

# ---------------------------------------------------------------------- answers: transport -> schedule


@dataclass(frozen=True)
class CreditAnswer:
    credit: int                 # new groups the buffer admits now


@dataclass(frozen=True)
class BatchAnswer:
    released: bool              # a batch was released: the step trains


@dataclass(frozen=True)
class RoundDone:
    worker: int
    finished_groups: int        # reported groups, now being verified
    groups_in_engine: int       # still generating in its engine
    policy_version: int         # the version its engine holds


@dataclass(frozen=True)
class GroupHandedOn:
    """A reported group left verification: to the buffer (or, while it calibrates, the curriculum),
    or it was lost on the way (`lost`: its rollout worker died with its arrays)."""
    lost: bool = False


@dataclass(frozen=True)
class GroupAdmitted:
    """The buffer (or the calibrating curriculum) took a handed-on group; `lost`: the group's arrays
    were gone when it arrived."""
    lost: bool = False


@dataclass(frozen=True)
class StepDone:
    """The trainer finished the released batch's step."""


@dataclass(frozen=True)
class TrainerSynced:
    ok: bool = True             # False: the trainer's side of the sync failed; every worker is synced again


@dataclass(frozen=True)
class WorkerSynced:
    worker: int
    policy_version: int | None  # the version it now holds; None: its part failed (a member died or timed out)


@dataclass(frozen=True)
class WorkerLost:
    worker: int                 # died; Ray restarts it


Answer = (CreditAnswer | BatchAnswer | RoundDone | GroupHandedOn | GroupAdmitted | StepDone | TrainerSynced
          | WorkerSynced | WorkerLost)


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
    trainer_step: int             # optimizer steps the trainer has done
    end_step: int                 # the stage ends when the trainer reaches it
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
        self.workers = [WorkerState(self.trainer_step) for _ in range(self.num_workers)]
        self._idle = set(range(self.num_workers))

    # ------------------------------------------------------------------ queries

    @property
    def done(self) -> bool:
        return self.trainer_step >= self.end_step

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
            self._generating_version = min([w.policy_version if w.policy_version >= 0 else self.trainer_step
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

    # ------------------------------------------------------------------ the protocol

    def start(self) -> list[Request]:
        """The stage's first request: every worker gets the trainer's weights (they differ from the
        model's after an earlier stage)."""
        return self._start_sync()

    def next_requests(self) -> list[Request]:
        """What to start now, in the order to carry it out; each request is recorded as made."""
        requests: list[Request] = []
        if self.paused:
            requests += self._plan_rounds(None)
        elif self.wants_credit():
            self.credit_requested = True
            requests.append(AskCredit(self.in_flight_groups(), self.generating_version()))
        if self.wants_resync():
            requests += self._start_sync()
        if self.wants_batch():
            self.batch_requested = True
            requests.append(AskBatch(self.trainer_step))
        return requests

    def take(self, answer: Answer) -> list[Request]:
        """Take what finished; returns the requests it makes due at once (credit: rounds; a step: a sync)."""
        match answer:
            case RoundDone():
                self._round_done(answer)
            case GroupHandedOn(lost=lost):
                self.verifying -= 1
                self.lost_groups += lost
            case GroupAdmitted(lost=lost):
                self.lost_groups += lost
                self.waiting = False
            case CreditAnswer(credit=credit):
                return self._plan_rounds(credit)
            case BatchAnswer(released=released):
                self.batch_requested = False
                self.training = released
                self.waiting |= not released
            case StepDone():
                return self._step_done()
            case TrainerSynced(ok=ok):
                self.trainer_syncing = False
                self.resync_needed |= not ok
                self.waiting = False
            case WorkerSynced():
                self._worker_synced(answer.worker, answer.policy_version)
            case WorkerLost():
                self._worker_lost(answer.worker)
            case _:
                raise TypeError(f"StageSchedule.take: {answer!r} is not an answer of the schedule's protocol")
        return []

    # ------------------------------------------------------------------ decisions and events

    def _plan_rounds(self, credit: int | None) -> list[LaunchRound]:
        """A round for every idle worker that should run one now; `credit` is the buffer's answer,
        None when there is none to share (only groups in engines continue)."""
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
            launches.append(LaunchRound(index, new))
        if credit is not None and not launches and not self.paused:  # a pause ends with its own event
            self.waiting = True
        return launches

    def _round_done(self, done: RoundDone) -> None:
        worker = self.workers[done.worker]
        worker.in_round = False
        if not worker.syncing:
            self._idle.add(done.worker)
        self._in_engines += done.groups_in_engine - worker.groups_in_engine
        worker.groups_in_engine = done.groups_in_engine
        self._set_version(worker, done.policy_version)
        self.verifying += done.finished_groups
        self.waiting = False

    def _set_version(self, worker: WorkerState, policy_version: int) -> None:
        if worker.policy_version != policy_version:
            worker.policy_version = policy_version
            self._generating_version = None

    def _worker_lost(self, index: int) -> None:
        """Its engine's groups are lost; Ray restarts it with unknown weights."""
        lost = self.workers[index].groups_in_engine
        self.lost_groups += lost
        self.worker_restarts += 1
        self.workers[index] = WorkerState(policy_version=-1, restarted=True)
        self._in_engines -= lost
        self._idle.add(index)
        self._generating_version = None
        self.resync_needed = True
        self.waiting = False

    def _step_done(self) -> list[Request]:
        self.training = False
        self.waiting = False
        self.trainer_step += 1
        self._generating_version = None   # a restarted worker counts as the trainer's version
        if self.trainer_step % self.sync_every_steps == 0 and not self.done:
            return self._start_sync()
        return []

    def _start_sync(self) -> list[Request]:
        self.resync_needed = False
        self.trainer_syncing = True
        for worker in self.workers:
            worker.syncing = True
        self._idle.clear()
        return [StartSync(self.trainer_step)]

    def _worker_synced(self, index: int, policy_version: int | None) -> None:
        """After a failed part (None) every worker gets the weights again."""
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
