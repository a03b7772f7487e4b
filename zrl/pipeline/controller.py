"""The cascade controller: reserves the pools, starts the trainer ranks once, runs the stages in order.

The trainer pool (one FSDP2 process group) lives for the whole cascade, so each stage starts from the
previous stage's final policy in memory; at the end of every stage the policy is also written as a
Hugging Face `zaya` checkpoint (`<output_dir>/stages/<name>/hf`). Rollout workers are per stage
(their engine limits follow the stage's lengths) and get the trainer's weights before they generate.
Checkpoints (torch.distributed.checkpoint, any number of ranks) go to `<output_dir>/checkpoints/`,
with `latest.json` naming the newest. Shutdown is the same on success, error and Ctrl-C: trainer
ranks leave their process group, every actor is killed, both placement groups are removed.
"""

import json
import logging
import time
from pathlib import Path

import ray

from zrl.config.schema import Recipe, RLStage
from zrl.metrics import MetricsLogger
from zrl.pipeline.pools import Pool, release, reserve_pools
from zrl.pipeline.rl_stage import RLStageRunner, StageContext
from zrl.pipeline.sft_stage import run_sft_stage
from zrl.pipeline.trainer_rank import TrainerRank

log = logging.getLogger("zrl")


def trainer_settings(recipe: Recipe, stage):
    from zrl.trainer import TrainerSettings

    budget = recipe.resources.trainer_microbatch_tokens
    if isinstance(stage, RLStage):
        budget = max(budget, stage.sampling.max_prompt_tokens + stage.sampling.max_response_tokens)
    else:
        budget = max(budget, stage.max_sequence_tokens)
    return TrainerSettings.from_stage(stage, token_budget=budget, param_dtype=recipe.model.dtype,
                                      activation_checkpointing=recipe.resources.activation_checkpointing)


class Cascade:
    def __init__(self, recipe: Recipe, model_path: str | Path):
        self.recipe = recipe
        self.model_path = str(model_path)
        self.run_dir = Path(recipe.output_dir)
        self.rollout_pool: Pool | None = None
        self.trainer_pool: Pool | None = None
        self.metrics: MetricsLogger | None = None

    def run(self) -> int:
        """Run every stage; returns the final trainer step."""
        try:
            self.metrics = MetricsLogger(self.run_dir, self.recipe.metrics, self.recipe.name,
                                         self.recipe.model_dump(mode="json"))
            self.rollout_pool, self.trainer_pool = reserve_pools(self.recipe.resources)
            ranks = self._start_trainers(self.recipe.stages[0])
            step = 0
            for index, stage in enumerate(self.recipe.stages):
                if index:
                    ray.get([r.set_settings.remote(trainer_settings(self.recipe, stage),
                                                   stage.inherit.optimizer_state) for r in ranks])
                started = time.perf_counter()
                step = self._run_stage(stage, ranks, step)
                hf_dir = self.run_dir / "stages" / stage.name / "hf"
                ray.get([r.export_hf.remote(str(hf_dir), self.recipe.model.dtype) for r in ranks])
                log.info("stage %r finished at trainer step %d in %.0f s; policy exported to %s",
                         stage.name, step, time.perf_counter() - started, hf_dir)
            return step
        finally:
            self.close()

    def _start_trainers(self, first_stage) -> list:
        pool = self.trainer_pool
        ranks = [ray.remote(TrainerRank).options(**pool.options(i)).remote() for i in range(pool.size)]
        pool.actors = ranks
        from zrl.trainer import Rendezvous

        addr, port = ray.get(ranks[0].address.remote())
        settings = trainer_settings(self.recipe, first_stage)
        ray.get([r.start.remote(Rendezvous(addr, port, i, pool.size), self.model_path, settings)
                 for i, r in enumerate(ranks)])
        log.info("trainer pool: %d FSDP2 rank(s) joined at %s:%d", pool.size, addr, port)
        return ranks

    def _run_stage(self, stage, ranks: list, step: int) -> int:
        checkpoint = self._checkpointer(stage, ranks)
        if isinstance(stage, RLStage):
            ctx = StageContext(ranks=ranks, rollout_pool=self.rollout_pool, model_path=self.model_path,
                               engine_dtype=self.recipe.model.dtype, seed=self.recipe.seed + step,
                               run_dir=str(self.run_dir), log_metrics=self._log(stage), checkpoint=checkpoint)
            return RLStageRunner(stage, ctx, start_version=step).run()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.recipe.model.tokenizer_path or self.model_path)
        return run_sft_stage(stage, ranks, tokenizer, seed=stage.seed + self.recipe.seed, start_version=step,
                             log_metrics=self._log(stage), checkpoint=checkpoint)

    def _log(self, stage):
        def log_metrics(step: int, values: dict) -> None:
            self.metrics.log(step, {**values, "stage/index": float(self.recipe.stages.index(stage))})
        return log_metrics

    def _checkpointer(self, stage, ranks: list):
        def checkpoint(step: int, data_state: dict) -> None:
            path = self.run_dir / "checkpoints" / f"step_{step:06d}"
            ray.get([r.save_checkpoint.remote(str(path), data_state) for r in ranks])
            (self.run_dir / "checkpoints" / "latest.json").write_text(
                json.dumps({"stage": stage.name, "step": step, "path": str(path)}) + "\n")
            log.info("checkpoint: %s", path)
        return checkpoint

    def close(self) -> None:
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
