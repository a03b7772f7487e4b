"""Runs one RL stage: the asynchronous loop between rollout workers, verifiers, the buffer and trainers.

The driver keeps every call in flight as a Ray object reference and reacts to whichever finishes:
- a rollout *round* returns finished groups → each goes to a verifier (round robin);
- a verification returns rewards → the group is admitted to the buffer;
- when no step is training, the driver asks the buffer for a batch (it releases one only when
  `min_ready_batches` are complete) and sends the same TrainBatch reference to every trainer rank;
- a finished step advances the trainer step (the buffer evicts what became too stale) and, every
  `sync_every_steps`, exports the weights once (rank 0's state dict, by reference) and queues an
  in-place update on every rollout worker: it lands between two rounds, i.e. between engine steps,
  while generation continues (PipelineRL "keep").
Pacing: before each round a worker is given at most the buffer's admission credit of new groups, so
generation does not run ahead of what the trainer can use within the staleness bound. Synchronous
mode (max_staleness_steps = 0) uses the same loop and starts no round while a step trains or syncs.
Faults: a rollout worker that dies is restarted by Ray (its in-flight groups are counted as lost and
it gets the latest weights); a verifier call that exceeds `verifier_timeout_s` scores its group 0
(counted) and the verifier is restarted.
"""

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import ray
from ray.exceptions import ActorDiedError, RayActorError

from zrl.algorithms import SolveRateFrontier
from zrl.buffer import RolloutBuffer
from zrl.config.schema import RLStage
from zrl.pipeline.pools import Pool, light_actor
from zrl.pipeline.rollout_worker import GeneratedGroup, RolloutWorker
from zrl.pipeline.verifier import Verifier
from zrl.types import RolloutGroup, Verification

log = logging.getLogger("zrl")

NUM_VERIFIERS = 2


@dataclass
class StageContext:
    """What a stage needs from the cascade: the trainer pool (already started) and where to write."""

    ranks: list                 # TrainerRank actor handles, all started
    rollout_pool: Pool
    model_path: str
    engine_dtype: str           # "float32" | "bfloat16"
    seed: int
    run_dir: str
    log_metrics: object         # callable(step: int, values: dict) -> None
    checkpoint: object = None   # callable(step: int, data_state: dict) -> None, or None


@dataclass
class _Counters:
    lost_groups: int = 0
    verifier_timeouts: int = 0
    worker_restarts: int = 0
    skipped_long_prompts: int = 0
    generated_tokens: int = 0
    rollout_busy_s: float = 0.0
    train_busy_s: float = 0.0
    sync_s: float = 0.0
    sync_count: int = 0
    extra: Counter = field(default_factory=Counter)


