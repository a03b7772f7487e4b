"""What an RL stage reports per trainer step: the metric row and the console progress line.

`StageCounters` accumulates what the loop sees between two reports (tokens generated, busy times,
sync times, canary sums, faults); `step_metrics` turns one window into the row `log(step, values)`
receives, merged with the trainer's metrics, the trained batch's (zrl.metrics.batch_metrics: reward,
staleness, lengths) and the buffer's (cumulative counters, means over the groups received in the
window); `progress_line` is the one console line per step. Rates and idle fractions are over the window
since the previous report; `throughput/rollout_tokens_per_s` and `throughput/trainer_tokens_per_s` are
each pool's tokens per wall-clock second of it.

`StageReporter` owns the reporting window: it writes the row and the line after every step, says
what the stage waits for while no step completes (the heartbeat), and holds a held-out evaluation's
values until a row carries them; its `health` monitor checks every row before it is written
(zrl/pipeline/health.py). It gets what it reports as values (no Ray here).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from zrl.pipeline.held_out import held_out_metrics, summary
from zrl.pipeline.schedule import StageSchedule

log = logging.getLogger("zrl")


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
    sync_mode: str = "full"            # what a sync sends: full | merged | adapter (serving/lora_sync.py)
    driver_array_bytes: int = 0        # rollout-array bytes the driver fetched (must stay 0)
    generated_array_bytes: int = 0     # rollout-array bytes the workers published
    rollouts_generated: int = 0        # window, for the canary means
    canary_sums: Counter = field(default_factory=Counter)  # window

    def add_round(self, report) -> None:
        """A rollout worker's round report (rollout_worker.RoundReport)."""
        self.generated_tokens += report.generated_tokens
        self.rollout_busy_s += report.busy_s
        self.skipped_long_prompts += report.skipped_long_prompts
        self.generated_array_bytes += report.array_bytes
        self.canary_sums.update(report.canary_sums)
        self.rollouts_generated += sum(t.num_rollouts for t in report.tickets)

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
        "sync/adapter_only": float(c.sync_mode == "adapter"), "sync/merged": float(c.sync_mode == "merged"),
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


def step_count(step: int, end_step: int, stage_steps: int) -> str:
    """`step 241/270 (stage 1/30)`: the run's trainer step and the stage's last one, then the step's count
    within the stage (of its `stage_steps`)."""
    return f"step {step}/{end_step} (stage {step - (end_step - stage_steps)}/{stage_steps})"


def progress_line(step: int, end_step: int, stage_steps: int, values: dict[str, float]) -> str:
    reward = values.get("reward/mean")
    shown = "-" if reward is None or math.isnan(reward) else f"{reward:.3f}"
    return (f"{step_count(step, end_step, stage_steps)} | reward {shown} | "
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


def counts_line(counts: dict[str, int], schedule: StageSchedule) -> str:
    """The buffer's counters and the loop's faults, for a stop message."""
    return ("buffer: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) +
            f"; lost groups {schedule.lost_groups}, worker restarts {schedule.worker_restarts}")


def log_ledger(stage_name: str, counts: dict[str, int], lost_groups: int) -> None:
    """The stage's exactly-once check: every received group's prompt place once, repeats dropped."""
    line = (f"stage {stage_name!r} prompt ledger: {counts['received']} group(s) received once, "
            f"{counts['duplicates']} repeat(s) dropped, {lost_groups} lost with dead workers")
    (log.warning if counts["duplicates"] else log.info)(line)


class StageReporter:
    def __init__(self, stage_name: str, stage_steps: int, counters: StageCounters, log_metrics, curriculum=None):
        """`stage_steps`: the stage's trainer steps; `log_metrics`: callable(step, values) -> whether the row
        was written; `curriculum`: the stage's StageCurriculum, or None."""
        self.stage_name, self.stage_steps, self.counters, self.curriculum = stage_name, stage_steps, counters, curriculum
        self.log_metrics = log_metrics
        self.health = None  # the stage's HealthMonitor (zrl/pipeline/health.py), which checks every row
        self.window_start = self.last_heartbeat = time.perf_counter()
        self.eval_values: dict[str, float] = {}  # the latest evaluation's metrics, until a row carries them

    def step(self, now: float, schedule: StageSchedule, trainer_metrics: dict[str, float],
             batch_metrics: dict[str, float], buffer_metrics: dict[str, float], environment_counts: list[dict]) -> None:
        """The row and the line of the step the trainer just finished; `now`: the window's end."""
        values = step_metrics(self.counters, schedule, trainer_metrics, batch_metrics, buffer_metrics,
                              now - self.window_start)
        if self.curriculum is not None:
            values.update(self.curriculum.metrics())
        for counts in environment_counts:  # each worker's environments' counters
            for key, counters in counts.items():
                for name, value in counters.items():
                    metric = f"env/{key}/{name}"
                    values[metric] = values.get(metric, 0.0) + value
        step = schedule.trainer_step
        row = {**values, **self.eval_values}
        if self.health is not None:
            row.update(self.health.check(step, row))
        if self.log_metrics(step, row):
            self.eval_values = {}
        log.info(progress_line(step, schedule.end_step, self.stage_steps, values))
        self.window_start = now
        self.counters.reset_window()

    def heartbeat_due(self, every_s: float = 30.0) -> bool:
        """Whether `every_s` passed without a step or a heartbeat (then the heartbeat is counted as given)."""
        now = time.perf_counter()
        if now - max(self.last_heartbeat, self.window_start) < every_s:
            return False
        self.last_heartbeat = now
        return True

    def heartbeat(self, schedule: StageSchedule, buffer_counts: dict[str, int]) -> None:
        """While no step completes, say what the buffer sees (e.g. every group dropped as zero-signal)."""
        log.info("waiting for step %d: %s | in flight %d group(s) | skipped %d prompt(s) longer than "
                 "max_prompt_tokens | %s", schedule.trainer_step + 1,
                 ", ".join(f"{k} {v}" for k, v in buffer_counts.items()), schedule.in_flight_groups(),
                 self.counters.skipped_long_prompts, self._waiting_for(schedule))

    def _waiting_for(self, schedule: StageSchedule) -> str:
        if self.curriculum is not None and self.curriculum.calibrating:
            return (f"calibrating the difficulty schedulers ({self.curriculum.calibration_groups} group(s) so far; "
                    "nothing is trained until they are calibrated)")
        return "training" if schedule.training else "buffer not ready"

    def evaluated(self, report, worker: int) -> None:
        """A held-out evaluation's report (rollout_worker's): its values go with the next row."""
        self.eval_values = held_out_metrics(report.policy_version, report.results)
        if self.health is not None:
            self.health.check_evaluation(self.eval_values)
        log.info("stage %r: held-out accuracy at policy version %d: %s (%.1f s on rollout worker %d)",
                 self.stage_name, report.policy_version, summary(report.results), report.seconds, worker)

    def flush_evaluation(self, step: int) -> None:
        """At the stage's end: log what no row carried yet, at its last step."""
        if self.eval_values and self.log_metrics(step, self.eval_values):
            self.eval_values = {}
