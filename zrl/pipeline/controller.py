"""The cascade controller: reserves the pools, starts the trainer ranks once, runs the stages in order.

The trainer pool (one FSDP2 process group) lives for the whole cascade, so each stage starts from the previous
stage's final policy in memory; where a stage switches between full fine-tuning and `model.lora`'s adapters
(the stage's `lora`), the ranks rebuild their model on the previous stage's export instead (a LoRA stage's
base is that export, `Recipe.trainer_base`; a resume into such a stage starts there too). At the end of every
stage the policy is written as a Hugging Face checkpoint of the model's family
(`<output_dir>/stages/<name>/hf`; in a stage that trains adapters, with them merged, and the adapters alone as
a PEFT directory, `stages/<name>/adapter`); the stage's `evaluation` (held-out accuracy of that export per
entry) and `self_rollouts` files (its samples on an entry's training problems, the rollouts of a later stage's
aggregation entries), both from one engine on the rollout pool's first bundle; a summary figure of the stage's
metrics (`stages/<name>/summary.png`, zrl/plots.py) and, last, the stage record `stages/<name>/stage.json`:
bounds, wall time, evaluation, what the stage took from the previous one (`inherited`: the length-reward
frontier's sources, the curriculum keys taken over) and what it hands on (`handoff`). With
`evaluation.every_steps` the export's held-out accuracy is also logged at the stage's last step (before the
plot), the end of the curve the RL stage logged during training (zrl/pipeline/held_out.py). After the last
stage, `cascade_report.html` (zrl/cascade_report.py). Every path of the run directory is named in
zrl/run_dir.py.
Rollout workers outlive their stage: the workers of an RL stage that never died are kept with their
engines (sized for the recipe's longest RL stage), worker 0 evaluates the stage's export, and the next
RL stage takes them over (`RolloutWorker.begin_stage`: its own prompt stream and seeds, the same
engine); a stage that is not followed by an RL stage stops them. Before an RL stage that follows an SFT
stage, its worker 0 starts early and evaluates the SFT stage's export. An engine start on a GPU node
takes minutes; consecutive RL stages pay it once. Every stage's workers get the trainer's weights before
they generate. Checkpoints (torch.distributed.checkpoint, any number of ranks) go to
`<output_dir>/checkpoints/step_XXXXXX`, with `latest.json` {stage, step, path} naming the newest complete
one (written atomically after every rank has saved). Shutdown is the same on success, error and Ctrl-C:
trainer ranks leave their process group, every actor is killed, both placement groups are removed.

Resume (`zrl run --resume`, a `ResumePoint` read from latest.json at trainer step s in stage k):
- Stage boundaries are fixed by the recipe: stage i covers trainer steps first_i+1 .. last_i with
  first_i = the steps of the stages before it and last_i = first_i + steps_i.
- A stage is *finished* when the checkpoint step is at or past its last step and its stage record
  exists (the record is written after the HF export and the plot, so it marks a complete export).
  Stages before k are finished by construction (stage k only starts after stage k-1's record); their
  records are checked and a missing one is reported, not rebuilt (their final weights are gone).
- The trainer ranks start with stage k's settings and load the checkpoint (model, optimizer moments,
  LR schedule, RNG; DCP reshards to any rank count). If s < last_k, stage k continues from step s with
  its data state restored: the SFT prompt-source draws, or the RL buffer's counters, frontier and
  staleness histogram, the difficulty schedulers and each rollout worker's prompt-source position (buffered and in-flight groups
  were not saved: fresh groups are generated in their place). If s == last_k and stage k has no
  record, only its end is redone (export, plot, record: the weights are the checkpoint's). Later stages
  then run as in an uninterrupted cascade (`set_settings` with their `inherit` rule).
- What the interrupted run did after step s is forgotten before anything starts: metric rows with a
  later step are dropped from metrics.jsonl (and a line the kill cut short), and checkpoint
  directories of later steps (incomplete by the atomicity of latest.json) are removed. TensorBoard
  gets a purge marker (a SessionLog START event at step s+1 in its own event file, written before the
  resumed run's file): its reader then drops the interrupted run's events from step s+1 on. wandb
  keeps one run id per run directory (`wandb_run_id`), so an offline resumed run syncs into the same
  run; wandb ignores steps it already has, so for the steps between s and the interruption it keeps
  the values the interrupted run logged.
- A rollback (an alarm with `health.on_alarm: rollback`, zrl/pipeline/health.py) is a resume from the newest
  checkpoint at or before the alarm's last healthy step; the rolled-back RL stage's seed moves on by
  ROLLBACK_SEED_STRIDE per rollback recorded in alarms.jsonl, so its prompts and samples differ from the
  steps that led to the alarm.
"""