class RLStageRunner:
    def __init__(self, stage: RLStage, ctx: StageContext, start_version: int, resume_step: int | None = None,
                 data_state: dict | None = None, frontier: dict | None = None):
        """Trains steps start_version+1 .. start_version+steps. With `resume_step` and a checkpoint's
        `data_state` (the ranks already hold its weights) it continues after `resume_step`. `frontier`:
        the running max solve rates a previous stage ended with (recipe `inherit.length_reward_state`)."""
        self.stage, self.ctx = stage, ctx
        self.step = start_version if resume_step is None else resume_step
        self.end_step = start_version + stage.steps
        self.sync_mode = stage.asynchrony.max_staleness_steps == 0
        self.counters = _Counters()
        n = ctx.rollout_pool.size
        self.workers = [self._start_worker(i) for i in range(n)]
        ctx.rollout_pool.actors = self.workers
        self.worker_version = [self.step] * n
        self.in_engine = [0] * n
        self.worker_states: list[dict] = [{} for _ in range(n)]  # from each worker's latest round
        inherited = SolveRateFrontier()
        inherited.load_state_dict(frontier or {})
        self.buffer = light_actor(RolloutBuffer, stage.asynchrony, stage.algorithm, stage.sampling,
                                  stage_steps=stage.steps, first_step=start_version, frontier=inherited)
        self.final_frontier: dict = dict(frontier or {})  # set from the buffer when the stage closes
        self.verifiers = [light_actor(Verifier, stage.environments, max_restarts=-1) for _ in range(NUM_VERIFIERS)]
        self.rounds: dict = {}       # ref -> worker index
        self.verifying: dict = {}    # ref -> (GeneratedGroup, started, verifier index, retried)
        self.training: list | None = None
        self.syncs: dict = {}        # ref -> worker index
        self.latest_weights = None   # object ref of the last exported state dict
        self.latest_version = self.step
        self._restarted: set[int] = set()  # workers restarted and not yet back in sync
        self._next_verifier = 0
        self._window_start = time.perf_counter()
        self._train_started = 0.0
        self._last_heartbeat = time.perf_counter()
        if data_state is not None:
            self._restore(data_state)

    # ------------------------------------------------------------------ set-up

    def _start_worker(self, index: int):
        ctx, pool = self.ctx, self.ctx.rollout_pool
        actor = ray.remote(RolloutWorker).options(**pool.options(index, max_restarts=1, max_task_retries=0))
        return actor.remote(index, ctx.model_path, self.stage, ctx.seed, ctx.engine_dtype, initial_version=self.step)

    def _sync_weights(self, workers: list[int]) -> None:
        for w in workers:
            ref = self.workers[w].update_weights.remote(self.latest_weights, self.latest_version)
            self.syncs[ref] = w

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        # Start from the trainer's weights (they may differ from model_path after an earlier stage).
        self.latest_weights = self.ctx.ranks[0].export_state.remote(self.ctx.engine_dtype)
        others = [r.export_state.remote(self.ctx.engine_dtype) for r in self.ctx.ranks[1:]]
        self._sync_weights(range(len(self.workers)))
        ray.get(others)
        log.info("stage %r: %d RL steps from trainer step %d (%s mode)", self.stage.name, self.end_step - self.step,
                 self.step, "synchronous" if self.sync_mode else "asynchronous")
        try:
            while self.step < self.end_step:
                self._launch_rounds()
                self._maybe_train()
                self._wait_and_handle()
                self._expire_verifications()
                self._heartbeat()
        finally:
            self._close()
        return self.step

    def _in_flight_groups(self) -> int:
        return sum(self.in_engine) + len(self.verifying)

    def _launch_rounds(self) -> None:
        busy = set(self.rounds.values()) | set(self.syncs.values())
        paused = self.sync_mode and (self.training is not None or self.syncs)
        for w in range(len(self.workers)):
            if w in busy:
                continue
            new = 0
            if not paused:
                credit = ray.get(self.buffer.admission_credit.remote(self._in_flight_groups(),
                                                                     self.worker_version[w]))
                new = min(credit, self.stage.sampling.prompts_per_batch)
            if new == 0 and self.in_engine[w] == 0:
                continue
            self.in_engine[w] += new
            self.rounds[self.workers[w].round.remote(new)] = w

    def _maybe_train(self) -> None:
        if self.training is not None or (self.sync_mode and self.syncs):
            return
        batch = ray.get(self.buffer.take_batch.remote(self.step))
        if batch is None:
            return
        batch_ref = ray.put(batch)
        self._train_started = time.perf_counter()
        self.training = [rank.train_step.remote(batch_ref) for rank in self.ctx.ranks]

    def _wait_and_handle(self) -> None:
        pending = list(self.rounds) + list(self.verifying) + list(self.syncs) + (self.training or [])
        if not pending:
            time.sleep(0.05)
            return
        ready, _ = ray.wait(pending, num_returns=1, timeout=0.2)
        for ref in ready:
            if ref in self.rounds:
                self._on_round(ref)
            elif ref in self.verifying:
                self._on_verified(ref)
            elif ref in self.syncs:
                self._on_synced(ref)
        if self.training is not None:
            done, _ = ray.wait(self.training, num_returns=len(self.training), timeout=0)
            if len(done) == len(self.training):
                self._on_trained()

    def _on_round(self, ref) -> None:
        w = self.rounds.pop(ref)
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            self._worker_failed(w, exc)
            return
        self.in_engine[w] = result.in_flight_groups
        self.worker_states[w] = result.state
        self.worker_version[w] = result.version
        self.counters.generated_tokens += result.generated_tokens
        self.counters.rollout_busy_s += result.busy_s
        self.counters.skipped_long_prompts += result.skipped_long_prompts
        self.counters.extra.update(result.canary_sums)
        self.counters.extra["rollouts_generated"] += sum(len(g.rollouts) for g in result.groups)
        for group in result.groups:
            self._verify(group)

    def _verify(self, group: GeneratedGroup, retried: bool = False) -> None:
        v = self._next_verifier
        self._next_verifier = (v + 1) % len(self.verifiers)
        ref = self.verifiers[v].verify.remote(group.prompt, [r.text for r in group.rollouts])
        self.verifying[ref] = (group, time.perf_counter(), v, retried)

    def _on_verified(self, ref) -> None:
        group, _, _, retried = self.verifying.pop(ref)
        try:
            verifications = ray.get(ref)
        except RayActorError:
            if not retried:  # its verifier was restarted under it: try once more elsewhere
                self._verify(group, retried=True)
                return
            verifications = tuple(Verification(0.0, error="verifier died") for _ in group.rollouts)
        self._admit(group, verifications)

    def _admit(self, group: GeneratedGroup, verifications) -> None:
        rollout_group = RolloutGroup(group_id=group.group_id, prompt=group.prompt, rollouts=group.rollouts,
                                     verifications=tuple(verifications))
        ray.get(self.buffer.admit.remote(rollout_group))

    def _expire_verifications(self) -> None:
        timeout = self.stage.asynchrony.verifier_timeout_s
        now = time.perf_counter()
        for ref, (group, started, v, _) in list(self.verifying.items()):
            if now - started > timeout:
                del self.verifying[ref]
                self.counters.verifier_timeouts += 1
                log.warning("verifier call for group %s exceeded %.0f s: reward 0, restarting the verifier",
                            group.group_id, timeout)
                ray.kill(self.verifiers[v], no_restart=False)
                self._admit(group, [Verification(0.0, error=f"timeout after {timeout:g} s")] * len(group.rollouts))

    def _on_trained(self) -> None:
        metrics = ray.get(self.training[0])
        self.training = None
        self.counters.train_busy_s += time.perf_counter() - self._train_started
        self.step += 1
        ray.get(self.buffer.set_trainer_step.remote(self.step))
        sync_every = self.stage.asynchrony.sync_every_steps
        if self.step % sync_every == 0 and self.step < self.end_step:
            started = time.perf_counter()
            exports = [r.export_state.remote(self.ctx.engine_dtype) for r in self.ctx.ranks]
            self.latest_weights, self.latest_version = exports[0], self.step
            self._sync_weights(range(len(self.workers)))
            ray.get(exports)
            self.counters.sync_s += time.perf_counter() - started
            self.counters.sync_count += 1
        self._report(metrics)
        if self.ctx.checkpoint and (self.step % self.stage.checkpoint_every_steps == 0 or self.step == self.end_step):
            self.ctx.checkpoint(self.step, self.data_state())

    def _worker_failed(self, w: int, exc: RayActorError) -> None:
        if isinstance(exc, ActorDiedError) and w in self._restarted:
            raise RuntimeError(f"rollout worker {w} died again after a restart; giving up on the stage") from exc
        if w not in self._restarted:
            log.warning("rollout worker %d died; %d in-flight group(s) lost, Ray restarts it", w, self.in_engine[w])
            self._restarted.add(w)
            self.counters.lost_groups += self.in_engine[w]
            self.counters.worker_restarts += 1
            self.in_engine[w] = 0
        self.worker_version[w] = -1  # unknown until the restarted engine has the latest weights
        if w not in self.syncs.values():
            self._sync_weights([w])

    def _on_synced(self, ref) -> None:
        w = self.syncs.pop(ref)
        try:
            stats = ray.get(ref)
        except RayActorError as exc:  # the worker died or is restarting: sync it again once it is back
            self._worker_failed(w, exc)
            return
        self._restarted.discard(w)
        self.worker_version[w] = int(stats["sync/version"])
        self.counters.extra["sync/engine_update_s"] = stats["sync/update_s"]  # the latest in-place load

    # ------------------------------------------------------------------ reporting and state

    def _report(self, trainer_metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        window = max(now - self._window_start, 1e-9)
        c = self.counters
        values = dict(trainer_metrics)
        values.update(ray.get(self.buffer.metrics.remote()))
        values.update({
            "throughput/rollout_tokens_per_s": c.generated_tokens / window,
            "throughput/rollout_idle_frac": max(0.0, 1 - c.rollout_busy_s / (window * len(self.workers))),
            "throughput/trainer_idle_frac": max(0.0, 1 - c.train_busy_s / window),
            "sync/time_s": c.sync_s / max(c.sync_count, 1), "sync/count": float(c.sync_count),
            "sync/worker_version_min": float(min(self.worker_version)),
            "faults/lost_groups": float(c.lost_groups), "faults/worker_restarts": float(c.worker_restarts),
            "faults/verifier_timeouts": float(c.verifier_timeouts),
            "rollout/skipped_long_prompts": float(c.skipped_long_prompts),
            "rollout/in_flight_groups": float(self._in_flight_groups()),
            "sync/engine_update_s": float(c.extra.get("sync/engine_update_s", 0.0)),
        })
        rollouts = c.extra.pop("rollouts_generated", 0)
        for key in [k for k in c.extra if k.startswith("canary/")]:
            total = c.extra.pop(key)
            if rollouts:
                values[key] = total / rollouts
        self.ctx.log_metrics(self.step, values)
        log.info("step %d/%d | reward %.3f | loss %.4f | staleness max %d | buffered %d | gen %.0f tok/s | "
                 "train %.0f tok/s | sync %.2f s | idle rollout %.0f%% trainer %.0f%%",
                 self.step, self.end_step, values.get("reward/mean", float("nan")), values.get("loss/policy", float("nan")),
                 int(values.get("staleness/max", 0)), int(values.get("buffer/occupancy", 0)),
                 values["throughput/rollout_tokens_per_s"], values.get("perf/tokens_per_s", 0.0),
                 values["sync/time_s"], 100 * values["throughput/rollout_idle_frac"],
                 100 * values["throughput/trainer_idle_frac"])
        self._window_start = now
        c.generated_tokens, c.rollout_busy_s, c.train_busy_s = 0, 0.0, 0.0

    def _heartbeat(self, every_s: float = 30.0) -> None:
        """While no step completes, say what the buffer sees (e.g. every group dropped as zero-signal)."""
        now = time.perf_counter()
        if now - max(self._last_heartbeat, self._window_start) < every_s:
            return
        self._last_heartbeat = now
        counts = ray.get(self.buffer.counts.remote())
        log.info("waiting for step %d: %s | in flight %d group(s) | %s", self.step + 1,
                 ", ".join(f"{k} {v}" for k, v in counts.items()), self._in_flight_groups(),
                 "training" if self.training is not None else "buffer not ready")

    def data_state(self) -> dict:
        """Buffer state and each worker's state as of its last round (asking a worker now could block on
        its round, or fail while Ray restarts it)."""
        return {"stage": self.stage.name, "buffer": ray.get(self.buffer.state_dict.remote()),
                "workers": list(self.worker_states)}

    def _restore(self, state: dict) -> None:
        """Continue from `data_state()` of a checkpoint: buffer counters, frontier and staleness histogram,
        and each worker's prompt-source position. Buffered and in-flight groups were not saved; the
        workers generate fresh groups in their place (the buffer counts them as discarded_on_resume)."""
        if state.get("stage") != self.stage.name:
            raise ValueError(f"stage {self.stage.name!r}: the checkpoint's data state is of stage {state.get('stage')!r}")
        ray.get(self.buffer.load_state_dict.remote(state["buffer"]))
        saved = state["workers"]
        if len(saved) != len(self.workers):
            log.warning("the checkpoint holds the prompt positions of %d rollout worker(s), this run has %d: "
                        "workers without a saved position start their own prompt stream", len(saved),
                        len(self.workers))
        ray.get([w.load_state_dict.remote(s) for w, s in zip(self.workers, saved) if s])
        self.worker_states[:len(saved)] = saved[:len(self.workers)]
        log.info("stage %r: resumed at trainer step %d (buffer counters and %d worker prompt position(s) "
                 "restored)", self.stage.name, self.step, min(len(saved), len(self.workers)))

    def _close(self) -> None:
        if self.training is not None:
            ray.get(self.training)  # ranks must finish their collectives before anything else runs
            self.training = None
        self.final_frontier = ray.get(self.buffer.state_dict.remote())["frontier"]
        # In-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) leave no shared-memory segments behind:
        # killing the actor process releases everything it held.
        for actor in self.workers + self.verifiers + [self.buffer]:
            ray.kill(actor)
        self.ctx.rollout_pool.actors = []
