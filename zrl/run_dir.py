"""The run directory's layout: every path zrl reads or writes under a run's `output_dir`, in one place.

    <output_dir>/
      recipe.resolved.yaml                  the recipe as run, checked on --resume (zrl/run.py)
      driver.json                           the driver holding the directory: pid, host, tag (zrl/run.py)
      metrics.jsonl                         one row per logged trainer step (zrl/metrics.py)
      alarms.jsonl                          every learning-health alarm and rollback (zrl/pipeline/health.py)
      tensorboard/                          TensorBoard event files
      wandb_run_id                          the W&B run id, kept across resumes
      checkpoints/step_XXXXXX/              one checkpoint per saved trainer step
      checkpoints/latest.json               {stage, step, path} of the newest complete one, written last
      stages/<stage>/hf/                    the stage's exported policy (Hugging Face, the model's family)
      stages/<stage>/rollouts/<entry>.jsonl the stage's self-rollouts, for later stages
      stages/<stage>/summary.png            the stage's summary figure (zrl/plots.py)
      stages/<stage>/stage.json             the stage record: written last, it marks the stage finished
      cascade_report.html                   after the last stage (zrl/cascade_report.py)

Imports nothing but the standard library (the config package uses it).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "step_"
REPORT_FILE = "cascade_report.html"
STAGE_RECORD = "stage.json"


class RunDir:
    """The paths of the run directory `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def resolved_recipe(self) -> Path:
        return self.root / "recipe.resolved.yaml"

    @property
    def driver(self) -> Path:
        return self.root / "driver.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_id(self) -> Path:
        return self.root / "wandb_run_id"

    @property
    def alarms(self) -> Path:
        return self.root / "alarms.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest(self) -> Path:
        return self.checkpoints / "latest.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:06d}"

    def checkpoint_steps(self) -> list[tuple[int, Path]]:
        """(trainer step, directory) of every checkpoint directory, by name."""
        found = []
        for path in sorted(self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*")):
            step = path.name[len(CHECKPOINT_PREFIX):]
            if path.is_dir() and step.isdigit():
                found.append((int(step), path))
        return found

    @property
    def stages(self) -> Path:
        return self.root / "stages"

    def stage(self, name: str) -> Path:
        return self.stages / name

    def stage_hf(self, name: str) -> Path:
        return self.stage(name) / "hf"

    def stage_adapter(self, name: str) -> Path:
        """A LoRA run's adapters as a PEFT adapter directory (the merged weights are `stage_hf`)."""
        return self.stage(name) / "adapter"

    def stage_summary(self, name: str) -> Path:
        return self.stage(name) / "summary.png"

    def stage_record(self, name: str) -> Path:
        return self.stage(name) / STAGE_RECORD

    def stage_records(self) -> list[Path]:
        return sorted(self.stages.glob(f"*/{STAGE_RECORD}"))

    def self_rollouts(self, stage: str, entry: str) -> Path:
        return self.stage(stage) / "rollouts" / f"{entry}.jsonl"

    @property
    def cascade_report(self) -> Path:
        return self.root / REPORT_FILE
