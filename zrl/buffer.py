"""The rollout buffer of the asynchronous pipeline: scoring, bounded staleness, capacity, release, pacing.

A plain class (docs/design.md, style rule 1); the stage loop hosts it in one Ray actor. It is the only
place where staleness is decided (docs/design.md "Contracts", docs/algorithms.md §7). `RolloutBuffer`
holds the prompt ledger and scores groups (steps 1-4 below, metrics, the frontier); its `BatchQueue`
holds the admitted groups and applies every rule about them (order, staleness, capacity, release,
pacing), knowing a group only by its oldest token's version, so the planner (zrl/plan) runs the same
rules on simulated groups.

Admission (`admit`), per group, in this order (zrl/algorithms/README.md "Buffer order"):
1. LZ77 repetition canary: a flagged rollout's task reward is zeroed (when `zero_reward`), counted.
2. Length bonus Δr (difficulty-scaled, numerator only): c from the stage's ramp at the trainer's
   current step, p* of the prompt's data source from earlier observation batches only.
3. Dynamic sampling: a group whose task rewards are all equal and whose Δr is all zero is dropped
   (counted) — it would get zero advantage everywhere. It still feeds the solve-rate frontier.
4. Advantages by the recipe's estimator; the group is stored in its admitted form.
The frontier is updated once per observation batch: every `prompts_per_batch` groups received, each
data source's mean gated solve rate over those groups. All received groups count, dropped ones too:
the frontier tracks what the policy solves, and the zero-signal filter would bias it (it removes
every all-correct group while the length gate is still closed).

Order ("oldest first"): a group's age is its oldest token's policy version (`min_version`), ties
broken by arrival. Release and capacity eviction both take the oldest first; for release this is
earliest-deadline-first (a group may be released up to step min_version + max_staleness_steps), which
minimises staleness evictions. With rollouts produced in order it is the arrival order.

Invariants:
- Staleness of a rollout at trainer step t is t - rollout.min_version (per-token versions: a rollout
  spanning an in-flight weight sync is as stale as its oldest token). A group with any rollout over
  `max_staleness_steps` is evicted, never released; checked whenever the step changes, on admission
  and again at release.
- At most `buffer_capacity_batches * prompts_per_batch` groups are buffered; the oldest are evicted.
- A batch of exactly `prompts_per_batch` groups is released only when at least
  `min_ready_batches * prompts_per_batch` groups are buffered, at most one batch per trainer step, and
  a released group leaves the buffer (released at most once).
- Conservation (cumulative counts): received = dropped_zero_signal + admitted;
  admitted = released + evicted_capacity + evicted_stale + discarded_on_resume + buffered.
- Exactly once: the prompt ledger holds the id of every group received in the stage (a group's id is
  its place in a worker's prompt stream, zrl.pipeline.rollout_worker.stream_group_id). A group whose
  id is already in it is a repeat (a worker that drew the same place twice): it is counted as
  `duplicates` and dropped before scoring, so no prompt place is trained twice. received = the
  ledger's size. The ledger is saved with the state (ids only).

Pacing (`admission_credit`): a group started now by workers at version w has min_version >= w and can
be released at trainer steps up to w + s_max (s_max = max_staleness_steps). The trainer pulls one batch
of b = prompts_per_batch groups per step, oldest first, so groups queued (buffered or in flight) up to
n·b are released within the n pulls at steps next_pull .. w + s_max, n = w + s_max - next_pull + 1
(next_pull = the trainer step, or the one after it when a batch was already released at it). The queue limit is n·b, capped by the
capacity, and never below min_ready_batches·b while the trainer still waits to pull at its current
step, so the trainer can always get a batch (no deadlock). Workers may start limit - buffered -
in_flight more groups. The floor only binds when min_ready_batches > s_max - lag + 1 (lag = t - w); with
the steady-state lag <= sync_every_steps - 1 (weights reach the workers promptly) it never binds when
min_ready_batches <= max_staleness_steps - sync_every_steps + 2 (true for zrl's defaults 2, 2, 1, the
ZAYA1-8B report's 2, 2, 2 and synchronous mode's 1, 0, 1). A lag also shrinks the limit by a batch per
step: weights synced every step keep the workers' version at the trainer step at every credit question.
Workers that respect the credit never cause a capacity eviction, and when groups finish in the order
they were started no group goes stale either. A group that finishes after a later-started one may miss
the last pull its version allows (the trainer does not wait for it); it is then evicted as stale —
pacing reduces waste, the eviction is the guarantee.

Resume: `state_dict` keeps counters (the verifier errors per entry too), the frontier and its pending
observations, the trainer step, the staleness histogram and the prompt ledger. Buffered groups are not saved (they hold token, logprob and routing arrays
and are cheap to regenerate relative to a checkpoint's size); they are counted as
`discarded_on_resume` in the saved state.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

import numpy as np

from zrl.algorithms import SolveRateFrontier, length_coef, score_group
from zrl.canaries import compressibility_report, repetition_gate
from zrl.config.schema import Algorithm, Asynchrony, RLStage, Sampling
from zrl.metrics import batch_metrics
from zrl.trainer.packing import split_batch
from zrl.types import RolloutGroup, TrainBatch, Verification, stream_place

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: the prompt ledger

AdmissionStatus = Literal["buffered", "dropped_zero_signal", "evicted_stale", "evicted_capacity", "duplicate"]

# Cumulative counters (conservation identities in the module docstring): the RolloutBuffer's, its queue's.
SCORING_COUNTERS = ("received", "dropped_zero_signal", "kept_for_length", "discarded_on_resume",
                    "rollouts_received", "canary_flagged", "verifier_errors", "duplicates")
QUEUE_COUNTERS = ("admitted", "released", "released_batches", "evicted_capacity", "evicted_stale")
COUNTERS = SCORING_COUNTERS + QUEUE_COUNTERS


@dataclass(frozen=True)
class Admission:
    """What `admit` did with one group, and what it evicted to keep the invariants."""

    group_id: str
    status: AdmissionStatus       # the group's own fate; "buffered" means it waits for release
    canary_flagged: int           # rollouts of this group flagged by the LZ77 canary
    evicted_stale: int            # groups (this one included) evicted as stale during this call
    evicted_capacity: int         # groups (this one included) evicted for capacity during this call


@dataclass(frozen=True)
class BatchTicket:
    """A released batch as the stage loop sees it; the rollouts travel in the ranks' shares."""

    trainer_step: int
    num_groups: int
    num_sequences: int
    num_response_tokens: int
    max_staleness: int
    metrics: Mapping[str, float]  # zrl.metrics.batch_metrics of the batch: what this step trains on


