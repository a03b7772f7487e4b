"""Learning-health checks of an RL stage: the signals that say learning went wrong, and what the run does.

Every metric row of the stage goes through `HealthMonitor.check`, and every held-out evaluation through
`check_evaluation` as it comes in (not with the row that carries it: a collapsed stage may make no more
rows). A signal whose condition holds is an alarm. Its onset is reported
once, not on every row while it holds: a warning line naming the stage, the step, the signal, the value
and its band; a line in `<output_dir>/alarms.jsonl`, which nothing rewinds (it is the run's history,
rollbacks included), and which the cascade report marks. Every row carries `health/alarms` (onsets so far
in the stage) and `health/active` (signals holding on this row).

Signals (the stage's `health` block; a threshold of null turns its check off):
- `held_out_drop`: an entry's held-out accuracy is below the stage's first evaluation by more than
  `held_out_sigmas` standard errors of the difference (each a binomial sqrt(p (1 - p) / n), n = prompts x
  samples). The baseline is the evaluation of the policy the stage started from (`evaluation.every_steps`).
- `canary`: the LZ77-flagged or gibberish fraction of the rollouts received since the previous row
  exceeds `max_canary_frac` (a policy falling into repetition: the LZ77 gate zeroes those rewards, so the
  trained batch's reward does not show it).
- `mismatch`: the on-policy engine/trainer KL exceeds `max_mismatch_kl` over at least MIN_MISMATCH_TOKENS
  tokens (the engine samples from other weights than the trainer trains).
- `grad_norm`: grad/norm_total exceeds `grad_norm_factor` x the median of the stage's earlier steps, from
  its `grad_norm_warmup_steps`-th step on.

What the run does (`health.on_alarm`): `warn` only reports. `stop` stops the stage after the step
(`StageStopped`; the run is resumable from its latest checkpoint). `rollback` raises `RollBack`: the run
goes back to its newest checkpoint at or before the last step that was healthy (`good_step`) and goes on
from there on a fresh prompt and sampling stream (the stage's seed moves on with each rollback, so the run
does not replay the steps that led to the alarm), at most `max_rollbacks` times in a stage; the next alarm
then stops it. A rollback is recorded in alarms.jsonl (`signal: rollback`), which is where a resumed run
counts them.

`good_step` is the newest step such that no signal held on its row, and no held-out evaluation of a later
policy version than it fell below the baseline.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from zrl.config.schema import Health
from zrl.pipeline.faults import StageStopped
from zrl.pipeline.held_out import POLICY_VERSION

log = logging.getLogger("zrl")

CANARIES = ("canary/lz77_flagged_fraction", "canary/gibberish_frac")
# A k3 mean over fewer on-policy tokens is noise, not a band crossing (a collapsed policy scored 2 tokens at
# 0.0225 in an fp32 run whose other steps measured ~3e-13).
MIN_MISMATCH_TOKENS = 32
ROLLBACK_SEED_STRIDE = 1_000_003  # a rolled-back stage's seed moves on by this (stage seeds differ by steps)


@dataclass(frozen=True)
class Alarm:
    stage: str
    step: int
    signal: str    # held_out_drop | canary | mismatch | grad_norm
    message: str   # what was seen and its band, one line
    action: str    # the stage's on_alarm


class RollBack(StageStopped):
    """The run goes back to its newest checkpoint at or before `good_step` (zrl/run.py)."""

    def __init__(self, message: str, stage: str, alarm_step: int, good_step: int):
        super().__init__(message)
        self.stage, self.alarm_step, self.good_step = stage, alarm_step, good_step


def standard_error(accuracy: float, n: int) -> float:
    """Binomial standard error of a mean reward over `n` samples (0 for n < 1)."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / n) if n >= 1 else 0.0


def baseline_from_metrics(metrics_path: str | Path, start_version: int) -> dict[str, float]:
    """Entry -> held-out accuracy of policy version `start_version`, from the run's metric rows (a resumed or
    rolled-back stage keeps the baseline its start measured); empty when none was logged."""
    path = Path(metrics_path)
    for line in path.read_text().splitlines() if path.is_file() else ():
        row = json.loads(line) if line.strip() else {}
        if row.get(POLICY_VERSION) == start_version:
            return {k.split("/")[1]: v for k, v in row.items()
                    if k.startswith("eval/") and k.endswith("/accuracy") and isinstance(v, (int, float))}
    return {}


