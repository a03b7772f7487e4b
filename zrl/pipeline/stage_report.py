"""What an RL stage reports per trainer step: the metric row and the console progress line.

`StageCounters` accumulates what the loop sees between two reports (tokens generated, busy times,
sync times, canary sums, faults); `step_metrics` turns one window into the row `log(step, values)`
receives, merged with the trainer's metrics, the trained batch's (zrl.metrics.batch_metrics: reward,
staleness, lengths) and the buffer's (cumulative counters, means over the groups received in the
window); `progress_line` is the one console line per step. Rates and idle fractions are over the window
since the previous report; `throughput/rollout_tokens_per_s` and `throughput/trainer_tokens_per_s` are
each pool's tokens per wall-clock second of it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from zrl.pipeline.schedule import StageSchedule


@dataclass
class StageCounters:
    verifier_timeouts: int = 0
    skipped_long_prompts: int = 0
    generated_tokens: int = 0          # window
    rollout_busy_s: float = 0.0        # window, summed over workers
    train_busy_s: float = 0.0          # window
    sync_s: float = 0.0                # cumulative: trainer-side seconds of all syncs
    sync_count: int = 0
    sync_bytes: int = 0                # last sync
    sync_engine_s: float = 0.0         # last sync: slowest worker's receive + load
    sync_peak_extra_bytes: dict = field(default_factory=dict)  # "sender"/"receiver" -> last sync's peak
    sync_transport: str = "collective"
    driver_array_bytes: int = 0        # rollout-array bytes the driver fetched (must stay 0)
    generated_array_bytes: int = 0     # rollout-array bytes the workers published
    rollouts_generated: int = 0        # window, for the canary means
    canary_sums: Counter = field(default_factory=Counter)  # window

    def reset_window(self) -> None:
        self.generated_tokens, self.rollout_busy_s, self.train_busy_s = 0, 0.0, 0.0
        self.rollouts_generated = 0
        self.canary_sums.clear()


def step_metrics(counters: StageCounters, schedule: StageSchedule, trainer: dict[str, float],
                 batch: Mapping[str, float], buffer: dict[str, float], window_s: float) -> dict[str, float]:
    c = counters
    window_s = max(window_s, 1e-9)
    values = {**trainer, **batch, **buffer}
    values.update({
        "throughput/rollout_tokens_per_s": c.generated_tokens / window_s,
        "throughput/trainer_tokens_per_s": trainer.get("batch/input_tokens", 0.0) / window_s,
        "throughput/rollout_idle_frac": max(0.0, 1 - c.rollout_busy_s / (window_s * len(schedule.workers))),
        "throughput/trainer_idle_frac": max(0.0, 1 - c.train_busy_s / window_s),
        "sync/time_s": c.sync_s / max(c.sync_count, 1), "sync/count": float(c.sync_count),
        "sync/bytes": float(c.sync_bytes), "sync/engine_update_s": c.sync_engine_s,
        "sync/collective": float(c.sync_transport == "collective"),
        "sync/worker_version_min": float(min(w.policy_version for w in schedule.workers)),
        "faults/lost_groups": float(schedule.lost_groups), "faults/worker_restarts": float(schedule.worker_restarts),
        "faults/verifier_timeouts": float(c.verifier_timeouts),
        "rollout/skipped_long_prompts": float(c.skipped_long_prompts),
        "rollout/in_flight_groups": float(schedule.in_flight_groups()),
        "driver/rollout_array_bytes": float(c.driver_array_bytes),
        "rollout/array_bytes": float(c.generated_array_bytes),
    })
    for side, peak in c.sync_peak_extra_bytes.items():
        if peak >= 0:
            values[f"sync/peak_extra_mib_{side}"] = peak / 2**20
    if c.rollouts_generated:
        values.update({key: total / c.rollouts_generated for key, total in c.canary_sums.items()})
    return values


def progress_line(step: int, end_step: int, values: dict[str, float]) -> str:
    reward = values.get("reward/mean")
    return (f"step {step}/{end_step} | reward {'-' if reward is None or math.isnan(reward) else f'{reward:.3f}'} | "
            f"loss {values.get('loss/policy', float('nan')):.4f} | staleness max {int(values.get('staleness/max', 0))} | "
            f"buffered {int(values.get('buffer/occupancy', 0))} | gen {values['throughput/rollout_tokens_per_s']:.0f} tok/s | "
            f"train {values.get('perf/tokens_per_s', 0.0):.0f} tok/s | sync {values['sync/time_s']:.2f} s | "
            f"idle rollout {100 * values['throughput/rollout_idle_frac']:.0f}% "
            f"trainer {100 * values['throughput/trainer_idle_frac']:.0f}%" + _levels(values))


def _levels(values: dict[str, float]) -> str:
    """` | level strings 3 (crossing 2.6)` for each adaptive entry (at most three named)."""
    keys = sorted(k[len("curriculum/"):-len("/difficulty")] for k in values
                  if k.startswith("curriculum/") and k.endswith("/difficulty"))
    parts = [f"{key} {values[f'curriculum/{key}/difficulty']:.0f} (crossing {values[f'curriculum/{key}/mu_mean']:.1f})"
             for key in keys[:3]]
    return f" | level {', '.join(parts)}" + (f" +{len(keys) - 3} more" if len(keys) > 3 else "") if parts else ""
