"""The RL stage's own scheduling on a simulated clock: `simulate(stage, workload, rollout_workers)`.

The decisions are the real loop's objects, unchanged: `StageSchedule` (zrl.pipeline.schedule) decides
rounds, training and syncs, the buffer's `BatchQueue` (zrl.buffer) queues, paces (admission credit),
evicts and releases. This module is the schedule's second transport (the first is zrl.pipeline.rl_stage):
the schedule's requests are carried out as events on a clock, one handler per request type, vLLM
engines become `_Engine`s driven by the workload's decode-step model, the trainer a step time. Answers
to the buffer's questions (credit, release) come back at once, and verification takes no time.

What is modelled, and how:
- A rollout worker runs back-to-back rounds of `round_s` (a round ends early when its engine runs
  empty); finished groups are reported and admitted at the round's end; new groups start only at a
  round's start. Rounds that report nothing, start nothing and carry no sync change nothing in the
  schedule or the buffer, so they are not enacted one by one: a worker's chain of rounds is cut only
  at the first round end after a group finished, when its engine empties, when a sync waits for it,
  or when the buffer has credit to hand out (the earliest round end of any worker takes it).
- A running engine advances all its sequences one token per decode step (continuous batching); the
  step time depends on the running sequences and their KV tokens (workload.DecodeModel), constant
  between two sequence ends (KV tokens as at the segment's start). The trajectory (every sequence's end
  time) is computed when groups join the engine or it starts again after waiting (a sync); a round that
  starts no group continues it. A token carries the version its engine held when it was decoded (syncs
  are in place); a group's oldest, its engine's at its start, is the version the buffer's queue knows it by.
- A weight sync is one collective: it starts when the trainer and every worker are free (a worker
  after its current round), takes `sync_s`, and the trainer ranks train nothing meanwhile: a step
  released while a sync waits for workers starts when the sync ends (the ranks run calls in order).
- A group is its response lengths and the version its tokens carry: all the queue's rules read (it
  knows a group by its version), and all the trainer's step time needs. The buffer's scoring is not
  run, since simulated responses have no rewards: of what it decides, only its zero-signal drop
  changes the schedule, and the workload's `zero_signal_fraction` of groups are dropped there (with
  the stage's dynamic sampling on; an all-failed group is what the scorer drops,
  tests/unit/plan/test_simulator.py). No `Rollout` record is made, so a plan costs the same per
  group whatever the response lengths.

Invariants: the simulated stage ends when the schedule says it is done, else `simulate` raises
(a stall); every group started is in an engine, admitted (buffer counts) or lost (never here);
idle fractions and steps/hour are measured as zrl.pipeline.stage_report and bench/ measure them.
"""

from __future__ import annotations

import gc
import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from zrl.buffer import BatchQueue
from zrl.config.schema import RLStage
from zrl.pipeline.schedule import (AskBatch, AskCredit, BatchAnswer, CreditAnswer, GroupAdmitted, GroupHandedOn,
                                   LaunchRound, Request, RoundDone, StageSchedule, StartSync, StepDone, TrainerSynced,
                                   WorkerSynced)
from zrl.plan.workload import Workload

EPS = 1e-9


@dataclass(slots=True)
class _Group:
    policy_version: int       # of its oldest tokens (its engine's when it started)
    lengths: np.ndarray       # [G] response tokens
    tokens: int               # their sum
    engine: _Engine           # where it runs: later tokens carry the versions of its syncs
    start_progress: float     # the engine's progress when it started
    first_sync: int           # the engine's syncs before it started