import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
from ray.exceptions import RayError

from zrl.cascade_report import write_cascade_report
from zrl.config.schema import Recipe, RLStage
from zrl.env import registry
from zrl.evaluate import EvalRequest, EvalResult
from zrl.metrics import MetricsLogger
from zrl.models import family_of_checkpoint
from zrl.pipeline.faults import RANK_FAILURE_GRACE_S, reason_of, trainer_results
from zrl.pipeline.health import ROLLBACK_SEED_STRIDE, rollbacks_made
from zrl.pipeline.held_out import held_out_metrics, held_out_requests
from zrl.pipeline.pools import Pool, release, reserve_pools
from zrl.pipeline.rl_stage import RLStageRunner, StageContext, start_rollout_worker
from zrl.pipeline.sft_stage import run_sft_stage
from zrl.pipeline.trainer_rank import TrainerRank
from zrl.run_dir import RunDir

log = logging.getLogger("zrl")


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint of a run: the stage it was saved in and its trainer step."""

    stage: str
    step: int
    path: Path


def latest_checkpoint(run_dir: str | Path) -> ResumePoint | None:
    """The checkpoint `latest.json` names, or None when the run wrote none.

    The directory is looked up by name inside this run directory, so a moved or copied run resumes too.
    """
    layout = RunDir(run_dir)
    if not layout.latest.is_file():
        return None
    data = json.loads(layout.latest.read_text())
    return ResumePoint(stage=data["stage"], step=int(data["step"]), path=layout.checkpoints / Path(data["path"]).name)


def rollback_point(recipe: Recipe, step: int) -> ResumePoint | None:
    """The newest checkpoint at or before trainer step `step`, made the run's latest (latest.json), or None.
    Resuming from it (`Cascade(resume=...)`) removes the checkpoints and metric rows after it."""
    layout = RunDir(recipe.output_dir)
    saved = [(s, path) for s, path in layout.checkpoint_steps() if s <= step]
    if not saved:
        return None
    saved_step, path = saved[-1]
    stage = next(s.name for s, (first, last) in zip(recipe.stages, stage_bounds(recipe)) if first < saved_step <= last)
    _write_atomic(layout.latest, json.dumps({"stage": stage, "step": saved_step, "path": str(path)}) + "\n")
    return ResumePoint(stage=stage, step=saved_step, path=path)


def stage_bounds(recipe: Recipe) -> list[tuple[int, int]]:
    """(first, last) trainer step of every stage: it trains steps first+1 .. last."""
    bounds, step = [], 0
    for stage in recipe.stages:
        bounds.append((step, step + stage.steps))
        step += stage.steps
    return bounds


def stage_finished(run_dir: str | Path, stage_name: str, last_step: int) -> bool:
    record = RunDir(run_dir).stage_record(stage_name)
    return record.is_file() and json.loads(record.read_text()).get("last_step") == last_step


def rewind_run_dir(run_dir: str | Path, step: int) -> None:
    """Forget what an interrupted run recorded after trainer step `step` (see the module docstring)."""
    layout = RunDir(run_dir)
    metrics = layout.metrics
    if metrics.is_file():
        kept, dropped = [], 0
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the last line, cut short by the kill
                dropped += 1
                continue
            if row["step"] <= step:
                kept.append(line)
            else:
                dropped += 1
        _write_atomic(metrics, "".join(f"{line}\n" for line in kept))
        log.info("resume: kept %d metric rows up to step %d, dropped %d of the interrupted run", len(kept), step,
                 dropped)
    for saved_step, path in layout.checkpoint_steps():
        if saved_step > step:
            shutil.rmtree(path)
            log.info("resume: removed %s (after the resume point, incomplete)", path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _purge_tensorboard(log_dir: Path, from_step: int) -> None:
    """Hide the events of steps >= `from_step` that earlier event files in `log_dir` hold."""
    from torch.utils.tensorboard import SummaryWriter

    SummaryWriter(log_dir=str(log_dir), purge_step=from_step).close()
    # Readers take event files in name order and names carry the creation time in whole seconds: the
    # next writer's file must be created in a later second to come after this marker.
    time.sleep(1.0 - time.time() % 1.0 + 0.01)


def trainer_settings(recipe: Recipe, stage):
    from zrl.trainer import TrainerSettings

    budget = recipe.resources.trainer_microbatch_tokens
    if isinstance(stage, RLStage):
        budget = max(budget, stage.sampling.max_prompt_tokens + stage.sampling.max_response_tokens)
    else:
        budget = max(budget, stage.max_sequence_tokens)
    return TrainerSettings.from_stage(stage, token_budget=budget, param_dtype=recipe.model.dtype,
                                      kernels=recipe.model.kernels,
                                      activation_checkpointing=recipe.resources.activation_checkpointing,
                                      activation_checkpointing_every_layers=(
                                          recipe.resources.activation_checkpointing_every_layers),
                                      activation_checkpointing_selective=recipe.resources.activation_checkpointing_selective,
                                      activation_offload=recipe.resources.activation_offload,
                                      hsdp_replicas=recipe.resources.hsdp_replicas,
                                      onpolicy_mismatch_tokens=recipe.resources.trainer_onpolicy_mismatch_tokens,
                                      lora=recipe.stage_lora(recipe.stages.index(stage)))


class Cascade:
    def __init__(self, recipe: Recipe, model_path: str | Path, resume: ResumePoint | None = None):
        self.recipe = recipe
        self.model_path = str(model_path)
        self.run_dir = Path(recipe.output_dir)
        self.layout = RunDir(self.run_dir)
        self.resume = resume
        self.rollout_pool: Pool | None = None
        self._reward_pool = None  # the reward-model actors (zrl.reward_model.RewardModelPool) while a stage needs them
        self.trainer_pool: Pool | None = None
        self.metrics: MetricsLogger | None = None
        self._frontier: dict | None = None  # running max solve rates at the end of the last RL stage
        self._curriculum: dict | None = None  # difficulty-scheduler state at the end of the last RL stage
        self._inherited: dict | None = None   # what the running stage took from the previous one (its record)
        self._carried: dict = {}  # {index: RolloutWorker} kept between stages: evaluate the export, run the next RL stage
        self._logged_sync = None  # the weight-sync choice last logged (serving.lora_sync.SyncChoice)

    def run(self) -> int:
        """Run every stage (from the resume point, if any); returns the final trainer step."""
        stages, bounds, point = self.recipe.stages, stage_bounds(self.recipe), self.resume
        first = 0 if point is None else self._resume_index(point, bounds)
        if (point is not None and point.step == bounds[-1][1]
                and stage_finished(self.run_dir, stages[-1].name, bounds[-1][1])):
            log.info("resume: the cascade finished at trainer step %d already; nothing to do", point.step)
            return point.step
        try:
            if point is not None:
                rewind_run_dir(self.run_dir, point.step)
            self.metrics = self._open_metrics()
            self.rollout_pool, self.trainer_pool = reserve_pools(self.recipe.resources)
            ranks = self._start_trainers(first)
            step, data_state = bounds[first][0], None
            if point is not None:
                data_state = self._load_checkpoint(ranks, point)
                step = point.step
                if "buffer" in data_state:  # an RL stage's: what it hands on, should it be finished already
                    self._frontier, self._curriculum = data_state["buffer"]["frontier"], data_state.get("curriculum")
            for index in range(first, len(stages)):
                stage, (first_step, last_step) = stages[index], bounds[index]
                if index > first and self.recipe.stage_lora(index) != self.recipe.stage_lora(index - 1):
                    self._rebase_trainers(ranks, index)
                elif index > first:
                    ray.get([r.set_settings.remote(trainer_settings(self.recipe, stage),
                                                   stage.inherit.optimizer_state) for r in ranks])
                started, self._inherited = time.perf_counter(), None
                if step < last_step:
                    step = self._run_stage(stage, ranks, first_step, step, data_state if index == first else None)
                elif stage_finished(self.run_dir, stage.name, last_step):
                    log.info("stage %r finished before the interruption (steps %d-%d)", stage.name,
                             first_step + 1, last_step)
                    continue
                self._finish_stage(index, ranks, step, time.perf_counter() - started)
            report = write_cascade_report(self.run_dir, self.recipe.name)
            log.info("cascade report: %s", report)
            return step
        finally:
            self.close()

    def _resume_index(self, point: ResumePoint, bounds: list[tuple[int, int]]) -> int:
        names = [s.name for s in self.recipe.stages]
        if point.stage not in names:
            raise ValueError(f"the checkpoint {point.path} was saved in stage {point.stage!r}, which this recipe "
                             f"does not have (stages: {names})")
        index = names.index(point.stage)
        first_step, last_step = bounds[index]
        if not first_step < point.step <= last_step:
            raise ValueError(f"the checkpoint {point.path} is at trainer step {point.step}, outside stage "
                             f"{point.stage!r} (steps {first_step + 1}-{last_step}) of this recipe")
        missing = [s.name for s, (_, last) in zip(self.recipe.stages[:index], bounds)
                   if not stage_finished(self.run_dir, s.name, last)]
        if missing:
            log.warning("resume: stages %s have no stage record in %s (their HF export may be incomplete); they "
                        "cannot be redone, the cascade continues from stage %r", missing,
                        self.layout.stages, point.stage)
        log.info("resume: checkpoint %s, trainer step %d of stage %r (steps %d-%d)", point.path, point.step,
                 point.stage, first_step + 1, last_step)
        return index

    def _open_metrics(self) -> MetricsLogger:
        run_id = None
        wandb = self.recipe.metrics.wandb
        if wandb.enabled and wandb.mode != "disabled":
            id_file = self.layout.wandb_id
            if self.resume is not None and id_file.is_file():
                run_id = id_file.read_text().strip()
            else:
                run_id = os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)
                self.run_dir.mkdir(parents=True, exist_ok=True)
                id_file.write_text(run_id + "\n")
        if self.resume is not None and self.recipe.metrics.tensorboard:
            _purge_tensorboard(self.layout.tensorboard, self.resume.step + 1)
        return MetricsLogger(self.run_dir, self.recipe.metrics, self.recipe.name, self.recipe.model_dump(mode="json"),
                             wandb_run_id=run_id)

    def _trainer_path(self, index: int) -> str:
        """The checkpoint the trainer of stage `index` is built on: model.path, or the export of the stage
        before a switch between full fine-tuning and adapters (Recipe.trainer_base)."""
        base = self.recipe.trainer_base(index)
        return self.model_path if base is None else str(self.layout.stage_hf(base))

    def _start_trainers(self, index: int) -> list:
        pool = self.trainer_pool
        ranks = [ray.remote(TrainerRank).options(**pool.options(i)).remote() for i in range(pool.size)]
        pool.actors = ranks
        from zrl.trainer import Rendezvous

        addr, port = ray.get(ranks[0].address.remote("127.0.0.1" if pool.one_machine else None))
        settings = trainer_settings(self.recipe, self.recipe.stages[index])
        ray.get([r.start.remote(Rendezvous(addr, port, i, pool.size), self._trainer_path(index), settings)
                 for i, r in enumerate(ranks)])
        log.info("trainer pool: %d FSDP2 rank(s) joined at %s:%d", pool.size, addr, port)
        return ranks

    def _rebase_trainers(self, ranks: list, index: int) -> None:
        """Stage `index` trains adapters where the previous stage trained every weight, or the reverse: every
        rank rebuilds its model on the previous stage's export (the same process group, the step count
        continues; no optimizer state carries over)."""
        path, stage = self._trainer_path(index), self.recipe.stages[index]
        ray.get([r.rebase.remote(path, trainer_settings(self.recipe, stage)) for r in ranks])
        log.info("stage %r trains %s: the trainer ranks rebuilt their model on %s", stage.name,
                 "every weight" if self.recipe.stage_lora(index) is None else "adapters on a frozen base", path)

    def _load_checkpoint(self, ranks: list, point: ResumePoint) -> dict:
        data_state = ray.get([r.load_checkpoint.remote(str(point.path)) for r in ranks])[0]
        trainer_step = ray.get(ranks[0].version.remote())  # the policy version of its weights: the same count
        if trainer_step != point.step:
            raise RuntimeError(f"{point.path} holds trainer step {trainer_step}, latest.json says {point.step}")
        if data_state.get("stage") != point.stage:
            raise RuntimeError(f"{point.path} holds the data state of stage {data_state.get('stage')!r}, "
                               f"latest.json says {point.stage!r}")
        return data_state

    def _run_stage(self, stage, ranks: list, first_step: int, step: int, data_state: dict | None) -> int:
        """Train the stage from `step` (its first step, or a checkpoint's with `data_state`) to its end."""
        checkpoint = self._checkpointer(stage, ranks)
        if isinstance(stage, RLStage):
            self._reward_models(any(registry.get(spec.name).uses_reward_model for spec in stage.environments))
            return self._run_rl_stage(stage, ranks, first_step, step, data_state, checkpoint)
        self._reward_models(False)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.recipe.model.tokenizer_path or self.model_path)
        resume = {} if data_state is None else {"resume_step": step, "data_state": data_state}
        return run_sft_stage(stage, ranks, tokenizer, seed=stage.seed + self.recipe.seed, first_step=first_step,
                             log_metrics=self._log(stage), checkpoint=checkpoint, **resume)

    def _run_rl_stage(self, stage, ranks: list, first_step: int, step: int, data_state: dict | None,
                      checkpoint) -> int:
        resume = {} if data_state is None else {"resume_step": step, "data_state": data_state}
        ctx = self._stage_context(stage, first_step, ranks, checkpoint)
        # A resumed stage restores its own frontier and schedulers from `data_state`: it inherits nothing.
        inherits = data_state is None
        frontier = self._frontier if inherits and stage.inherit.length_reward_state else None
        curriculum = self._curriculum if inherits and stage.inherit.curriculum else None
        carried, self._carried = self._carried, {}
        runner = RLStageRunner(stage, ctx, first_step=first_step, frontier=frontier, curriculum=curriculum,
                               rollbacks=rollbacks_made(self.layout.alarms, stage.name), carried=carried, **resume)
        self._inherited = runner.inherited if inherits else None
        step = runner.run()
        self._carried = runner.kept_workers
        self._frontier, self._curriculum = runner.final_frontier, runner.final_curriculum
        return step

    def _stage_context(self, stage: RLStage, first_step: int, ranks: list, checkpoint=None) -> StageContext:
        """What the RL stage starting at trainer step `first_step` runs with. Its rollout engines are sized
        for the recipe's longest RL stage and may restart as often as its most lenient one allows, so the
        workers of one RL stage can run every later one (`_carried`)."""
        rl_stages = [s for s in self.recipe.stages if isinstance(s, RLStage)]
        # A rollback moves the stage's prompt and sampling stream on, so it does not replay what led to the alarm.
        rollbacks = rollbacks_made(self.layout.alarms, stage.name)
        weight_sync, engine_lora = self._weight_sync(self.recipe.stages.index(stage))
        return StageContext(ranks=ranks, rollout_pool=self.rollout_pool, model_path=self.model_path,
                            engine_dtype=self.recipe.model.dtype, kernels=self.recipe.model.kernels,
                            token_budget=trainer_settings(self.recipe, stage).token_budget,
                            seed=self.recipe.seed + first_step + ROLLBACK_SEED_STRIDE * rollbacks,
                            run_dir=str(self.run_dir),
                            log_metrics=self._log(stage), checkpoint=checkpoint,
                            verifier_workers=self.recipe.resources.verifier_workers,
                            cpus_per_verifier_worker=self.recipe.resources.cpus_per_verifier_worker,
                            evaluation_seed=self.recipe.seed,
                            prefix_caching=self.recipe.resources.rollout_prefix_caching,
                            engine_max_model_len=max(s.sampling.max_prompt_tokens + s.sampling.max_response_tokens
                                                     for s in rl_stages),
                            max_worker_restarts=max(s.asynchrony.max_worker_restarts for s in rl_stages),
                            weight_sync=weight_sync, engine_lora=engine_lora)

    def _weight_sync(self, index: int):
        """How stage `index`'s weights reach the engines (serving/lora_sync.py: full, merged or adapter-only) and
        the engines' vLLM LoRA arguments; the choice and its reason are logged when they first appear in the run."""
        from serving.lora_sync import choose_weight_sync, engine_lora_args

        lora, model_type = self.recipe.stage_lora(index), family_of_checkpoint(self.model_path).model_type
        choice = choose_weight_sync(model_type, lora, rollout_on_gpu=self.rollout_pool.gpus > 0,
                                    base_is_served=self.recipe.trainer_base(index) is None)
        if choice != self._logged_sync:
            log.info(choice.line())
            self._logged_sync = choice
        return choice, (engine_lora_args(model_type, lora) if choice.mode == "adapter" else None)

    def _reward_models(self, needed: bool) -> None:
        """Start the recipe's reward-model actors when `needed` and not up, stop them when up and not. They
        stay up from an RL stage that scores with them through its export's evaluation, which a rollout
        worker then serves too."""
        if needed and self._reward_pool is None:
            from zrl.reward_model import RewardModelPool

            self._reward_pool = RewardModelPool(self.recipe.reward_model, self.recipe.resources)
            self._reward_pool.start()
        elif not needed and self._reward_pool is not None:
            self._reward_pool.stop()
            self._reward_pool = None

    def _finish_stage(self, index: int, ranks: list, step: int, elapsed_s: float) -> None:
        """Export the stage's final policy, plot its metrics, then write its record (marks it finished)."""
        from zrl.plots import plot_stage_summary

        stage = self.recipe.stages[index]
        hf_dir = self.layout.stage_hf(stage.name)
        ray.get([r.export_hf.remote(str(hf_dir), self.recipe.model.dtype) for r in ranks])
        adapter_dir = None
        if self.recipe.stage_lora(index) is not None:  # the adapters alone as well, beside the merged export
            adapter_dir = self.layout.stage_adapter(stage.name)
            ray.get([r.export_adapter.remote(str(adapter_dir)) for r in ranks])
        rollouts = {r.entry: str(stage.self_rollouts_path(self.recipe.output_dir, r.entry)) for r in stage.self_rollouts}
        following = self.recipe.stages[index + 1] if index + 1 < len(self.recipe.stages) else None
        evaluation = self._evaluate_export(stage, hf_dir, rollouts, step, following if isinstance(following, RLStage) else None)
        first_step, last_step = stage_bounds(self.recipe)[index]
        if evaluation and stage.evaluation.every_steps is not None:  # the last point of the in-training curve
            results = [(k, EvalResult(**v)) for k, v in evaluation.items()]
            self._log(stage)(last_step, held_out_metrics(last_step, results))
        summary = None
        if self.recipe.metrics.jsonl:
            summary = plot_stage_summary(self.layout.metrics, index, self.layout.stage_summary(stage.name),
                                         title=f"{self.recipe.name} / stage {stage.name}")
        curriculum = [] if self._curriculum is None else sorted(self._curriculum["curriculum"]["schedulers"])
        record = {"stage": stage.name, "index": index, "first_step": first_step, "last_step": last_step,
                  "hf": str(hf_dir), "adapter": None if adapter_dir is None else str(adapter_dir),
                  "summary_png": None if summary is None else str(summary),
                  "wall_s": elapsed_s, "evaluation": evaluation,
                  "self_rollouts": rollouts,
                  "inherited": self._inherited,
                  "handoff": {"length_reward_frontier": self._frontier or {}, "curriculum": curriculum},
                  "finished_at": time.time()}
        _write_atomic(self.layout.stage_record(stage.name), json.dumps(record, indent=1) + "\n")
        log.info("stage %r finished at trainer step %d in %.0f s; policy exported to %s%s", stage.name, step,
                 elapsed_s, hf_dir, "" if summary is None else f", summary plot {summary}")

    def _evaluate_export(self, stage, hf_dir: Path, rollouts: dict[str, str], version: int,
                         next_rl: RLStage | None) -> dict[str, dict]:
        """The stage's held-out evaluation and its self-rollouts files (`rollouts`: entry -> path), on the
        rollout pool's first bundle (free between stages); returns {entry: result} of the evaluation. The
        rollout workers kept from the stage go on to `next_rl`, the RL stage that follows, if any; else
        they are stopped here."""
        e, specs = stage.evaluation, dict(zip(stage.entry_keys(), stage.environments))
        limit = stage.sampling.max_prompt_tokens if isinstance(stage, RLStage) else stage.max_sequence_tokens
        held_out = held_out_requests(stage)
        keys = [k for k, _ in held_out]
        pairs = held_out + [(r.entry, EvalRequest(specs[r.entry], r.prompts, r.samples, r.temperature,
                                                  r.max_response_tokens, split="train",
                                                  save_rollouts=rollouts[r.entry], max_prompt_tokens=limit))
                            for r in stage.self_rollouts]
        try:
            results = self._run_export_evaluation(stage, hf_dir, pairs, version, next_rl) if pairs else []
        except RayError as exc:  # a report, not the run: the stage is recorded without it
            log.error("stage %r: the evaluation of its export failed (%s); no held-out accuracy or self-rollouts "
                      "for this stage", stage.name, reason_of(exc))
            return {}
        finally:
            if next_rl is None:
                self._stop_carried(*self._carried)
        for r, result in zip(stage.self_rollouts, results[len(keys):]):
            log.info("stage %r: self-rollouts of %s written to %s (%d problems x %d, mean reward %.3f)", stage.name,
                     r.entry, rollouts[r.entry], r.prompts, r.samples, result.accuracy)
        evaluation = {k: asdict(result) for k, result in zip(keys, results)}
        if evaluation:
            log.info("stage %r: held-out accuracy %s (%d prompts x %d samples, temperature %g)", stage.name,
                     ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in evaluation.items()), e.prompts, e.samples,
                     e.temperature)
        return evaluation

    def _run_export_evaluation(self, stage, hf_dir: Path, pairs: list, version: int, next_rl: RLStage | None) -> list:
        """The results of `pairs` ((entry key, EvalRequest)) on the export at `hf_dir`, on the engine of
        rollout worker 0: the one the RL stage kept or, when an RL stage follows, that stage's worker 0,
        started now (one engine start where there would be two). Entries scored by a reward model are
        scored by the run's reward-model actors (started for them if no stage left them up). Requests a
        rollout worker cannot serve get an engine of their own: a problem longer than the rollout engines
        take, a reward-model entry in a recipe without `reward_model` (refused there), or a worker that
        fails."""
        from zrl.evaluate import evaluate_requests

        requests = [r for _, r in pairs]
        scored_by_model = any(registry.get(r.environment.name).uses_reward_model for r in requests)
        if scored_by_model and self.recipe.reward_model is not None:
            self._reward_models(True)  # the worker's environments score with the run's actors
        on_worker = not scored_by_model or self._reward_pool is not None
        if on_worker and next_rl is not None and 0 not in self._carried:
            first_step = stage_bounds(self.recipe)[self.recipe.stages.index(next_rl)][0]
            self._carried[0] = start_rollout_worker(self._stage_context(next_rl, first_step, ranks=[]), next_rl, 0,
                                                    version)
            self.rollout_pool.actors = list(self._carried.values())
        worker = self._carried.get(0) if on_worker else None
        if worker is not None:
            try:
                report = ray.get(worker.evaluate_export.remote(str(hf_dir), pairs, self.recipe.seed, version))
                if report is not None:
                    log.info("stage %r: its export evaluated on the engine of rollout worker 0 in %.1f s", stage.name,
                             report.seconds)
                    return [result for _, result in report.results]
                log.info("stage %r: a held-out problem is longer than the rollout engines take; its export is "
                         "evaluated on an engine of its own", stage.name)
            except RayError as exc:
                log.warning("stage %r: the evaluation of its export on rollout worker 0 failed (%s); evaluating on "
                            "an engine of its own", stage.name, reason_of(exc))
        self._stop_carried(0)  # its bundle is the evaluation's
        task = ray.remote(evaluate_requests).options(**self.rollout_pool.options(0), max_retries=0)
        return ray.get(task.remote(str(hf_dir), requests, self.recipe.seed, self.recipe.model.dtype,
                                   self.recipe.reward_model))

    def _stop_carried(self, *indices: int) -> None:
        """Kill the kept rollout workers `indices` (those not kept are skipped)."""
        for i in indices:
            if i in self._carried:
                ray.kill(self._carried.pop(i))
        self.rollout_pool.actors = list(self._carried.values())

    def _log(self, stage):
        """The stage's metric sink: every `metrics.log_every_steps` steps and at the stage's last step; it
        returns whether it wrote the row."""
        index = self.recipe.stages.index(stage)
        last_step = stage_bounds(self.recipe)[index][1]
        every = self.recipe.metrics.log_every_steps

        def log_metrics(step: int, values: dict) -> bool:
            if step % every and step != last_step:
                return False
            self.metrics.log(step, {**values, "stage/index": float(index)})
            return True
        return log_metrics

    def _checkpointer(self, stage, ranks: list):
        def checkpoint(step: int, data_state: dict) -> None:
            path = self.layout.checkpoint(step)
            refs = [r.save_checkpoint.remote(str(path), data_state) for r in ranks]
            try:
                ray.get(refs)
            except RayError:  # a rank died mid-save: TrainerFailed, so the run restarts from the last complete one
                trainer_results(refs, f"the checkpoint at trainer step {step}", ray.get, timeout_s=RANK_FAILURE_GRACE_S)
                raise
            _write_atomic(self.layout.latest,
                          json.dumps({"stage": stage.name, "step": step, "path": str(path)}) + "\n")
            log.info("checkpoint: %s", path)
        return checkpoint

    def close(self) -> None:
        self._reward_models(False)
        if self.trainer_pool is not None:
            for rank in self.trainer_pool.actors:
                rank.shutdown.remote()
            release(self.trainer_pool)
            self.trainer_pool = None
        if self.rollout_pool is not None:
            release(self.rollout_pool)
            self.rollout_pool = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
