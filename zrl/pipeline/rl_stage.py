"""Runs one RL stage: the transport of the asynchronous loop between rollout workers, verifiers, the
buffer and the trainer ranks.

`StageSchedule` (schedule.py) decides what to start; this module starts it as Ray calls, keeps every
call in flight as a named record (`RoundCall`, `VerifyCall`, ...) keyed by its object reference,
and feeds what finished back to the schedule. Nothing here waits on a single call except stage
set-up, checkpoints and the once-per-step metrics.

Data plane (the driver sees ids, counts, versions and metrics only):
- a rollout worker `ray.put`s every finished group, and its text apart; its round report carries
  `GroupTicket`s (ids, counts, the two references);
- a verifier gets the text by reference (Ray resolves it in the verifier) and returns rewards;
- the buffer gets the same reference with the verifications (`admit_verified`, not waited on: Ray
  runs one caller's calls to an actor in order, so the next credit question sees the admission);
- the buffer's `release` returns one object per trainer rank, each rank's `RankShare`, and the driver
  passes rank r the reference of share r only.
Every value the driver does fetch goes through `_fetch`, which counts rollout-array bytes in it
(`driver/rollout_array_bytes`, expected to stay 0).

Adaptive difficulty (zrl/pipeline/stage_curriculum.py): the driver owns the stage's difficulty
schedulers; every round it launches carries the adaptive entries' current levels, and every verified
group drawn at one is reported to them before it goes to the buffer (while they calibrate, instead).

Weight sync (zrl.pipeline.weight_sync): over a collective group formed at the first sync (trainer rank
0 + every rollout worker; loopback on one machine), or through the object store when
`sync_transport: object_store` or when the group cannot be formed (logged once, with the reason).
Faults (zrl/pipeline/faults.py for the stop reasons):
- A rollout worker that dies is restarted by Ray (up to `max_worker_restarts` times, then the stage
  stops). The groups in its engine are lost and counted; their prompts are not drawn again. The new
  worker continues its prompt stream from its last reported round (the prompts drawn in the round
  that died are drawn again: they never made a group), and every worker is synced again. The
  buffer's prompt ledger drops any group whose stream place was received before, so no place is
  trained twice; the ledger is reported at the end of the stage and checked against the worker
  positions on resume.
- A failed sync is retried the same way (MAX_FAILED_SYNCS in a row stop the stage).
- A trainer rank that fails (its call raised, or its process died) raises TrainerFailed naming the
  rank: the run restarts the trainer pool from the latest checkpoint (zrl/run.py).
- A verifier call is timed by the verifier itself per response (zrl/pipeline/verifier.py); the loop's
  backstop and the restarts of hung verifiers are zrl/pipeline/verifier_pool.py.
- `ProgressWatchdog` stops the stage when no step completes in `progress_timeout_s` or every recent
  group was discarded; a SIGINT/SIGTERM stops it at the next step boundary after a checkpoint.
- A held-out evaluation that fails (its worker died, or it raised) is logged and skipped: a report, not
  the run.

Held-out evaluation during the stage (`evaluation.every_steps`, zrl/pipeline/held_out.py): when a worker
reports a sync to a version that is due, it gets an `evaluate` call (queued between its rounds); the
result goes with the next metric row that is logged. In-flight evaluations are awaited at the stage's
end and logged at its last step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import (ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayError,
                            RayTaskError)

from zrl.algorithms import SolveRateFrontier
from zrl.buffer import RolloutBuffer
from zrl.config.schema import RLStage
from zrl.env.base import EnvironmentFault
from zrl.pipeline.faults import (ProgressWatchdog, StageStopped, StopRequest, TrainerFailed, raise_if_stop_requested,
                                 reason_of, trainer_results)
from zrl.pipeline.held_out import HeldOutSchedule, held_out_metrics, in_training_requests, summary
from zrl.pipeline.pools import Pool, light_actor
from zrl.pipeline.rollout_worker import GroupTicket, RolloutWorker
from zrl.pipeline.schedule import StageSchedule
from zrl.pipeline.stage_calls import (AdmitCall, CheckedCall, CreditCall, EvalCall, ReleaseCall, RoundCall,
                                      TrainCall, TrainerSyncCall, VerifyCall, WorkerSyncCall, call_errors,
                                      group_was_lost, rollout_bytes_in)
from zrl.pipeline.stage_curriculum import StageCurriculum, adaptive_entries
from zrl.pipeline.stage_report import StageCounters, progress_line, step_metrics
from zrl.pipeline.verifier_pool import VerifierPool
from zrl.prompts import build_entries
from zrl.types import Verification

log = logging.getLogger("zrl")

RANK_FAILURE_GRACE_S = 30.0  # after one trainer rank failed, how long the others get to return or fail
MAX_FAILED_SYNCS = 6  # failed sync calls in a row (each member's failure counts) before the stage stops


@dataclass
class StageContext:
    """What a stage needs from the cascade: the trainer pool (already started) and where to write."""

    ranks: list                 # TrainerRank actor handles, all started
    rollout_pool: Pool
    model_path: str
    engine_dtype: str           # "float32" | "bfloat16"
    kernels: str                # the model's kernel backend, for the rollout engines too
    token_budget: int           # the trainer's microbatch token budget (the buffer packs the shares)
    seed: int
    run_dir: str
    log_metrics: object         # callable(step: int, values: dict) -> bool (whether the row was written)
    checkpoint: object = None   # callable(step: int, data_state: dict) -> None, or None
    verifier_workers: int = 2
    cpus_per_verifier_worker: float = 0.0
    evaluation_seed: int = 0    # the recipe's seed: the held-out problems of the stage-end evaluation
    prefix_caching: bool = False  # the rollout engines' (resources.rollout_prefix_caching)


class RLStageRunner:
    def __init__(self, stage: RLStage, ctx: StageContext, first_version: int, resume_version: int | None = None,
                 data_state: dict | None = None, frontier: dict | None = None, curriculum: dict | None = None):
        """Trains the stage's steps from policy version `first_version` (or, with a checkpoint's
        `data_state`, from `resume_version`, the ranks already holding its weights). `frontier`: the
        running max solve rates a previous stage ended with (recipe `inherit.length_reward_state`);
        `curriculum`: the previous stage's difficulty-scheduler state (recipe `inherit.curriculum`)."""
        self.stage, self.ctx = stage, ctx
        a = stage.asynchrony
        version = first_version if resume_version is None else resume_version
        n = ctx.rollout_pool.size
        self.schedule = StageSchedule(num_workers=n, policy_version=version, end_version=first_version + stage.steps,
                                      prompts_per_batch=stage.sampling.prompts_per_batch,
                                      sync_every_steps=a.sync_every_steps, synchronous=a.max_staleness_steps == 0)
        self.counters = StageCounters(sync_transport=a.sync_transport)
        self.workers = [self._start_worker(i, version) for i in range(n)]
        ctx.rollout_pool.actors = self.workers
        self.worker_states: list[dict] = [{} for _ in range(n)]  # from each worker's latest round
        self.environment_counts: list[dict] = [{} for _ in range(n)]  # ... and its environments' counters
        self.lost_at_seq: list[int | None] = [None] * n           # call seq at which a worker's death was handled
        self.deaths = [0] * n
        inherited = SolveRateFrontier()
        inherited.load_state_dict(frontier or {})
        self.buffer = light_actor(RolloutBuffer, stage.asynchrony, stage.algorithm, stage.sampling,
                                  stage_steps=stage.steps, first_version=first_version, frontier=inherited)
        self.final_frontier: dict = dict(frontier or {})  # set from the buffer when the stage closes
        # only the adaptive entries' environments are built here (their levels and tasks)
        adaptive = adaptive_entries(build_entries([e for e in stage.environments if e.difficulty == "adaptive"]))
        self.curriculum = StageCurriculum(adaptive, seed=ctx.seed) if adaptive else None
        taken = self.curriculum.inherit(curriculum) if self.curriculum is not None and curriculum else []
        # what the stage took from the previous one (recorded in its stage record)
        self.inherited = {"length_reward_frontier": sorted(frontier or {}), "curriculum": taken}
        self.final_curriculum: dict | None = curriculum  # set when the stage closes, when it has adaptive entries
        self.verifiers = VerifierPool(stage.environments, a.verifier_timeout_s, ctx.verifier_workers,
                                      ctx.cpus_per_verifier_worker)
        self.watchdog = ProgressWatchdog(a.progress_timeout_s, a.max_discarded_batches * stage.sampling.prompts_per_batch)
        self.last_checkpoint = resume_version              # trainer step of the stage's newest checkpoint
        self.pending: dict = {}     # object reference -> the call record above
        self.group_ready = False    # the collective sync group is formed
        self.failed_syncs = 0
        self._seq = 0
        self._window_start = time.perf_counter()
        self._sync_started = 0.0
        self._last_heartbeat = time.perf_counter()
        self.held_out = HeldOutSchedule(stage.evaluation.every_steps, start_version=version,
                                        end_version=first_version + stage.steps)
        self.held_out_requests = in_training_requests(stage)
        self.eval_values: dict[str, float] = {}  # the latest evaluation's metrics, until a row carries them
        if data_state is not None:
            self._restore(data_state)

    def _start_worker(self, index: int, version: int):
        ctx, pool = self.ctx, self.ctx.rollout_pool
        restarts = self.stage.asynchrony.max_worker_restarts
        actor = ray.remote(RolloutWorker).options(**pool.options(index, max_restarts=restarts, max_task_retries=0))
        return actor.remote(index, ctx.model_path, self.stage, ctx.seed, ctx.engine_dtype, policy_version=version,
                            kernels=ctx.kernels, publish=ray.put, prefix_caching=ctx.prefix_caching)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        s = self.schedule
        log.info("stage %r: %d RL steps from trainer step %d (%s mode, weight sync: %s)", self.stage.name,
                 s.end_version - s.policy_version, s.policy_version,
                 "synchronous" if s.synchronous else "asynchronous", self.counters.sync_transport)
        trainer_ok = True
        try:
            self._start_sync()  # start from the trainer's weights (they differ from model_path after a stage)
            self.watchdog.step_done()
            while not s.done:
                self._start_work()
                self._wait_and_handle()
                self._expire_verifications()
                self._heartbeat()
                self._check_progress()
            self._finish_evaluations()
            self._log_ledger()
        except TrainerFailed:
            trainer_ok = False
            raise
        finally:
            self._close(trainer_ok)
        return s.policy_version

    def _check_progress(self) -> None:
        """Stop on a signal (at a step boundary, after a checkpoint) or when the stage cannot progress."""
        if StopRequest.requested() and not self.schedule.training:
            raise_if_stop_requested(self.schedule.policy_version, self._checkpoint_now)
        reason = self.watchdog.reason()
        if reason is not None:
            raise StageStopped(f"stage {self.stage.name!r} stopped: {reason}; {self._counts_line()}")

    def _checkpoint_now(self, step: int) -> None:
        if self.ctx.checkpoint and step != self.last_checkpoint and step > self.schedule.end_version - self.stage.steps:
            self.ctx.checkpoint(step, self.data_state())
            self.last_checkpoint = step

    def _log_ledger(self) -> None:
        """The stage's exactly-once check: every received group's prompt place once, repeats dropped."""
        counts = ray.get(self.buffer.counts.remote())
        line = (f"stage {self.stage.name!r} prompt ledger: {counts['received']} group(s) received once, "
                f"{counts['duplicates']} repeat(s) dropped, {self.schedule.lost_groups} lost with dead workers")
        (log.warning if counts["duplicates"] else log.info)(line)

    def _counts_line(self) -> str:
        counts = ray.get(self.buffer.counts.remote())
        return ("buffer: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) +
                f"; lost groups {self.schedule.lost_groups}, worker restarts {self.schedule.worker_restarts}")

    def _start_work(self) -> None:
        s = self.schedule
        if s.paused:
            self._launch(s.plan_rounds(None))
        elif s.wants_credit():
            s.credit_requested = True
            self.pending[self.buffer.admission_credit.remote(s.in_flight_groups(), s.generating_version())] = CreditCall()
        if s.wants_resync():
            self._start_sync()
        if s.wants_batch():
            s.batch_requested = True
            world = len(self.ctx.ranks)
            refs = self.buffer.release.options(num_returns=1 + world).remote(s.policy_version, world,
                                                                              self.ctx.token_budget)
            self.pending[refs[0]] = ReleaseCall(tuple(refs[1:]))

    def _wait_and_handle(self) -> None:
        if not self.pending:
            time.sleep(0.05)
            return
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.2, fetch_local=False)
        for ref in ready:
            call = self.pending.pop(ref)
            handler = {RoundCall: self._on_round, VerifyCall: self._on_verified, AdmitCall: self._on_admitted,
                       CreditCall: self._on_credit, ReleaseCall: self._on_released, TrainCall: self._on_trained,
                       TrainerSyncCall: self._on_trainer_synced, WorkerSyncCall: self._on_worker_synced,
                       EvalCall: self._on_evaluated, CheckedCall: self._on_checked}[type(call)]
            handler(call, ref)

    def _fetch(self, ref):
        """ray.get, counting the rollout-array bytes of what came back (the data plane keeps it at 0)."""
        value = ray.get(ref)
        self.counters.driver_array_bytes += rollout_bytes_in(value)
        return value

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ rounds and verification

    def _launch(self, launches: list[tuple[int, int]]) -> None:
        for w, new in launches:
            levels = self.curriculum.assignments(new) if self.curriculum is not None else None
            self.pending[self.workers[w].round.remote(new, levels)] = RoundCall(w, self._next_seq())

    def _on_credit(self, call: CreditCall, ref) -> None:
        self._launch(self.schedule.plan_rounds(self._fetch(ref)))

    def _on_round(self, call: RoundCall, ref) -> None:
        try:
            report = self._fetch(ref)
        except RayActorError as exc:
            self._worker_failed(call.worker, call.seq, exc)
            return
        except EnvironmentFault as exc:  # the prompt source (an environment plugin) failed in the round
            raise StageStopped(f"stage {self.stage.name!r} stopped: {exc.cause}") from None
        except RayTaskError as exc:
            raise StageStopped(f"stage {self.stage.name!r} stopped: rollout worker {call.worker}: {reason_of(exc)}") from None
        self.schedule.round_done(call.worker, len(report.tickets), report.in_flight_groups, report.policy_version)
        self.schedule.progressed()
        self.worker_states[call.worker] = report.state
        self.environment_counts[call.worker] = report.environment_counts
        c = self.counters
        c.generated_tokens += report.generated_tokens
        c.rollout_busy_s += report.busy_s
        c.skipped_long_prompts += report.skipped_long_prompts
        self.watchdog.prompts_skipped(report.skipped_long_prompts)
        for key, level in report.skipped_levels:  # a problem too long to pose is one the policy cannot solve
            self.curriculum.report_unposable(key, level, self.stage.sampling.group_size)
        c.generated_array_bytes += report.array_bytes
        c.canary_sums.update(report.canary_sums)
        c.rollouts_generated += sum(t.num_rollouts for t in report.tickets)
        for ticket in report.tickets:
            self._verify(ticket)

    def _verify(self, ticket: GroupTicket, retried: bool = False) -> None:
        ref, call = self.verifiers.submit(ticket, retried)
        self.pending[ref] = call

    def _on_verified(self, call: VerifyCall, ref) -> None:
        self.verifiers.returned(call.verifier)
        try:
            result = self._fetch(ref)
            verifications = result.verifications
            self.counters.verifier_timeouts += result.timeouts
            busy = {c.verifier for c in self.pending.values() if isinstance(c, VerifyCall)}
            self.verifiers.check_health(call.verifier, result.hung_threads, busy)
        except RayError as exc:
            if group_was_lost(exc):  # its rollout worker died: the group's arrays died with it
                self._group_lost(call.ticket)
                return
            if not isinstance(exc, RayActorError):
                raise
            if not call.retried:  # its verifier was restarted under it: try once more elsewhere
                self._verify(call.ticket, retried=True)
                return
            verifications = tuple(Verification(0.0, error="verifier died") for _ in range(call.ticket.num_rollouts))
        self.watchdog.group_verified([v.error for v in verifications if v.error])
        self._admit(call.ticket, verifications)

    def _admit(self, ticket: GroupTicket, verifications) -> None:
        """Hand a verified group to the buffer; while the curriculum calibrates, only to the curriculum."""
        calibrating = self.curriculum is not None and self.curriculum.calibrating
        if ticket.level is not None:
            self.curriculum.report(*ticket.level, verifications)
        self.schedule.group_handed_on()
        if calibrating:
            self.schedule.progressed()
            self.watchdog.step_done()  # calibration groups are the stage's progress until training starts
            return
        self.pending[self.buffer.admit_verified.remote(ticket.ref, tuple(verifications))] = AdmitCall(ticket)

    def _on_admitted(self, call: AdmitCall, ref) -> None:
        try:
            self.watchdog.group_admitted(self._fetch(ref).status)
        except RayError as exc:
            if not group_was_lost(exc):
                raise
            self.schedule.lost_groups += 1
        self.schedule.progressed()

    def _group_lost(self, ticket: GroupTicket) -> None:
        self.schedule.group_handed_on()
        self.schedule.lost_groups += 1
        log.warning("group %s was lost with its rollout worker", ticket.group_id)

    def _expire_verifications(self) -> None:
        """The backstop for verify calls that hang past their own timeouts (zrl/pipeline/verifier_pool.py)."""
        for ref, call, limit in self.verifiers.overdue(self.pending):
            del self.pending[ref]
            self.counters.verifier_timeouts += 1
            self._admit(call.ticket, [Verification(0.0, error=f"timeout after {limit:g} s")] * call.ticket.num_rollouts)

    # ------------------------------------------------------------------ training

    def _on_released(self, call: ReleaseCall, ref) -> None:
        ticket = self._fetch(ref)
        self.schedule.batch_answer(ticket is not None)
        if ticket is None:
            return
        refs = tuple(rank.train_step.remote(share) for rank, share in zip(self.ctx.ranks, call.shares))
        train = TrainCall(refs, time.perf_counter(), dict(ticket.metrics))
        for ref in refs:  # every rank's: a rank that fails is noticed while the others hang in a collective
            self.pending[ref] = train

    def _on_trained(self, call: TrainCall, ref) -> None:
        what = f"step {self.schedule.policy_version + 1}"
        if call_errors([ref]):  # the other ranks cannot finish the step: give them a moment to fail too
            trainer_results(call.refs, what, self._fetch, timeout_s=RANK_FAILURE_GRACE_S)
        if any(r in self.pending for r in call.refs):
            return  # the step ends when every rank has returned
        metrics = trainer_results(call.refs, what, self._fetch)[0]
        self.counters.train_busy_s += time.perf_counter() - call.started
        s = self.schedule
        sync_due = s.step_done()
        self.watchdog.step_done()
        self.pending[self.buffer.set_trainer_step.remote(s.policy_version)] = CheckedCall("buffer.set_trainer_step")
        if sync_due:
            self._start_sync()
        self._report(metrics, call.batch_metrics)
        step = s.policy_version
        if step % self.stage.checkpoint_every_steps == 0 or s.done:
            self._checkpoint_now(step)

    def _on_checked(self, call: CheckedCall, ref) -> None:
        self._fetch(ref)

    # ------------------------------------------------------------------ weight sync

    def _start_sync(self) -> None:
        s, ctx, a = self.schedule, self.ctx, self.stage.asynchrony
        if self.counters.sync_transport == "collective" and not self.group_ready:
            self._form_group()
        transport = self.counters.sync_transport
        s.sync_started()
        self._sync_started = time.perf_counter()
        if transport == "collective":
            refs = tuple(r.sync_weights.remote(ctx.engine_dtype, int(a.sync_bucket_mib * 2**20)) for r in ctx.ranks)
            calls = [w.receive_weights.remote() for w in self.workers]
        else:  # rank 0's state dict goes from its process to the workers' through the object store
            refs = tuple(r.export_state.remote(ctx.engine_dtype) for r in ctx.ranks)
            calls = [w.update_weights.remote(refs[0], s.policy_version) for w in self.workers]
        self.pending[refs[0]] = TrainerSyncCall(refs, transport)
        for index, ref in enumerate(calls):
            self.pending[ref] = WorkerSyncCall(index, self._next_seq())

    def _form_group(self) -> None:
        """Form the collective sync group (blocking: stage start and after faults only)."""
        ctx, a = self.ctx, self.stage.asynchrony
        host = "127.0.0.1" if ctx.rollout_pool.one_machine else None  # None: trainer rank 0's node address
        backend = "nccl" if ctx.rollout_pool.gpus > 0 else "gloo"
        joins = []
        try:
            address = ray.get(ctx.ranks[0].listen_for_sync.remote(host, len(self.workers), backend, a.sync_timeout_s))
            joins = [ctx.ranks[0].join_sync.remote(address)]
            joins += [w.join_sync.remote(address, i + 1) for i, w in enumerate(self.workers)]
            ray.get(joins, timeout=a.sync_timeout_s)
        except (RayError, GetTimeoutError) as exc:
            log.warning("weight sync: the collective group could not be formed (%s); syncing through Ray's "
                        "object store for the rest of the stage", reason_of(exc))
            self.counters.sync_transport = "object_store"
            ray.wait(joins[:1], timeout=a.sync_timeout_s)  # rank 0 leaves its join (it times out) first
            return
        self.group_ready = True
        log.info("weight sync: %s group of trainer rank 0 and %d rollout worker(s) at %s:%d", backend,
                 len(self.workers), address.host, address.port)

    def _on_trainer_synced(self, call: TrainerSyncCall, ref) -> None:
        # Under the object store rank 0's result is the whole state dict: never fetch it here.
        refs = call.refs if call.transport == "collective" else call.refs[1:]
        try:
            sent = [self._fetch(r) for r in refs]
        except RayError as exc:
            if any(isinstance(e, RayActorError) for e in call_errors(call.refs)):  # a rank died: TrainerFailed
                trainer_results(call.refs, "a weight sync", self._fetch, timeout_s=RANK_FAILURE_GRACE_S)
            self._sync_failed("the trainer side", exc)
            self.schedule.trainer_synced(ok=False)
            return
        self.schedule.trainer_synced()
        self.failed_syncs = 0
        c = self.counters
        c.sync_s += time.perf_counter() - self._sync_started
        c.sync_count += 1
        if call.transport == "collective":
            c.sync_bytes = sent[0].num_bytes
            c.sync_peak_extra_bytes["sender"] = sent[0].peak_extra_bytes

    def _on_worker_synced(self, call: WorkerSyncCall, ref) -> None:
        try:
            received = self._fetch(ref)
        except RayActorError as exc:
            self._worker_failed(call.worker, call.seq, exc)
            return
        except RayTaskError as exc:  # the collective failed or timed out (a member died)
            self._sync_failed(f"rollout worker {call.worker}", exc)
            self.schedule.worker_synced(call.worker, None)
            return
        self.schedule.worker_synced(call.worker, received.policy_version)
        if self.held_out_requests and self.held_out.due(received.policy_version):
            ref = self.workers[call.worker].evaluate.remote(self.held_out_requests, self.ctx.evaluation_seed)
            self.pending[ref] = EvalCall(call.worker, self._next_seq())
        c = self.counters
        c.sync_engine_s = received.seconds
        c.sync_peak_extra_bytes["receiver"] = received.peak_extra_bytes
        if c.sync_transport == "object_store":
            c.sync_bytes = received.num_bytes

    def _sync_failed(self, where: str, exc: RayError) -> None:
        """Log a failed sync; after MAX_FAILED_SYNCS in a row (a cause that will not go away), stop."""
        self.group_ready = False
        self.failed_syncs += 1
        reason = reason_of(exc)
        if self.failed_syncs >= MAX_FAILED_SYNCS:
            raise StageStopped(f"stage {self.stage.name!r} stopped: weight sync failed {self.failed_syncs} times in a "
                               f"row, last on {where}: {reason}") from None
        log.warning("weight sync failed on %s (%s); syncing every worker again", where, reason)

    def _worker_failed(self, w: int, seq: int, exc: RayActorError) -> None:
        lost_at = self.lost_at_seq[w]
        if lost_at is not None and seq < lost_at:
            return  # a call that failed with the same death, already handled
        self.deaths[w] += 1
        limit = self.stage.asynchrony.max_worker_restarts
        if self.deaths[w] > limit:
            raise StageStopped(f"stage {self.stage.name!r} stopped: rollout worker {w} died {self.deaths[w]} times "
                               f"(asynchrony.max_worker_restarts {limit}); last: {reason_of(exc)}") from None
        lost = self.schedule.worker_lost(w)
        self.lost_at_seq[w] = self._next_seq()
        log.warning("rollout worker %d died (%d of %d restarts); %d group(s) in its engine lost, their prompts are "
                    "not drawn again; Ray restarts it, it continues its prompt stream after its last reported round "
                    "and every worker is synced again", w, self.deaths[w], limit, lost)
        self._await_restart(w)
        if self.worker_states[w]:  # the restarted worker continues its prompt stream, not from draw 0
            ray.get(self.workers[w].load_state_dict.remote(self.worker_states[w]))
        self.group_ready = False

    def _await_restart(self, w: int) -> None:
        """Block until Ray has restarted worker `w` (calls to a restarting actor fail at once)."""
        deadline = time.monotonic() + self.stage.asynchrony.sync_timeout_s
        while True:
            try:
                ray.get(self.workers[w].state_dict.remote())
                return
            except ActorDiedError as exc:
                raise StageStopped(f"stage {self.stage.name!r} stopped: rollout worker {w} could not be restarted: "
                                   f"{reason_of(exc)}") from None
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise StageStopped(f"stage {self.stage.name!r} stopped: rollout worker {w} did not come back "
                                       f"within {self.stage.asynchrony.sync_timeout_s:g} s of its restart") from None
                time.sleep(1.0)

    # ------------------------------------------------------------------ held-out evaluation

    def _on_evaluated(self, call: EvalCall, ref) -> None:
        try:
            report = self._fetch(ref)
        except RayActorError as exc:
            log.warning("stage %r: rollout worker %d died during a held-out evaluation; it is skipped",
                        self.stage.name, call.worker)
            self._worker_failed(call.worker, call.seq, exc)
            return
        except RayTaskError as exc:  # a report, not the run
            log.error("stage %r: a held-out evaluation failed (%s); it is skipped", self.stage.name, reason_of(exc))
            return
        self.eval_values = held_out_metrics(report.policy_version, report.results)
        log.info("stage %r: held-out accuracy at policy version %d: %s (%.1f s on rollout worker %d)",
                 self.stage.name, report.policy_version, summary(report.results), report.seconds, call.worker)

    def _finish_evaluations(self) -> None:
        """Await the evaluations still running and log what no row carried yet at the stage's last step."""
        for ref in [r for r, c in self.pending.items() if isinstance(c, EvalCall)]:
            call = self.pending.pop(ref)
            ready, _ = ray.wait([ref], timeout=self.stage.asynchrony.sync_timeout_s, fetch_local=False)
            if ready:
                self._on_evaluated(call, ref)
            else:
                log.warning("stage %r: a held-out evaluation did not end within %g s of the stage's end; it is "
                            "skipped", self.stage.name, self.stage.asynchrony.sync_timeout_s)
        if self.eval_values and self.ctx.log_metrics(self.schedule.policy_version, self.eval_values):
            self.eval_values = {}

    # ------------------------------------------------------------------ reporting and state

    def _report(self, trainer_metrics: dict[str, float], batch_metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        values = step_metrics(self.counters, self.schedule, trainer_metrics, batch_metrics,
                              ray.get(self.buffer.metrics.remote()), now - self._window_start)
        if self.curriculum is not None:
            values.update(self.curriculum.metrics())
        for counts in self.environment_counts:
            for key, counters in counts.items():
                for name, value in counters.items():
                    metric = f"env/{key}/{name}"
                    values[metric] = values.get(metric, 0.0) + value
        step = self.schedule.policy_version
        if self.ctx.log_metrics(step, {**values, **self.eval_values}):
            self.eval_values = {}
        log.info(progress_line(step, self.schedule.end_version, values))
        self._window_start = now
        self.counters.reset_window()

    def _heartbeat(self, every_s: float = 30.0) -> None:
        """While no step completes, say what the buffer sees (e.g. every group dropped as zero-signal)."""
        now = time.perf_counter()
        if now - max(self._last_heartbeat, self._window_start) < every_s:
            return
        self._last_heartbeat = now
        counts = ray.get(self.buffer.counts.remote())
        log.info("waiting for step %d: %s | in flight %d group(s) | skipped %d prompt(s) longer than "
                 "max_prompt_tokens | %s", self.schedule.policy_version + 1,
                 ", ".join(f"{k} {v}" for k, v in counts.items()), self.schedule.in_flight_groups(),
                 self.counters.skipped_long_prompts, self._waiting_for())

    def _waiting_for(self) -> str:
        if self.curriculum is not None and self.curriculum.calibrating:
            return (f"calibrating the difficulty schedulers ({self.curriculum.calibration_groups} group(s) so far; "
                    "nothing is trained until they are calibrated)")
        return "training" if self.schedule.training else "buffer not ready"

    def data_state(self) -> dict:
        """Buffer state and each worker's state as of its last round (asking a worker now could block on
        its round, or fail while Ray restarts it)."""
        state = {"stage": self.stage.name, "buffer": ray.get(self.buffer.state_dict.remote()),
                 "workers": list(self.worker_states)}
        if self.curriculum is not None:
            state["curriculum"] = self.curriculum.state_dict()
        elif self.final_curriculum is not None:  # an earlier stage's, passed on through this one
            state["curriculum"] = self.final_curriculum
        return state

    def _restore(self, state: dict) -> None:
        """Continue from `data_state()` of a checkpoint: buffer counters, frontier and staleness histogram,
        the difficulty schedulers, and each worker's prompt-source position. Buffered and in-flight groups were not saved; the
        workers generate fresh groups in their place (the buffer counts them as discarded_on_resume)."""
        if state.get("stage") != self.stage.name:
            raise ValueError(f"stage {self.stage.name!r}: the checkpoint's data state is of stage {state.get('stage')!r}")
        ray.get(self.buffer.load_state_dict.remote(state["buffer"]))
        if self.curriculum is not None and "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
        elif "curriculum" in state:
            self.final_curriculum = state["curriculum"]
        saved = state["workers"]
        if len(saved) != len(self.workers):
            log.warning("the checkpoint holds the prompt positions of %d rollout worker(s), this run has %d: "
                        "workers without a saved position start their own prompt stream", len(saved),
                        len(self.workers))
        ray.get([w.load_state_dict.remote(s) for w, s in zip(self.workers, saved) if s])
        self.worker_states[:len(saved)] = saved[:len(self.workers)]
        positions = {w: s["prompt_source"]["draws"] for w, s in enumerate(self.worker_states) if s}
        ahead = ray.get(self.buffer.ledger_ahead_of.remote(positions))
        if ahead:
            log.warning("stage %r: %d prompt place(s) of the ledger lie past the restored worker positions; they will "
                        "be drawn again and dropped as repeats", self.stage.name, ahead)
        log.info("stage %r: resumed at trainer step %d (buffer counters and %d worker prompt position(s) "
                 "restored)", self.stage.name, self.schedule.policy_version, min(len(saved), len(self.workers)))

    def _close(self, trainer_ok: bool = True) -> None:
        # Collectives first: ranks must finish a step or a sync before anything else runs on them
        # (not after a trainer failure: the pool is torn down, the surviving ranks may wait forever).
        for call in list(self.pending.values()) if trainer_ok else []:
            if isinstance(call, (TrainCall, TrainerSyncCall)):
                ray.get(list(call.refs[1:]) if isinstance(call, TrainerSyncCall) and call.transport != "collective"
                        else list(call.refs))
        self.pending.clear()
        if trainer_ok:
            ray.get(self.ctx.ranks[0].close_sync.remote())
        self.final_frontier = ray.get(self.buffer.state_dict.remote())["frontier"]
        if self.curriculum is not None:
            self.final_curriculum = self.curriculum.state_dict()
        # In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) leave no shared-memory segments behind:
        # killing the actor process releases everything it held.
        for actor in self.workers + self.verifiers.actors + [self.buffer]:
            ray.kill(actor)
        self.ctx.rollout_pool.actors = []