class _Entry(NamedTuple):
    """A queued group in the queue's age order: entries compare as (min_version, arrival), and arrivals
    are unique, so the group itself is never compared."""

    min_version: int
    arrival: int
    group: Any


class BatchQueue:
    """The buffer's queue: the admitted groups waiting for the trainer, and every rule that decides
    about them (staleness eviction, capacity eviction, readiness, one batch per step, pacing credit).

    It knows a group only by its oldest token's policy version and its arrival; the group itself is
    opaque (the RolloutBuffer queues scored `RolloutGroup`s, the planner its simulated groups), so the
    planner runs these rules unchanged at a cost independent of the rollouts' size. The rules are in
    the module docstring ("Order", "Invariants", "Pacing").
    """

    def __init__(self, asynchrony: Asynchrony, prompts_per_batch: int, first_version: int = 0):
        self.max_staleness_steps = asynchrony.max_staleness_steps
        self.batch_groups = prompts_per_batch
        self.capacity_groups = asynchrony.buffer_capacity_batches * prompts_per_batch
        self.ready_groups = asynchrony.min_ready_batches * prompts_per_batch
        self.trainer_step = first_version
        self.last_release_step: int | None = None
        self.arrivals = 0
        self.counts = dict.fromkeys(QUEUE_COUNTERS, 0)
        self._entries: list[_Entry] = []          # sorted, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def groups(self) -> tuple:
        """The queued groups, oldest first: the order of release."""
        return tuple(e.group for e in self._entries)

    def set_trainer_step(self, step: int) -> int:
        """Record the trainer's policy version (optimizer steps done); returns groups evicted as stale."""
        if step < self.trainer_step:
            raise ValueError(f"trainer step went back from {self.trainer_step} to {step}")
        self.trainer_step = step
        # Entries are sorted by min_version, so the stale ones form a prefix.
        cut = bisect.bisect_left(self._entries, (step - self.max_staleness_steps, -1))
        del self._entries[:cut]
        self.counts["evicted_stale"] += cut
        return cut

    def push(self, group, min_version: int) -> tuple[AdmissionStatus, int, int]:
        """Queue an admitted group whose oldest token has policy version `min_version`. Returns its
        status and the groups (it included) evicted as stale and for capacity to keep the invariants."""
        self.counts["admitted"] += 1
        entry = _Entry(min_version, self.arrivals, group)
        self.arrivals += 1
        # Every queued group was checked at the current step: only the new one can be stale.
        if self.trainer_step - min_version > self.max_staleness_steps:
            self.counts["evicted_stale"] += 1
            return "evicted_stale", 1, 0
        index = bisect.bisect(self._entries, entry)
        self._entries.insert(index, entry)
        excess = len(self._entries) - self.capacity_groups
        if excess <= 0:
            return "buffered", 0, 0
        del self._entries[:excess]  # the oldest first
        self.counts["evicted_capacity"] += excess
        return "evicted_capacity" if index < excess else "buffered", 0, excess

    def _next_pull_step(self) -> int:
        return self.trainer_step + int(self.last_release_step == self.trainer_step)

    def ready(self) -> bool:
        """Whether `take(trainer_step)` would release a batch now."""
        return len(self._entries) >= self.ready_groups and self.last_release_step != self.trainer_step

    def take(self, step: int, make_batch: Callable[[list], Any] = list) -> Any:
        """`make_batch` of the oldest `prompts_per_batch` groups for trainer step `step`, which then leave
        the queue (nothing leaves when `make_batch` raises), or None when fewer than `min_ready_batches`
        batches are queued. Advances the trainer step to `step` first. Raises if a batch was already
        released for `step` (one batch per optimizer step)."""
        self.set_trainer_step(step)
        if self.last_release_step == step:
            raise ValueError(f"a batch was already released for trainer step {step}")
        if len(self._entries) < self.ready_groups:
            return None
        entries = self._entries[:self.batch_groups]  # none is stale: set_trainer_step evicted them
        batch = make_batch([e.group for e in entries])
        del self._entries[:self.batch_groups]
        self.last_release_step = step
        self.counts["released"] += len(entries)
        self.counts["released_batches"] += 1
        return batch

    def queue_limit(self, generating_version: int) -> int:
        """Groups that may be queued or in flight now (the rule is in the module docstring)."""
        if generating_version > self.trainer_step:
            raise ValueError(f"worker version {generating_version} is newer than trainer step {self.trainer_step}")
        next_pull = self._next_pull_step()
        pulls = generating_version + self.max_staleness_steps - next_pull + 1
        limit = max(pulls, 0) * self.batch_groups
        if next_pull == self.trainer_step:
            limit = max(limit, self.ready_groups)  # the trainer waits at this step: let it pull
        return min(limit, self.capacity_groups)

    def admission_credit(self, in_flight_groups: int, generating_version: int) -> int:
        """How many more groups rollout workers may start now.

        in_flight_groups: groups started and not yet passed to the buffer (all workers);
        generating_version: the policy version the workers generate with now (the oldest, if they differ).
        """
        if in_flight_groups < 0:
            raise ValueError(f"in_flight_groups must be >= 0, got {in_flight_groups}")
        return max(0, self.queue_limit(generating_version) - len(self._entries) - in_flight_groups)