class _Engine:
    """One worker's running sequences, in the order they end. `progress` is the tokens every running
    sequence has decoded since the engine's first start; a sequence ends when progress reaches its
    `finish`, and a group when progress reaches its longest sequence's finish (`group_ends`)."""

    def __init__(self):
        self.finish = np.zeros(0)             # [M] ascending: progress at which each sequence ends
        self.base = np.zeros(0)               # [M] context tokens minus progress (context = base + progress)
        self.group_ends: list[tuple[float, int]] = []  # heap of (finish of a group's last sequence, group index)
        self.progress = 0.0
        self.anchor = (0.0, 0.0)              # (progress, time): the trajectory's last known point
        # The chain of rounds in flight: its start and trajectory (valid until groups are added or the
        # engine pauses); a round end pauses the chain, a round started at once resumes it.
        self.chain_start: float | None = None
        self.done_at = np.zeros(0)            # [M] absolute end time of each sequence
        self.step_s = np.zeros(0)             # [M] decode-step time of each segment
        self.paused: tuple[float, float] | None = None  # (when, chain_start) of the last round end
        self.accounted_to = 0.0               # busy time is counted up to here
        self.busy_s = 0.0                     # seconds with running sequences
        self.policy_version = 0               # of the weights it holds
        self.draws = 0                        # prompt draws made (group ids)
        self.groups_in_engine = 0
        self.event = 0                        # token of its live round-end event
        self.event_time = math.inf
        self.sync_ready: float | None = None  # when it joined the pending sync
        self.sync_progress: list[float] = []  # the progress at each sync (decoding waits during one)
        self.sync_versions: list[int] = []    # the version each sync brought

    @property
    def empty_at(self) -> float:
        return self.done_at[-1] if len(self.done_at) else (self.chain_start or 0.0)

    def add(self, lengths: np.ndarray, prompt_tokens: int, first_group: int) -> None:
        """Start groups first_group, first_group + 1, ...: `lengths` [groups, G]."""
        finish = self.progress + lengths
        for i, end in enumerate(finish.max(axis=1).tolist()):
            heapq.heappush(self.group_ends, (end, first_group + i))
        # A stable sort keeps ties in the order the sequences started.
        finish = np.concatenate([self.finish, finish.ravel()])
        order = np.argsort(finish, kind="stable")
        self.finish = finish[order]
        self.base = np.concatenate([self.base, np.full(lengths.size, prompt_tokens - self.progress)])[order]

    def start_chain(self, t: float, workload: Workload) -> None:
        """Compute the trajectory from `t` on: sequence i's end time, segment by segment (between two
        sequence ends the running set, and so the step time, is fixed; KV tokens at the segment start)."""
        self.chain_start = self.accounted_to = t
        self.anchor = (self.progress, t)
        f = self.finish
        m = len(f)
        running = np.arange(m, 0, -1)                            # [M] sequences in segment k
        kv_base = np.cumsum(self.base[::-1])[::-1]               # [M] sum of base over the running set
        prev = np.concatenate([[self.progress], f[:-1]])
        self.step_s = workload.engine.seconds_per_token(running, kv_base + running * prev)
        self.done_at = t + np.cumsum((f - prev) * self.step_s)

    def first_group_end(self) -> float:
        """When the chain's first group ends (its last sequence's end time)."""
        return self.done_at[np.searchsorted(self.finish, self.group_ends[0][0])]

    def kv_tokens(self) -> float:
        return float(self.base.sum() + len(self.base) * self.progress)

    def advance(self, t: float) -> list[int]:
        """Pause the chain at `t`: drop the sequences done by then, return the groups that ended, in order."""
        k = int(np.searchsorted(self.done_at, t + EPS, side="right"))
        ended = []
        if k:
            last = self.finish[k - 1]
            while self.group_ends and self.group_ends[0][0] <= last:
                ended.append(heapq.heappop(self.group_ends)[1])
        if k < len(self.done_at):
            prev_f, prev_t = (self.finish[k - 1], self.done_at[k - 1]) if k else self.anchor
            self.progress = prev_f + (t - prev_t) / self.step_s[k]
        elif k:
            self.progress = self.finish[k - 1]
        self.finish, self.base = self.finish[k:], self.base[k:]
        self.done_at, self.step_s = self.done_at[k:], self.step_s[k:]
        self.anchor = (self.progress, t)
        self.paused = (t, self.chain_start)
        self.chain_start = None
        return ended

    def resume(self, t: float) -> bool:
        """Continue the paused chain with its trajectory when the next round starts at its pause."""
        if self.paused is None or self.paused[0] != t or not len(self.finish):
            return False
        self.chain_start = self.paused[1]
        return True

    def count_busy(self, t: float) -> None:
        """Add the seconds with running sequences since `accounted_to`, up to `t`, to `busy_s`."""
        if self.chain_start is not None:
            self.busy_s += max(0.0, min(t, self.empty_at) - self.accounted_to)
        self.accounted_to = max(self.accounted_to, t)


