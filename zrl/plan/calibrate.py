"""Fit a plan's workload to a measured run: the rows of its metrics.jsonl (one per trainer step).

What each model takes from the rows (steps after the first, whose window holds start-up):
- response lengths: the mean of the per-step mean lengths, and the spread of single responses from
  the spread of those means (a step's mean over n responses varies with sigma / sqrt(n)); lognormal;
- rollout engine: tokens per busy second of a worker (throughput/rollout_tokens_per_s over the busy
  share of the window), independent of concurrency (a CPU engine is compute-bound);
- trainer: the rank's tokens/s (perf/tokens_per_s) plus a per-step overhead: what the loop timed per
  step (its busy share of the window) beyond the rank's compute;
- weight sync: a worker's receive and load (sync/engine_update_s); the wait for its round to end is
  the simulator's own;
- zero-signal fraction: the buffer's dropped / received.

Invariant: the fit reads only metrics the stage loop logs (zrl.pipeline.stage_report, the trainer,
the buffer); nothing else about the run.
"""

from __future__ import annotations

import math

import numpy as np

from zrl.config.schema import RLStage
from zrl.plan.workload import DecodeModel, ResponseLengths, TrainerModel, Workload


def fit_workload(rows: list[dict], stage: RLStage, rollout_workers: int, round_s: float = 0.5) -> Workload:
    if len(rows) < 3:
        raise ValueError(f"a fit needs at least 3 metric rows (steps), got {len(rows)}")
    steady, windows = rows[1:], np.diff([r["time"] for r in rows])
    col = lambda key: np.array([r[key] for r in steady], dtype=np.float64)  # noqa: E731
    sequences = col("batch/num_sequences")
    step_means = col("batch/num_response_tokens") / sequences
    std = float(np.std(step_means) * math.sqrt(sequences.mean()))
    lengths = ResponseLengths.from_mean_std(float(step_means.mean()), std, stage.sampling.max_response_tokens)
    prompt_tokens = int(round(float(np.mean((col("batch/input_tokens") - col("batch/num_response_tokens")) / sequences))))

    busy_s = (1 - col("throughput/rollout_idle_frac")) * windows * rollout_workers
    tokens_per_busy_s = float((col("throughput/rollout_tokens_per_s") * windows).sum() / busy_s.sum())
    train_call_s = (1 - col("throughput/trainer_idle_frac")) * windows
    rank_tokens_per_s = float(col("perf/tokens_per_s").mean())
    overhead_s = max(0.0, float(np.mean(train_call_s - col("batch/input_tokens") / rank_tokens_per_s)))
    last = rows[-1]
    return Workload(
        lengths=lengths, engine=DecodeModel(0.0, 1 / tokens_per_busy_s, max_running_sequences=10**9),
        trainer=TrainerModel(rank_tokens_per_s, overhead_s), prompt_tokens=prompt_tokens,
        sync_s=float(col("sync/engine_update_s").mean()),
        zero_signal_fraction=last["buffer/dropped_zero_signal"] / max(last["buffer/received"], 1), round_s=round_s,
        notes={"rollout_tokens_per_busy_s": tokens_per_busy_s, "trainer_call_s": float(train_call_s.mean()),
               "mean_response_tokens": float(step_means.mean()), "response_tokens_std": std})


def measured(rows: list[dict], max_staleness_steps: int) -> dict:
    """What bench/pipeline_async_vs_sync.py reports of a run, plus the buffer's staleness histogram."""
    steady = rows[1:]
    span = steady[-1]["time"] - rows[0]["time"]
    return {"steps_per_min": 60 * len(steady) / span,
            "rollout_idle": float(np.mean([r["throughput/rollout_idle_frac"] for r in steady])),
            "trainer_idle": float(np.mean([r["throughput/trainer_idle_frac"] for r in steady])),
            "staleness": {k: int(rows[-1].get(f"staleness/cumulative_{k}", 0))
                          for k in range(max_staleness_steps + 1)}}