class _Window:
    """Means reported by `metrics` over the groups received since its previous call (dropped ones too:
    these watch what the rollout workers generate; the released batch's values are `batch_metrics`)."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.reward_sum = 0.0          # verifier rewards
        self.flagged = 0
        self.verifier_errors = 0
        self.bonus_sum = 0.0
        self.bonus_rollouts = 0        # rollouts with a non-zero Δr
        self.groups = 0
        self.bonus_groups = 0


class RolloutBuffer:
    """Admits scored groups, enforces staleness and capacity, releases train batches, paces workers."""

    def __init__(self, asynchrony: Asynchrony, algorithm: Algorithm, sampling: Sampling, *,
                 stage_steps: int, first_version: int = 0, frontier: SolveRateFrontier | None = None):
        """`stage_steps`: optimizer steps of the stage (the length coefficient ramps over them);
        `first_version`: the trainer step (policy version) the stage starts at; `frontier`: p* inherited
        from the previous stage, or None for a fresh one."""
        if stage_steps < 1:
            raise ValueError(f"stage_steps must be >= 1, got {stage_steps}")
        if first_version < 0:
            raise ValueError(f"first_version must be >= 0, got {first_version}")
        if algorithm.advantage == "grpo" and algorithm.length_reward.enabled:
            raise ValueError("algorithm.advantage=grpo does not take a length bonus (behavioural stage, "
                             "ZAYA1-8B report §IV-B7): set algorithm.length_reward.enabled: false")
        self.asynchrony = asynchrony
        self.algorithm = algorithm
        self.sampling = sampling
        self.stage_steps = stage_steps
        self.first_version = first_version
        self.queue = BatchQueue(asynchrony, sampling.prompts_per_batch, first_version)
        self.frontier = frontier if frontier is not None else SolveRateFrontier()
        self._ledger: set[str] = set()             # ids of every group received in the stage
        self._counts = dict.fromkeys(SCORING_COUNTERS, 0)  # the queue keeps its own
        self._entry_errors: dict[str, int] = {}    # entry key (Prompt.env) -> its rollouts' verifier errors
        self._staleness_hist: dict[int, int] = {}  # staleness -> released rollouts
        self._pending_solve: dict[str, list[float]] = {}  # source -> [gated reward sum, rollouts]
        self._pending_groups = 0
        self._window = _Window()

    @classmethod
    def from_stage(cls, stage: RLStage, *, first_version: int = 0,
                   frontier: SolveRateFrontier | None = None) -> RolloutBuffer:
        return cls(stage.asynchrony, stage.algorithm, stage.sampling, stage_steps=stage.steps,
                   first_version=first_version, frontier=frontier)

    # --- trainer step and staleness ------------------------------------------------------------

    @property
    def trainer_step(self) -> int:
        return self.queue.trainer_step

    @property
    def num_buffered(self) -> int:
        return len(self.queue)

    def buffered(self) -> tuple[RolloutGroup, ...]:
        """The buffered (admitted) groups, oldest first: the order of release."""
        return self.queue.groups()

    def set_trainer_step(self, step: int) -> int:
        """Record the trainer's policy version (optimizer steps done); returns groups evicted as stale."""
        return self.queue.set_trainer_step(step)

    # --- admission -------------------------------------------------------------------------------

    def length_coef(self) -> float:
        """c of the length reward at the trainer's current stage-local step (0 when disabled)."""
        spec = self.algorithm.length_reward
        if not spec.enabled:
            return 0.0
        return length_coef(self.queue.trainer_step - self.first_version, num_steps=self.stage_steps,
                           c_start=spec.c_start, c_end=spec.c_end)

    def _canary_flags(self, group: RolloutGroup) -> np.ndarray:
        lz77 = self.algorithm.canaries.lz77
        if not lz77.enabled:
            return np.zeros(group.size, dtype=bool)
        return np.array([compressibility_report(r.token_ids, threshold=lz77.threshold,
                                                bytes_per_token=lz77.bytes_per_token,
                                                chunk_tokens=lz77.chunk_tokens).flagged
                         for r in group.rollouts], dtype=bool)

    def admit_verified(self, group, verifications: tuple[Verification, ...]) -> Admission:
        """`admit` a generated group (group_id, prompt, rollouts) with its verifications. The rollout
        arrays are copied: the buffer owns what it holds, independent of the object store."""
        rollouts = tuple(replace(r, prompt_ids=r.prompt_ids.copy(), token_ids=r.token_ids.copy(),
                                 logprobs=r.logprobs.copy(), routing=None if r.routing is None else r.routing.copy())
                         for r in group.rollouts)
        return self.admit(RolloutGroup(group_id=group.group_id, prompt=group.prompt, rollouts=rollouts,
                                       verifications=tuple(verifications)))

    def admit(self, group: RolloutGroup) -> Admission:
        """Score one verified group (canary gate, Δr, zero-signal filter, advantages) and buffer it."""
        if group.admitted:
            raise ValueError(f"group {group.group_id!r} is already scored; admit the worker's raw group")
        if group.group_id in self._ledger:
            self._counts["duplicates"] += 1
            logger.warning("group %s was received before in this stage: dropped (prompt ledger)", group.group_id)
            return Admission(group.group_id, "duplicate", 0, 0, 0)
        self._ledger.add(group.group_id)
        task = group.task_rewards()                     # [G]
        lengths = group.response_lengths()              # [G]
        flags = self._canary_flags(group)               # [G]
        flagged = int(np.count_nonzero(flags)) if self.algorithm.canaries.lz77.enabled else 0
        if self.algorithm.canaries.lz77.zero_reward and flagged:
            rewards = np.array([repetition_gate(r, bool(f)) for r, f in zip(task, flags)], dtype=np.float64)
        else:  # the gate changes nothing
            rewards = task.copy()
        spec = self.algorithm.length_reward
        bonus, signal, advantages = score_group(
            rewards, lengths, advantage=self.algorithm.advantage, dynamic_sampling=self.algorithm.dynamic_sampling,
            c=self.length_coef() if spec.enabled else None, l_max=self.sampling.max_response_tokens,
            p_star=self.frontier.p_star(group.prompt.data_source), accuracy_tolerance=spec.accuracy_tolerance,
            tolerance_tokens=spec.tolerance_tokens)
        self._record_received(group, task, rewards, flagged, bonus)
        if advantages is None:
            self._counts["dropped_zero_signal"] += 1
            return Admission(group.group_id, "dropped_zero_signal", flagged, 0, 0)
        if self.algorithm.dynamic_sampling:
            self._counts["kept_for_length"] += int(signal == "length")
        for a in (rewards, bonus, advantages, flags):
            a.flags.writeable = False
        scored = RolloutGroup(group.group_id, group.prompt, group.rollouts, group.verifications, rewards=rewards,
                              length_bonuses=bonus, advantages=advantages, canary_flags=flags)
        status, stale, capacity = self.queue.push(scored, scored.min_version)
        return Admission(group.group_id, status, flagged, stale, capacity)

    def _record_received(self, group: RolloutGroup, task: np.ndarray, rewards: np.ndarray,
                         flagged: int, bonus: np.ndarray) -> None:
        g = group.size
        errors = sum(v.error is not None for v in group.verifications)
        w = self._window
        task_sum = float(task.sum())
        gated_sum = float(rewards.sum()) if flagged else task_sum  # the gate zeroes flagged rewards only
        bonus_rollouts = int(np.count_nonzero(bonus))
        c = self._counts
        c["received"] += 1
        c["rollouts_received"] += g
        c["canary_flagged"] += flagged
        c["verifier_errors"] += errors
        if errors:
            self._entry_errors[group.prompt.env] = self._entry_errors.get(group.prompt.env, 0) + errors
        w.groups += 1
        w.rollouts += g
        w.reward_sum += task_sum
        w.flagged += flagged
        w.verifier_errors += errors
        w.bonus_sum += float(bonus.sum()) if bonus_rollouts else 0.0
        w.bonus_rollouts += bonus_rollouts
        w.bonus_groups += int(bonus_rollouts > 0)
        # The frontier sees earlier observation batches only: accumulate, flush every B groups.
        pending = self._pending_solve.setdefault(group.prompt.data_source, [0.0, 0])
        pending[0] += gated_sum
        pending[1] += g
        self._pending_groups += 1
        if self._pending_groups >= self.queue.batch_groups:
            for source, (total, count) in self._pending_solve.items():
                self.frontier.update(source, total / count)
            self._pending_solve.clear()
            self._pending_groups = 0

    # --- release ---------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether `take_batch(trainer_step)` would release a batch now."""
        return self.queue.ready()

    def take_batch(self, step: int) -> TrainBatch | None:
        """The batch for trainer step `step` (its policy version), or None when fewer than
        `min_ready_batches` batches are buffered. Advances the buffer's trainer step to `step` first.
        Raises if a batch was already released for `step` (one batch per optimizer step)."""
        batch = self.queue.take(step, lambda groups: TrainBatch(groups=tuple(groups), trainer_step=step))
        if batch is None:
            return None
        values, counts = np.unique(batch.staleness, return_counts=True)
        for s, n in zip(values.tolist(), counts.tolist()):
            self._staleness_hist[s] = self._staleness_hist.get(s, 0) + n
        return batch

    def release(self, step: int, world_size: int, token_budget: int) -> tuple:
        """`take_batch(step)` split for the trainer ranks: (BatchTicket, share of rank 0, ..., share of
        rank world_size - 1), or None in every place when no batch is ready. The stage loop calls it with
        one return object per element, so each rank fetches only its own share."""
        batch = self.take_batch(step)
        if batch is None:
            return (None,) * (1 + world_size)
        ticket = BatchTicket(trainer_step=step, num_groups=len(batch.groups), num_sequences=batch.num_sequences,
                             num_response_tokens=batch.num_response_tokens, max_staleness=batch.max_staleness,
                             metrics=batch_metrics(batch, self.asynchrony.max_staleness_steps))
        return (ticket, *split_batch(batch, world_size, token_budget))

    # --- pacing ----------------------------------------------------------------------------------

    def queue_limit(self, generating_version: int) -> int:
        """Groups that may be buffered or in flight now (the rule is in the module docstring)."""
        return self.queue.queue_limit(generating_version)

    def admission_credit(self, in_flight_groups: int, generating_version: int) -> int:
        """How many more groups rollout workers may start now (`BatchQueue.admission_credit`)."""
        return self.queue.admission_credit(in_flight_groups, generating_version)

    # --- metrics and state -----------------------------------------------------------------------

    def metrics(self, reset_window: bool = True) -> dict[str, float]:
        """Cumulative counts (buffer/, canary/, env/, staleness/cumulative_*) and means over the groups
        received since the previous call (reward/received_mean, length_reward/, fractions); window means
        are omitted when no group arrived. `reset_window=False` leaves the window open. The values of a
        released batch come with its ticket (`release`)."""
        c = self.counts()
        out: dict[str, float] = {f"buffer/{k}": float(c[k]) for k in
                                 ("received", "admitted", "dropped_zero_signal", "kept_for_length",
                                  "released", "released_batches", "evicted_capacity", "evicted_stale",
                                  "discarded_on_resume")}
        out["ledger/prompts"] = float(len(self._ledger))
        out["ledger/duplicates"] = float(c["duplicates"])
        out["buffer/occupancy"] = float(c["buffered"])
        out["buffer/occupancy_batches"] = c["buffered"] / self.queue.batch_groups
        out["buffer/trainer_step"] = float(self.trainer_step)
        out["canary/lz77_flagged"] = float(c["canary_flagged"])
        out["env/verifier_errors"] = float(c["verifier_errors"])
        for entry, errors in self._entry_errors.items():
            out[f"env/{entry}/verifier_errors"] = float(errors)
        released_rollouts = sum(self._staleness_hist.values())
        for s in range(self.asynchrony.max_staleness_steps + 1):
            out[f"staleness/cumulative_{s}"] = float(self._staleness_hist.get(s, 0))
        if released_rollouts:
            out["staleness/cumulative_max"] = float(max(self._staleness_hist))
            out["staleness/cumulative_mean"] = (sum(s * n for s, n in self._staleness_hist.items()) /
                                                released_rollouts)
        out["length_reward/c"] = self.length_coef()
        for source, p_star in self.frontier.state_dict().items():
            out[f"length_reward/p_star/{source}"] = p_star
        w = self._window
        if w.rollouts:
            out["reward/received_mean"] = w.reward_sum / w.rollouts
            out["canary/lz77_flagged_fraction"] = w.flagged / w.rollouts
            out["env/verifier_error_fraction"] = w.verifier_errors / w.rollouts
            out["length_reward/bonus_mean"] = w.bonus_sum / w.rollouts
            out["length_reward/active_rollout_fraction"] = w.bonus_rollouts / w.rollouts
            out["length_reward/active_group_fraction"] = w.bonus_groups / w.groups
        if reset_window:
            self._window = _Window()
        return out

    def ledger_ahead_of(self, draws: Mapping[int, int]) -> int:
        """Ledger ids at or past a worker's prompt-stream position (`draws`: worker index -> draws made):
        places that worker would draw again. 0 after a consistent resume (the positions are saved after
        every group they produced was reported); anything else would be dropped as repeats."""
        places = (stream_place(group_id) for group_id in self._ledger)
        return sum(1 for place in places if place is not None and place[0] in draws and place[1] >= draws[place[0]])

    def counts(self) -> dict[str, int]:
        """Cumulative counters plus `buffered`, for conservation checks."""
        return {**self._counts, **self.queue.counts, "buffered": len(self.queue)}

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable state; buffered groups are counted as discarded, not saved."""
        counts = self.counts()
        counts["discarded_on_resume"] += counts.pop("buffered")
        return {
            "version": STATE_VERSION,
            "trainer_step": self.queue.trainer_step,
            "last_release_step": self.queue.last_release_step,
            "arrivals": self.queue.arrivals,
            "counts": counts,
            "staleness_hist": {str(s): n for s, n in self._staleness_hist.items()},
            "frontier": self.frontier.state_dict(),
            "pending_solve": {s: list(v) for s, v in self._pending_solve.items()},
            "pending_groups": self._pending_groups,
            "ledger": sorted(self._ledger),
            "entry_errors": dict(self._entry_errors),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; the buffer starts empty (see the module docstring)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"buffer state version {state.get('version')!r}, expected {STATE_VERSION}")
        unknown = set(state["counts"]) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown buffer counters in state: {sorted(unknown)}")
        if len(self.queue):
            logger.warning("load_state_dict drops %d buffered groups", len(self.queue))
        self.frontier.load_state_dict(state["frontier"])
        self.queue = BatchQueue(self.asynchrony, self.sampling.prompts_per_batch, int(state["trainer_step"]))
        last = state["last_release_step"]
        self.queue.last_release_step = None if last is None else int(last)
        self.queue.arrivals = int(state["arrivals"])
        self._counts = {k: int(state["counts"].get(k, 0)) for k in SCORING_COUNTERS}
        self.queue.counts = {k: int(state["counts"].get(k, 0)) for k in QUEUE_COUNTERS}
        self._staleness_hist = {int(s): int(n) for s, n in state["staleness_hist"].items()}
        self._pending_solve = {str(s): [float(v[0]), int(v[1])] for s, v in state["pending_solve"].items()}
        self._pending_groups = int(state["pending_groups"])
        self._ledger = set(state["ledger"])
        self._entry_errors = {str(k): int(v) for k, v in state.get("entry_errors", {}).items()}  # absent from older states
        if len(self._ledger) != self._counts["received"]:
            raise ValueError(f"buffer state: the prompt ledger holds {len(self._ledger)} ids but "
                             f"{self._counts['received']} groups were received")
        self._window = _Window()