class HealthMonitor:
    def __init__(self, stage_name: str, health: Health, *, eval_samples: int, start_version: int,
                 alarms_path: str | Path | None = None, baseline: dict[str, float] | None = None,
                 rollbacks: int = 0):
        """`eval_samples`: prompts x samples of one held-out evaluation of an entry; `start_version`: the
        policy the stage started from (its evaluation is the baseline, unless `baseline` is given);
        `rollbacks`: rollbacks the stage made already."""
        self.stage, self.health, self.eval_samples = stage_name, health, eval_samples
        self.alarms_path = None if alarms_path is None else Path(alarms_path)
        self.baseline: dict[str, float] = dict(baseline or {})
        self.rollbacks = rollbacks
        self.alarms: list[Alarm] = []
        self.good_step = start_version
        self._holding: set[str] = set()
        self._grad_norms: list[float] = []
        self._low: str | None = None            # the latest evaluation's drop below the baseline
        self._last_good_eval = start_version    # policy version of the latest evaluation without one
        self._pending: Alarm | None = None  # the first alarm that asks for more than a warning

    def check(self, step: int, row: dict[str, float]) -> dict[str, float]:
        """Check one metric row (step `step`); returns the `health/*` values to log with it."""
        found = {}  # signal -> message, for every signal holding on this row
        h = self.health
        if self._low is not None:  # the latest evaluation's verdict (checked as it came in)
            found["held_out_drop"] = self._low
        if h.max_canary_frac is not None:
            for key in CANARIES:
                value = row.get(key)
                if value is not None and value > h.max_canary_frac:
                    found["canary"] = f"{key} {value:.3f} > {h.max_canary_frac:g}"
        kl, tokens = row.get("mismatch/onpolicy_kl_k3"), row.get("mismatch/onpolicy_num_tokens", 0.0)
        if h.max_mismatch_kl is not None and kl is not None and tokens >= MIN_MISMATCH_TOKENS and kl > h.max_mismatch_kl:
            found["mismatch"] = f"mismatch/onpolicy_kl_k3 {kl:.3g} > {h.max_mismatch_kl:g} ({tokens:.0f} tokens)"
        norm = row.get("grad/norm_total")
        if h.grad_norm_factor is not None and norm is not None and math.isfinite(norm):
            if len(self._grad_norms) >= h.grad_norm_warmup_steps:
                median = statistics.median(self._grad_norms)
                if norm > h.grad_norm_factor * median:
                    found["grad_norm"] = (f"grad/norm_total {norm:.3g} > {h.grad_norm_factor:g} x the stage's "
                                          f"median {median:.3g}")
            self._grad_norms.append(norm)
        if not found:
            self.good_step = step
        elif "held_out_drop" in found:  # the rows since the last good evaluation looked quiet, but were not
            self.good_step = min(self.good_step, self._last_good_eval)
        for signal, message in found.items():
            if signal not in self._holding:
                self._raise(Alarm(self.stage, step, signal, message, h.on_alarm))
        self._holding = set(found)
        return {"health/alarms": float(len(self.alarms)), "health/active": float(len(found))}

    def check_evaluation(self, values: dict[str, float]) -> None:
        """Check a held-out evaluation as it comes in (`held_out_metrics` values): the row that carries it
        may come much later, or never when the stage stops making steps. Its verdict holds for the rows
        until the next evaluation; an alarm's step is the evaluated policy version."""
        drop = self._held_out_drop(values)
        if drop is None:
            self._holding.discard("held_out_drop")
            return
        self.good_step = min(self.good_step, self._last_good_eval)
        if "held_out_drop" not in self._holding:
            self._raise(Alarm(self.stage, int(values[POLICY_VERSION]), "held_out_drop", drop, self.health.on_alarm))
            self._holding.add("held_out_drop")

    def _held_out_drop(self, row: dict[str, float]) -> str | None:
        """Why the evaluation `row` is below the stage's start, or None (also kept as `_low`)."""
        if self.health.held_out_sigmas is None:
            return None
        version = int(row[POLICY_VERSION])
        accuracies = {k.split("/")[1]: v for k, v in row.items()
                      if k.startswith("eval/") and k.endswith("/accuracy") and math.isfinite(v)}
        if not self.baseline:  # the stage's first evaluation (the policy it started from)
            self.baseline = accuracies
        drops = []
        for entry, accuracy in accuracies.items():
            start = self.baseline.get(entry)
            if start is None:
                continue
            band = self.health.held_out_sigmas * math.hypot(standard_error(start, self.eval_samples),
                                                            standard_error(accuracy, self.eval_samples))
            if start - accuracy > band:
                drops.append(f"{entry} {accuracy:.3f} at policy version {version} is below the stage's start "
                             f"{start:.3f} by more than {self.health.held_out_sigmas:g} standard errors ({band:.3f})")
        self._low = "held-out accuracy: " + "; ".join(drops) if drops else None
        if not drops:
            self._last_good_eval = version
        return self._low

    def _raise(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)
        action = alarm.action
        if action == "rollback" and self.rollbacks >= self.health.max_rollbacks:
            action = "stop"
        what = {"warn": "", "stop": f"; the stage stops (health.on_alarm: {alarm.action})",
                "rollback": f"; rolling back to the newest checkpoint at or before step {self.good_step} "
                            f"(health.on_alarm: rollback)"}[action]
        log.warning("stage %r step %d: ALARM %s: %s%s", alarm.stage, alarm.step, alarm.signal, alarm.message, what)
        if self.alarms_path is not None:
            with self.alarms_path.open("a") as f:
                f.write(json.dumps({**asdict(alarm), "good_step": self.good_step}) + "\n")
        if alarm.action != "warn" and self._pending is None:
            self._pending = alarm

    def stop_request(self) -> StageStopped | None:
        """The exception the stage raises for an alarm that asks for more than a warning, or None."""
        alarm = self._pending
        if alarm is None:
            return None
        message = f"stage {self.stage!r} stopped at step {alarm.step}: {alarm.signal}: {alarm.message}"
        if alarm.action == "rollback" and self.rollbacks < self.health.max_rollbacks:
            return RollBack(message, self.stage, alarm.step, self.good_step)
        if alarm.action == "rollback":
            message += f" (health.max_rollbacks={self.health.max_rollbacks} used up)"
        return StageStopped(message)


def read_alarms(path: str | Path) -> list[dict]:
    """The alarms a run recorded (`alarms.jsonl`), oldest first; none when the file is absent."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def record_rollback(path: str | Path, stage: str, from_step: int, to_step: int) -> None:
    """Append the rollback the run carried out to alarms.jsonl."""
    with Path(path).open("a") as f:
        f.write(json.dumps({"stage": stage, "step": from_step, "signal": "rollback", "action": "rollback",
                            "message": f"rolled back to the checkpoint at step {to_step}",
                            "good_step": to_step}) + "\n")


def rollbacks_made(path: str | Path, stage: str) -> int:
    """Rollbacks the run carried out in `stage` (they move the stage's seed on)."""
    return sum(1 for a in read_alarms(path) if a["stage"] == stage and a["signal"] == "rollback")
