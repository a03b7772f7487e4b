"""One metrics API, `MetricsLogger.log(step, values)`, fanned out to sinks: JSONL, TensorBoard, wandb.

Metric names are `panel/name` (reward/, canary/, staleness/, mismatch/, throughput/, lengths/,
routing/, ...): wandb and TensorBoard both group charts by the prefix, which gives the dashboard its
panels. Values must be real numbers; anything else is a programming error and raises.
wandb runs offline (files under `<run_dir>/wandb`, `wandb sync` uploads them later) unless the mode
is `online`, or `auto` with WANDB_API_KEY set. TensorBoard event files live in `<run_dir>/tensorboard`.
"""

import json
import math
import os
import time
from numbers import Real
from pathlib import Path
from typing import Mapping, Protocol

from zrl.config.schema import Metrics


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
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if config.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
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