@dataclass
class StepRow:
    """One trainer step as the stage's metrics row would report it (a window since the previous step)."""

    step: int
    time_s: float
    rollout_idle_frac: float
    trainer_idle_frac: float
    max_staleness: int
    response_tokens: int


@dataclass
class PlanResult:
    mode: str                          # "async" | "sync"
    rollout_workers: int
    steps: int
    simulated_s: float
    steps_per_hour: float              # over the steps after the first (as bench/ measures a run)
    rollout_idle_frac: float           # mean of the per-step windows after the first
    trainer_idle_frac: float
    staleness_rollouts: dict[int, int]      # released rollouts per staleness (the buffer's histogram)
    staleness_tokens: dict[int, float]      # fraction of trained response tokens per staleness (of their rollout)
    token_staleness: dict[int, float]       # ... per staleness of each token's own version (the bound is on the
                                            # rollout's oldest; in-place syncs give later tokens newer versions)
    buffer_counts: dict[str, int]
    groups_started: int
    groups_in_flight: int              # at the end: started, neither admitted nor lost
    syncs: int
    peak_kv_tokens_per_worker: float
    workers_used: int                  # workers that were given at least one group
    rows: list[StepRow] = field(repr=False, default_factory=list)

    @property
    def evicted(self) -> int:
        return self.buffer_counts["evicted_stale"] + self.buffer_counts["evicted_capacity"]


def _tokens_by_version(group: _Group) -> list[tuple[int, float]]:
    """(policy version, response tokens) of a finished group: a token carries the version its engine held
    when it was decoded (progress p0 + i for the i-th token of each sequence)."""
    e = group.engine
    marks = e.sync_progress[group.first_sync:]
    if not marks or marks[0] >= group.start_progress + group.lengths.max():
        return [(group.policy_version, group.tokens)]
    decoded = np.clip(np.array(marks)[:, None] - group.start_progress, 0, group.lengths).sum(axis=1)  # [K]
    counts = np.diff(np.concatenate([[0.0], decoded, [group.tokens]]))     # tokens between the syncs
    versions = [group.policy_version, *e.sync_versions[group.first_sync:]]
    return [(v, float(n)) for v, n in zip(versions, counts) if n > 0]


def synchronous_variant(stage: RLStage) -> RLStage:
    """The stage run synchronously, as zrl runs max_staleness_steps 0: generation paused while the
    trainer steps or weights sync, every step synced, one ready batch."""
    data = stage.model_dump()
    data["asynchrony"].update(max_staleness_steps=0, sync_every_steps=1, min_ready_batches=1)
    return RLStage.model_validate(data)


