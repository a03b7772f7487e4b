"""Runs one RL stage: the Ray transport of the asynchronous loop between rollout workers, verifiers,
the buffer and the trainer ranks.

`StageSchedule` (schedule.py) decides what to start; this module carries out its requests as Ray calls
(one handler per request type, `HANDLERS`), keeps every call in flight as a named record (`RoundCall`,
`VerifyCall`, ...; stage_calls.py) keyed by its object reference, and gives what finished back to the
schedule as its answers. Nothing here waits on a single call except stage set-up, checkpoints and the
once-per-step metrics. Its parts: a group's verification and admission stage_admission.py, weight syncs
sync_coordinator.py, worker restarts worker_restarts.py, reporting stage_report.py, the checkpointed
data state stage_state.py, evaluations during training held_out.py.

Data plane (stage_calls.py): the driver sees ids, counts, versions and metrics only; every value it
does fetch goes through `_fetch`, which counts rollout-array bytes in it (expected to stay 0).

Adaptive difficulty (zrl/pipeline/stage_curriculum.py): the driver owns the stage's difficulty
schedulers; every round it launches carries the adaptive entries' current levels, and every verified
group drawn at one is reported to them before it goes to the buffer (while they calibrate, instead).

Faults (the stop reasons: zrl/pipeline/faults.py): a rollout worker that dies is restarted, its
engine's groups lost, and every worker synced again (worker_restarts.py); a failed sync is retried
(sync_coordinator.py); verifier faults cost rewards, not groups (stage_admission.py); a trainer rank
that fails raises TrainerFailed naming the rank (the run restarts the trainer pool from the latest
checkpoint, zrl/run.py); `ProgressWatchdog` stops the stage when no step completes in
`progress_timeout_s` or every recent group was discarded; a SIGINT/SIGTERM stops it at the next step
boundary after a checkpoint; a held-out evaluation that fails is logged and skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from zrl.algorithms import SolveRateFrontier
from zrl.buffer import RolloutBuffer
from zrl.config.schema import RLStage
from zrl.env.base import EnvironmentFault
from zrl.pipeline import stage_state
from zrl.pipeline.faults import (RANK_FAILURE_GRACE_S, ProgressWatchdog, StageStopped, StopRequest, TrainerFailed,
                                 raise_if_stop_requested, reason_of, trainer_results)
from zrl.pipeline.health import HealthMonitor, baseline_from_metrics
from zrl.pipeline.held_out import InTrainingEvaluations
from zrl.pipeline.pools import Pool
from zrl.pipeline.rollout_worker import RolloutWorker
from zrl.pipeline.schedule import (AskBatch, AskCredit, BatchAnswer, CreditAnswer, LaunchRound, Request, RoundDone,
                                   StageSchedule, StartSync, StepDone, WorkerLost, WorkerSynced)
from zrl.pipeline.stage_admission import StageAdmission
from zrl.pipeline.stage_calls import (AdmitCall, CheckedCall, CreditCall, EvalCall, ReleaseCall, RoundCall,
                                      TrainCall, TrainerSyncCall, VerifyCall, WorkerSyncCall, call_errors,
                                      rollout_bytes_in)
from zrl.pipeline.stage_curriculum import StageCurriculum, adaptive_entries
from zrl.pipeline.stage_report import StageCounters, StageReporter, counts_line, log_ledger
from zrl.pipeline.sync_coordinator import SyncCoordinator
from zrl.pipeline.verifier_pool import VerifierPool
from zrl.pipeline.worker_restarts import WorkerRestarts
from zrl.prompts import build_entries
from zrl.run_dir import RunDir
from zrl.runtime_env import light_actor

log = logging.getLogger("zrl")


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
    engine_max_model_len: int | None = None  # the rollout engines' (None: the stage's prompt + response limit)
    max_worker_restarts: int | None = None   # Ray's restarts of a rollout worker in its life (None: the stage's)
    weight_sync: object = None  # serving.lora_sync.SyncChoice of the run (None: full weights)
    engine_lora: dict | None = None  # the rollout engines' vLLM LoRA arguments (adapter-only sync), else None


def start_rollout_worker(ctx: StageContext, stage: RLStage, index: int, policy_version: int):
    """Rollout worker `index` of `stage` in its bundle of the rollout pool (its engine starts)."""
    return ctx.rollout_pool.actor(RolloutWorker, index, index, ctx.model_path, stage, ctx.seed, ctx.engine_dtype,
                                  policy_version=policy_version, kernels=ctx.kernels, publish=ray.put,
                                  prefix_caching=ctx.prefix_caching, max_model_len=ctx.engine_max_model_len,
                                  engine_lora=ctx.engine_lora,
                                  max_restarts=(stage.asynchrony.max_worker_restarts if ctx.max_worker_restarts is None
                                                else ctx.max_worker_restarts))


class RLStageRunner:
    def __init__(self, stage: RLStage, ctx: StageContext, first_step: int, resume_step: int | None = None,
                 data_state: dict | None = None, frontier: dict | None = None, curriculum: dict | None = None,
                 rollbacks: int = 0, carried: dict | None = None):
        """Trains the stage's steps from trainer step `first_step` (or, with a checkpoint's
        `data_state`, from `resume_step`, the ranks already holding its weights). `frontier`: the
        running max solve rates a previous stage ended with (recipe `inherit.length_reward_state`);
        `curriculum`: the previous stage's difficulty-scheduler state (recipe `inherit.curriculum`);
        `rollbacks`: the rollbacks the run made in this stage already (zrl/pipeline/health.py);
        `carried`: {worker index: RolloutWorker actor} kept from the previous stage, its engine up (the
        others are started)."""
        self.stage, self.ctx = stage, ctx
        a = stage.asynchrony
        step = first_step if resume_step is None else resume_step
        n = ctx.rollout_pool.size
        self.schedule = StageSchedule(num_workers=n, trainer_step=step, end_step=first_step + stage.steps,
                                      prompts_per_batch=stage.sampling.prompts_per_batch,
                                      sync_every_steps=a.sync_every_steps, synchronous=a.max_staleness_steps == 0)
        self.counters = StageCounters()
        self.carried = self._take_over(dict(carried or {}))
        self.workers = [self.carried[i] if i in self.carried else start_rollout_worker(ctx, stage, i, step)
                        for i in range(n)]
        ctx.rollout_pool.actors = self.workers
        self.worker_states: list[dict] = [{} for _ in range(n)]  # from each worker's latest round
        self.environment_counts: list[dict] = [{} for _ in range(n)]  # ... and its environments' counters
        self.restarts = WorkerRestarts(stage.name, n, a.max_worker_restarts, a.sync_timeout_s)
        inherited = SolveRateFrontier()
        inherited.load_state_dict(frontier or {})
        self.buffer = light_actor(RolloutBuffer, stage.asynchrony, stage.algorithm, stage.sampling,
                                  stage_steps=stage.steps, first_version=first_step, frontier=inherited)
        self.final_frontier: dict = dict(frontier or {})  # set from the buffer when the stage closes
        # only the adaptive entries' environments are built here (their levels and tasks)
        adaptive = adaptive_entries(build_entries([e for e in stage.environments if e.difficulty == "adaptive"]))
        self.curriculum = StageCurriculum(adaptive, seed=ctx.seed) if adaptive else None
        taken = self.curriculum.inherit(curriculum) if self.curriculum is not None and curriculum else []
        # what the stage took from the previous one (recorded in its stage record)
        self.inherited = {"length_reward_frontier": sorted(frontier or {}), "curriculum": taken}
        self.final_curriculum: dict | None = curriculum  # set when the stage closes, when it has adaptive entries
        self.kept_workers: dict = {}  # set when the stage ends: {index: worker} of those that never died, engines up
        self.verifiers = VerifierPool(stage.environments, a.verifier_timeout_s, ctx.verifier_workers,
                                      ctx.cpus_per_verifier_worker)
        self.watchdog = ProgressWatchdog(a.progress_timeout_s, a.max_discarded_batches * stage.sampling.prompts_per_batch)
        self.last_checkpoint = resume_step                 # trainer step of the stage's newest checkpoint
        self.pending: dict = {}     # object reference -> the call record above
        self.sync = SyncCoordinator(stage.name, a, ctx, self.workers, self.counters, self.pending, self._fetch,
                                    self.restarts.next_seq)
        self.admission = StageAdmission(self.schedule, self.verifiers, self.buffer, self.curriculum, self.watchdog,
                                        self.counters, self.pending, self._fetch)
        self.reporter = StageReporter(stage.name, stage.steps, self.counters, ctx.log_metrics, self.curriculum)
        self.evaluations = InTrainingEvaluations(stage, step, first_step + stage.steps, ctx.evaluation_seed)
        layout = RunDir(ctx.run_dir)
        self.reporter.health = HealthMonitor(
            stage.name, stage.health, eval_samples=stage.evaluation.prompts * stage.evaluation.samples,
            start_version=step, alarms_path=layout.alarms, rollbacks=rollbacks,
            baseline=baseline_from_metrics(layout.metrics, first_step) if resume_step is not None else None)
        if data_state is not None:
            passed_on = stage_state.restore(stage.name, data_state, self.buffer, self.workers, self.worker_states,
                                            self.curriculum, step)
            self.final_curriculum = passed_on if passed_on is not None else self.final_curriculum

    def _take_over(self, carried: dict) -> dict:
        """The carried workers that began this stage; one that fails to (it died between the stages) is
        killed, and its place gets a fresh worker."""
        refs = {i: w.begin_stage.remote(self.stage, self.ctx.seed) for i, w in carried.items()}
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except RayActorError as exc:
                log.warning("stage %r: rollout worker %d of the previous stage could not take this stage over (%s); "
                            "starting a fresh one", self.stage.name, i, reason_of(exc))
                ray.kill(carried.pop(i))
        return carried

    def data_state(self) -> dict:
        """What a checkpoint saves beside the weights (zrl/pipeline/stage_state.py)."""
        return stage_state.data_state(self.stage.name, self.buffer, self.worker_states, self.curriculum,
                                      self.final_curriculum)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        s = self.schedule
        log.info("stage %r: %d RL steps from trainer step %d (%s mode, weight sync: %s, %s)", self.stage.name,
                 s.end_step - s.trainer_step, s.trainer_step,
                 "synchronous" if s.synchronous else "asynchronous", self.counters.sync_transport,
                 self.counters.sync_mode)
        trainer_ok = True
        try:
            self._carry_out(s.start())  # start from the trainer's weights (they differ from model_path after a stage)
            self.watchdog.step_done()
            while not s.done:
                self._carry_out(s.next_requests())
                self._wait_and_handle()
                self.admission.expire_verifications()
                if self.reporter.heartbeat_due():
                    self.reporter.heartbeat(s, ray.get(self.buffer.counts.remote()))
                self._check_progress()
            self._finish_evaluations()
            log_ledger(self.stage.name, ray.get(self.buffer.counts.remote()), s.lost_groups)
            self.kept_workers = {i: w for i, w in enumerate(self.workers) if not self.restarts.deaths[i]}
        except TrainerFailed:
            trainer_ok = False
            raise
        finally:
            self._close(trainer_ok)
        return s.trainer_step

    def _check_progress(self) -> None:
        """Stop on a signal (at a step boundary, after a checkpoint), on an alarm that asks for it
        (health.on_alarm) or when the stage cannot progress."""
        if StopRequest.requested() and not self.schedule.training:
            raise_if_stop_requested(self.schedule.trainer_step, self._checkpoint_now)
        stop = self.reporter.health.stop_request()
        if stop is not None:
            raise stop
        reason = self.watchdog.reason()
        if reason is not None:
            counts = counts_line(ray.get(self.buffer.counts.remote()), self.schedule)
            raise StageStopped(f"stage {self.stage.name!r} stopped: {reason}; {counts}")

    def _checkpoint_now(self, step: int) -> None:
        if self.ctx.checkpoint and step != self.last_checkpoint and step > self.schedule.end_step - self.stage.steps:
            self.ctx.checkpoint(step, self.data_state())
            self.last_checkpoint = step

    def _carry_out(self, requests: list[Request]) -> None:
        for request in requests:
            self.HANDLERS[type(request)](self, request)

    def _wait_and_handle(self) -> None:
        if not self.pending:
            time.sleep(0.05)
            return
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.2, fetch_local=False)
        for ref in ready:
            call = self.pending.pop(ref)
            handler = {RoundCall: self._on_round, VerifyCall: self.admission.on_verified,
                       AdmitCall: self.admission.on_admitted, CreditCall: self._on_credit,
                       ReleaseCall: self._on_released, TrainCall: self._on_trained,
                       TrainerSyncCall: self._on_trainer_synced, WorkerSyncCall: self._on_worker_synced,
                       EvalCall: self._on_evaluated, CheckedCall: lambda call, ref: self._fetch(ref)}[type(call)]
            handler(call, ref)

    def _fetch(self, ref):
        """ray.get, counting the rollout-array bytes of what came back (the data plane keeps it at 0)."""
        value = ray.get(ref)
        self.counters.driver_array_bytes += rollout_bytes_in(value)
        return value

    # ------------------------------------------------------------------ rounds and verification

    def _launch(self, request: LaunchRound) -> None:
        levels = self.curriculum.assignments(request.new_groups) if self.curriculum is not None else None
        ref = self.workers[request.worker].round.remote(request.new_groups, levels)
        self.pending[ref] = RoundCall(request.worker, self.restarts.next_seq())

    def _ask_credit(self, request: AskCredit) -> None:
        ref = self.buffer.admission_credit.remote(request.in_flight_groups, request.generating_version)
        self.pending[ref] = CreditCall()

    def _on_credit(self, call: CreditCall, ref) -> None:
        self._carry_out(self.schedule.take(CreditAnswer(self._fetch(ref))))

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
        self.schedule.take(RoundDone(call.worker, len(report.tickets), report.in_flight_groups, report.policy_version))
        self.worker_states[call.worker] = report.state
        self.environment_counts[call.worker] = report.environment_counts
        self.counters.add_round(report)
        self.watchdog.prompts_skipped(report.skipped_long_prompts)
        for key, level in report.skipped_levels:  # a problem too long to pose is one the policy cannot solve
            self.curriculum.report_unposable(key, level, self.stage.sampling.group_size)
        for ticket in report.tickets:
            self.admission.verify(ticket)

    # ------------------------------------------------------------------ training and weight sync

    def _ask_batch(self, request: AskBatch) -> None:
        world = len(self.ctx.ranks)
        refs = self.buffer.release.options(num_returns=1 + world).remote(request.trainer_step, world,
                                                                          self.ctx.token_budget)
        self.pending[refs[0]] = ReleaseCall(tuple(refs[1:]))

    def _on_released(self, call: ReleaseCall, ref) -> None:
        ticket = self._fetch(ref)
        self.schedule.take(BatchAnswer(ticket is not None))
        if ticket is None:
            return
        refs = tuple(rank.train_step.remote(share) for rank, share in zip(self.ctx.ranks, call.shares))
        train = TrainCall(refs, time.perf_counter(), dict(ticket.metrics))
        for ref in refs:  # every rank's: a rank that fails is noticed while the others hang in a collective
            self.pending[ref] = train

    def _on_trained(self, call: TrainCall, ref) -> None:
        what = f"step {self.schedule.trainer_step + 1}"
        if call_errors([ref]):  # the other ranks cannot finish the step: give them a moment to fail too
            trainer_results(call.refs, what, self._fetch, timeout_s=RANK_FAILURE_GRACE_S)
        if any(r in self.pending for r in call.refs):
            return  # the step ends when every rank has returned
        metrics = trainer_results(call.refs, what, self._fetch)[0]
        self.counters.train_busy_s += time.perf_counter() - call.started
        s = self.schedule
        requests = s.take(StepDone())
        self.watchdog.step_done()
        self.pending[self.buffer.set_trainer_step.remote(s.trainer_step)] = CheckedCall("buffer.set_trainer_step")
        self._carry_out(requests)
        self.reporter.step(time.perf_counter(), s, metrics, call.batch_metrics, ray.get(self.buffer.metrics.remote()),
                           self.environment_counts)
        step = s.trainer_step
        if step % self.stage.checkpoint_every_steps == 0 or s.done:
            self._checkpoint_now(step)

    def _on_trainer_synced(self, call: TrainerSyncCall, ref) -> None:
        self.schedule.take(self.sync.trainer_synced(call))

    def _on_worker_synced(self, call: WorkerSyncCall, ref) -> None:
        try:
            received = self._fetch(ref)
        except RayActorError as exc:
            self._worker_failed(call.worker, call.seq, exc)
            return
        except RayTaskError as exc:  # the collective failed or timed out (a member died)
            self.sync.failed(f"rollout worker {call.worker}", exc)
            self.schedule.take(WorkerSynced(call.worker, None))
            return
        self.schedule.take(WorkerSynced(call.worker, received.policy_version))
        ref = self.evaluations.after_sync(self.workers[call.worker], received.policy_version)
        if ref is not None:
            self.pending[ref] = EvalCall(call.worker, self.restarts.next_seq())
        self.sync.worker_synced(received)

    def _worker_failed(self, w: int, seq: int, exc: RayActorError) -> None:
        if not self.restarts.died(w, seq, exc):
            return
        lost = self.schedule.workers[w].groups_in_engine
        self.schedule.take(WorkerLost(w))
        self.restarts.handled(w, lost)
        self.restarts.await_restart(w, self.workers[w])
        if w in self.carried:  # Ray restarted it with the arguments of the stage that started it
            ray.get(self.workers[w].begin_stage.remote(self.stage, self.ctx.seed))
        if self.worker_states[w]:  # the restarted worker continues its prompt stream, not from draw 0
            ray.get(self.workers[w].load_state_dict.remote(self.worker_states[w]))
        self.sync.worker_restarted()

    def _start_sync(self, request: StartSync) -> None:
        self.sync.start(request)

    HANDLERS = {AskCredit: _ask_credit, LaunchRound: _launch, AskBatch: _ask_batch, StartSync: _start_sync}

    # ------------------------------------------------------------------ held-out evaluation and the end

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
        self.reporter.evaluated(report, call.worker)

    def _finish_evaluations(self) -> None:
        """Await the evaluations still running and log what no row carried yet at the stage's last step."""
        for call, ref in self.evaluations.ended(self.pending):
            self._on_evaluated(call, ref)
        self.reporter.flush_evaluation(self.schedule.trainer_step)

    def _close(self, trainer_ok: bool = True) -> None:
        # Collectives first: ranks must finish a step or a sync before anything else runs on them
        # (not after a trainer failure: the pool is torn down, the surviving ranks may wait forever).
        for call in list(self.pending.values()) if trainer_ok else []:
            if isinstance(call, TrainCall):
                ray.get(list(call.refs))
            elif isinstance(call, TrainerSyncCall):
                ray.get(list(call.transport.fetchable(call.refs)))
        self.pending.clear()
        if trainer_ok:
            self.sync.close()
        self.final_frontier = ray.get(self.buffer.state_dict.remote())["frontier"]
        if self.curriculum is not None:
            self.final_curriculum = self.curriculum.state_dict()
        # In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) leave no shared-memory segments behind:
        # killing the actor process releases everything it held. A stage that ended keeps the workers that
        # never died (and their engines): worker 0 evaluates its export, and the next RL stage takes them
        # over (zrl/pipeline/controller.py); the pool's release kills them at the latest.
        kept = list(self.kept_workers.values())
        for actor in [w for w in self.workers if w not in kept] + self.verifiers.actors + [self.buffer]:
            ray.kill(actor)
        self.ctx.rollout_pool.actors = kept
