"""One metrics API, `MetricsLogger.log(step, values)`, fanned out to sinks: JSONL, TensorBoard, wandb;
and `batch_metrics`, the per-step values of the batch a trainer step trained on.

Metric names are `panel/name` (reward/, canary/, staleness/, mismatch/, throughput/, lengths/,
routing/, eval/, ...): wandb and TensorBoard both group charts by the prefix, which gives the dashboard
its panels. docs/metrics.md says what each name means and maps it to verl's and prime-rl's names.
Values must be real numbers; anything else is a programming error and raises.
wandb runs offline (files under `<run_dir>/wandb`, `wandb sync` uploads them later) unless the mode
is `online`, or `auto` with WANDB_API_KEY set. TensorBoard event files live in `<run_dir>/tensorboard`.
"""

import json
import math
import os
import time
from collections import Counter
from numbers import Real
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from zrl.config.schema import Metrics
from zrl.run_dir import RunDir
from zrl.types import TrainBatch


class Sink(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def write(self, step: int, values: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, project: str, entity: str | None, mode: str, name: str, config: dict,
                 run_id: str | None = None):
        import wandb

        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        # An explicit id (resume="allow") continues the same run after `zrl run --resume`.
        self._run = wandb.init(project=project, entity=entity, mode=mode, name=name, dir=str(run_dir),
                               config=config, reinit="create_new", id=run_id, resume="allow" if run_id else None)

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    def __init__(self, run_dir: str | Path, config: Metrics, run_name: str, run_config: dict | None = None,
                 wandb_run_id: str | None = None):
        run_dir = Path(run_dir)
        self.sinks: list[Sink] = []
        if config.jsonl:
            self.sinks.append(JsonlSink(RunDir(run_dir).metrics))
        if config.tensorboard:
            self.sinks.append(TensorBoardSink(RunDir(run_dir).tensorboard))
        if config.wandb.enabled and config.wandb.mode != "disabled":
            self.sinks.append(WandbSink(run_dir, config.wandb.project, config.wandb.entity, config.wandb.mode,
                                        run_name, run_config or {}, run_id=wandb_run_id))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        bad = {k: v for k, v in values.items() if isinstance(v, bool) or not isinstance(v, Real)}
        if bad:
            raise TypeError(f"metric values must be real numbers; got {bad}")
        floats = {k: float(v) for k, v in values.items()}
        for sink in self.sinks:
            sink.write(step, floats)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def batch_metrics(batch: TrainBatch, max_staleness_steps: int) -> dict[str, float]:
    """The values of one released batch, which one trainer step trains on (the buffer computes them at
    release, so every step has them): rewards, staleness, response lengths and the truncation rate.

    - `reward/mean`: mean verifier reward of the batch's rollouts; `reward/gated_mean` after the LZ77
      repetition gate; `reward/<entry>` per environment entry of the batch, and `verify/<entry>/<reason>`
      the fraction of its rollouts whose verification gave that `reason` (metadata);
    - `staleness/mean|max` (trainer steps) and `staleness/<k>`: rollouts of staleness k, k = 0..bound;
    - `lengths/response_mean|p50|p90|max` (tokens) and `lengths/truncated_frac`: the fraction of
      responses that hit max_response_tokens (finish reason "length");
    - multi-turn episodes (zrl.env.episodes.episode_verification): `episodes/turns_mean` (policy
      messages), `episodes/tool_calls_mean`, `episodes/used_tools_frac` (episodes with a tool call),
      `episodes/tool_error_frac` (failed calls over calls); their end reasons are the `verify/` reasons.
    """
    rollouts = batch.rollouts()
    task = np.concatenate([g.task_rewards() for g in batch.groups])       # [N]
    gated = np.concatenate([g.rewards for g in batch.groups])             # [N]
    lengths = np.array([len(r.token_ids) for r in rollouts])              # [N]
    staleness = batch.staleness                                           # [N]
    p50, p90 = np.percentile(lengths, [50, 90])
    out = {"reward/mean": float(task.mean()), "reward/gated_mean": float(gated.mean()),
           "staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
           "lengths/response_mean": float(lengths.mean()), "lengths/response_p50": float(p50),
           "lengths/response_p90": float(p90), "lengths/response_max": float(lengths.max()),
           "lengths/truncated_frac": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts)}
    counts = np.bincount(staleness, minlength=max_staleness_steps + 1)
    out.update({f"staleness/{k}": float(n) for k, n in enumerate(counts)})
    entries: dict[str, list[np.ndarray]] = {}
    reasons: Counter[tuple[str, str]] = Counter()
    for group in batch.groups:
        entries.setdefault(group.prompt.env, []).append(group.task_rewards())
        reasons.update((group.prompt.env, v.metadata["reason"].replace(" ", "_")) for v in group.verifications
                       if isinstance(v.metadata.get("reason"), str))
    sizes = {key: sum(len(p) for p in parts) for key, parts in entries.items()}
    out.update({f"reward/{key}": float(np.concatenate(parts).mean()) for key, parts in sorted(entries.items())})
    out.update({f"verify/{key}/{reason}": n / sizes[key] for (key, reason), n in sorted(reasons.items())})
    episodes = [v.metadata for group in batch.groups for v in group.verifications if "turns" in v.metadata]
    if episodes:
        calls = sum(e["tool_calls"] for e in episodes)
        out.update({"episodes/turns_mean": float(np.mean([e["turns"] for e in episodes])),
                    "episodes/tool_calls_mean": calls / len(episodes),
                    "episodes/used_tools_frac": float(np.mean([e["tool_calls"] > 0 for e in episodes])),
                    "episodes/tool_error_frac": sum(e["tool_errors"] for e in episodes) / calls if calls else 0.0})
    return out