class _Simulation:
    def __init__(self, stage: RLStage, workload: Workload, rollout_workers: int, steps: int, seed: int,
                 schedule_class: type[StageSchedule]):
        if rollout_workers < 1:
            raise ValueError(f"rollout_workers must be >= 1, got {rollout_workers}")
        if steps < 2:
            raise ValueError(f"steps must be >= 2 (the first step is excluded from rates), got {steps}")
        a, s = stage.asynchrony, stage.sampling
        self.workload, self.steps = workload, steps
        self.group_size = s.group_size
        self.rng = np.random.default_rng(seed)
        self.schedule = schedule_class(num_workers=rollout_workers, trainer_step=0, end_step=steps,
                                      prompts_per_batch=s.prompts_per_batch, sync_every_steps=a.sync_every_steps,
                                      synchronous=a.max_staleness_steps == 0)
        self.queue = BatchQueue(a, s.prompts_per_batch)
        self.dynamic_sampling = stage.algorithm.dynamic_sampling
        self.received = self.dropped = 0
        self.engines = [_Engine() for _ in range(rollout_workers)]
        self.groups: dict[int, _Group] = {}   # the groups in engines, by index (started in order)
        self.groups_started = 0
        self.events: list = []          # heap of (time, seq, kind, worker, token)
        self._seq = 0
        self.trainer_free = 0.0
        self.release_t = 0.0
        self.sync_version: int | None = None   # the policy version the pending sync sends
        self.sync_waiting = False       # a sync started and waits for workers to end their rounds
        self.deferred_step_s: float | None = None  # a released step queued behind that sync on the ranks
        self.syncs = 0
        self.rows: list[StepRow] = []
        self.window_start = 0.0
        self.busy_before = 0.0          # rollout busy seconds before the current window
        self.peak_kv = 0.0
        self.staleness_tokens: dict[int, float] = {}
        self.token_staleness: dict[int, float] = {}
        self.staleness_rollouts = dict.fromkeys(range(a.max_staleness_steps + 1), 0)

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: str, worker: int = -1, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, worker, token))

    def _round_end_at(self, w: int, t: float) -> None:
        """(Re)schedule worker w's next processed round end at `t` if that is sooner than its current one."""
        e = self.engines[w]
        if t < e.event_time - EPS:
            e.event += 1
            e.event_time = t
            self._push(t, "round", w, e.event)

    def _next_round_end(self, e: _Engine, t: float) -> float:
        """The end of the round in flight at `t` (rounds tile time from the chain's start)."""
        k = math.floor((t - e.chain_start) / self.workload.round_s + EPS) + 1
        return min(e.chain_start + k * self.workload.round_s, max(e.empty_at, t))

    def run(self) -> PlanResult:
        s = self.schedule
        t = 0.0
        self._carry_out(s.start(), t)
        while not s.done:
            if not self.events:
                raise RuntimeError(f"the simulated stage stalled at step {s.trainer_step} (t={t:.1f} s): "
                                   f"{self._counts()}, in flight {s.in_flight_groups()}")
            t, _, kind, w, token = heapq.heappop(self.events)
            if kind == "round":
                if token != self.engines[w].event:
                    continue
                self._on_round_end(w, t)
            elif kind == "trained":
                self._on_trained(t)
            elif kind == "synced":
                self._on_synced(t)
            self._start_work(t)
            self._wake_for_credit(t)
        return self._result(t)

    # ------------------------------------------------------------------ rounds

    def _launch(self, request: LaunchRound, t: float) -> None:
        w, new = request.worker, request.new_groups
        e = self.engines[w]
        if new:
            first = self.groups_started
            all_lengths = self.workload.lengths.sample(self.rng, new * self.group_size).reshape(new, self.group_size)
            for i, tokens in enumerate(all_lengths.sum(axis=1).tolist()):
                self.groups[first + i] = _Group(e.policy_version, all_lengths[i], tokens, e, e.progress,
                                                len(e.sync_progress))
            self.groups_started += new
            e.draws += 1
            e.groups_in_engine += new
            e.add(all_lengths, self.workload.prompt_tokens, first)
        self.peak_kv = max(self.peak_kv, e.kv_tokens())
        if new or not e.resume(t):
            e.start_chain(t, self.workload)
        e.event_time = math.inf
        self._schedule_chain(w)

    def _schedule_chain(self, w: int) -> None:
        """The first round end after one of the engine's groups finished (or when it runs empty)."""
        e = self.engines[w]
        if not len(e.done_at):
            self._round_end_at(w, e.chain_start)
            return
        self._round_end_at(w, self._next_round_end(e, e.first_group_end() - EPS))

    def _on_round_end(self, w: int, t: float) -> None:
        s, e = self.schedule, self.engines[w]
        e.event_time = math.inf
        e.count_busy(t)
        finished = [self.groups.pop(index) for index in e.advance(t)]
        e.groups_in_engine -= len(finished)
        s.take(RoundDone(w, len(finished), e.groups_in_engine, e.policy_version))
        for group in finished:
            s.take(GroupHandedOn())
            self._admit(group)
            s.take(GroupAdmitted())
        if s.workers[w].syncing and e.sync_ready is None:
            e.sync_ready = t
            self._maybe_sync_ready()

    def _admit(self, group: _Group) -> None:
        """The buffer's admission of a verified group: its scoring drops a zero-signal group (the
        workload's fraction of them, with dynamic sampling on), its queue takes the rest."""
        self.received += 1
        if self.rng.random() < self.workload.zero_signal_fraction and self.dynamic_sampling:
            self.dropped += 1
        else:
            self.queue.push(group, group.policy_version)

    def _wake_for_credit(self, t: float) -> None:
        """Credit the buffer would give now is taken at the earliest round end of a running worker
        (the real loop asks again after every round; rounds in between change nothing)."""
        s = self.schedule
        if s.paused or s.credit_requested:
            return
        if self.queue.admission_credit(s.in_flight_groups(), s.generating_version()) <= 0:
            return
        candidates = [(self._next_round_end(e, t), w) for w, e in enumerate(self.engines)
                      if e.chain_start is not None and not s.workers[w].syncing]
        if candidates:
            when, w = min(candidates)
            self._round_end_at(w, when)

    # ------------------------------------------------------------------ the schedule's requests

    def _start_work(self, t: float) -> None:
        """Carry out the schedule's requests until it makes none (the questions in the order asked: the
        buffer actor answers one caller's calls in order)."""
        while requests := self.schedule.next_requests():
            self._carry_out(requests, t)

    def _carry_out(self, requests: list[Request], t: float) -> None:
        for request in requests:
            self.HANDLERS[type(request)](self, request, t)

    def _ask_credit(self, request: AskCredit, t: float) -> None:
        credit = self.queue.admission_credit(request.in_flight_groups, request.generating_version)
        self._carry_out(self.schedule.take(CreditAnswer(credit)), t)

    # ------------------------------------------------------------------ training and sync

    def _release(self, request: AskBatch, t: float) -> None:
        s = self.schedule
        step = request.trainer_step
        groups = self.queue.take(step)
        s.take(BatchAnswer(groups is not None))
        if groups is None:
            return
        response_tokens = 0
        for group in groups:
            staleness = step - group.policy_version
            self.staleness_tokens[staleness] = self.staleness_tokens.get(staleness, 0.0) + group.tokens
            for version, tokens in _tokens_by_version(group):
                self.token_staleness[step - version] = self.token_staleness.get(step - version, 0.0) + tokens
            self.staleness_rollouts[staleness] += self.group_size
            response_tokens += group.tokens
        self.release_t = t
        response = np.concatenate([group.lengths for group in groups])  # [N_seq]
        step_s = self.workload.trainer.step_s(response + self.workload.prompt_tokens)
        self.last_batch = (step - min(group.policy_version for group in groups), response_tokens)
        if self.sync_waiting:  # the ranks run the sync's collective first (calls run in order on an actor)
            self.deferred_step_s = step_s
            return
        self.trainer_free = max(t, self.trainer_free) + step_s
        self._push(self.trainer_free, "trained")

    def _on_trained(self, t: float) -> None:
        s = self.schedule
        requests = s.take(StepDone())
        self.queue.set_trainer_step(s.trainer_step)
        self._carry_out(requests, t)
        for e in self.engines:
            e.count_busy(t)
        total_busy = sum(e.busy_s for e in self.engines)
        busy, self.busy_before = total_busy - self.busy_before, total_busy
        window = max(t - self.window_start, EPS)
        self.rows.append(StepRow(s.trainer_step, t, max(0.0, 1 - busy / (window * len(self.engines))),
                                 max(0.0, 1 - (t - self.release_t) / window), *self.last_batch))
        self.window_start = t

    def _start_sync(self, request: StartSync, t: float) -> None:
        s = self.schedule
        self.sync_version = request.policy_version
        self.sync_trainer_ready = max(t, self.trainer_free)
        self.sync_waiting = True
        for w, e in enumerate(self.engines):
            if s.workers[w].in_round:
                e.sync_ready = None
                self._round_end_at(w, self._next_round_end(e, t))
            else:
                e.sync_ready = t
        self._maybe_sync_ready()

    def _maybe_sync_ready(self) -> None:
        if any(e.sync_ready is None for e in self.engines):
            return
        done = max([self.sync_trainer_ready] + [e.sync_ready for e in self.engines]) + self.workload.sync_s
        self.trainer_free = done
        self.sync_waiting = False
        if self.deferred_step_s is not None:
            self.trainer_free += self.deferred_step_s
            self.deferred_step_s = None
            self._push(self.trainer_free, "trained")
        for e in self.engines:
            e.sync_ready = math.inf   # joined; cleared when the sync ends
        self._push(done, "synced")

    def _on_synced(self, t: float) -> None:
        s = self.schedule
        s.take(TrainerSynced())
        for w, e in enumerate(self.engines):
            e.policy_version = self.sync_version
            e.sync_progress.append(e.progress)
            e.sync_versions.append(self.sync_version)
            e.sync_ready = None
            s.take(WorkerSynced(w, self.sync_version))
        self.syncs += 1

    HANDLERS = {AskCredit: _ask_credit, LaunchRound: _launch, AskBatch: _release, StartSync: _start_sync}

    # ------------------------------------------------------------------ result

    def _result(self, t: float) -> PlanResult:
        steady = self.rows[1:]
        span = steady[-1].time_s - self.rows[0].time_s
        total = sum(self.staleness_tokens.values())
        in_engines = sum(e.groups_in_engine for e in self.engines)
        return PlanResult(
            mode="sync" if self.schedule.synchronous else "async", rollout_workers=len(self.engines),
            steps=self.steps, simulated_s=t, steps_per_hour=3600 * len(steady) / span,
            rollout_idle_frac=float(np.mean([r.rollout_idle_frac for r in steady])),
            trainer_idle_frac=float(np.mean([r.trainer_idle_frac for r in steady])),
            staleness_rollouts=self.staleness_rollouts,
            staleness_tokens={k: v / total for k, v in sorted(self.staleness_tokens.items())},
            token_staleness={k: v / total for k, v in sorted(self.token_staleness.items())},
            buffer_counts=self._counts(), groups_started=self.groups_started,
            groups_in_flight=in_engines + self.schedule.verifying, syncs=self.syncs,
            peak_kv_tokens_per_worker=self.peak_kv, workers_used=sum(e.draws > 0 for e in self.engines),
            rows=self.rows)

    def _counts(self) -> dict[str, int]:
        """The buffer's counters (`RolloutBuffer.counts`) that the plan has: its queue's and the drops."""
        return {"received": self.received, "dropped_zero_signal": self.dropped, **self.queue.counts,
                "buffered": len(self.queue)}


def simulate(stage: RLStage, workload: Workload, rollout_workers: int, *, steps: int | None = None,
             seed: int = 0, schedule_class: type[StageSchedule] = StageSchedule) -> PlanResult:
    """Run `steps` (default: the stage's) trainer steps of `stage` on `rollout_workers` simulated
    rollout workers; the stage's asynchrony decides async vs sync (`synchronous_variant`).
    `schedule_class`: the loop's StageSchedule, or a subclass that proposes another policy."""
    simulation = _Simulation(stage, workload, rollout_workers, steps or stage.steps, seed, schedule_class)
    # A plan allocates millions of short-lived records and makes no reference cycles: the collector's passes
    # over them (and over the ~180K objects torch and pydantic hold) would find nothing. It is off for the run.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return simulation.run()
    finally:
        if enabled:
            gc.enable()
