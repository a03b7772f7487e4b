"""The RL stage's adaptive difficulty: the level each new group of an adaptive entry is drawn at, and
what its verified rewards say (the stage driver's side of zrl.curriculum).

Owner: the stage driver (`RLStageRunner`) holds the stage's one `StageCurriculum`. It already makes
every scheduling decision and sees every verified group, including those the buffer then drops (a group
all solved or all failed says the most about the level, and the buffer never admits it), and its data
state is what checkpoints keep. An actor of its own would add a round trip to every round.

Flow: an entry with `difficulty: adaptive` gets a `DifficultyScheduler` under the entry's key, or, when
its environment has `curriculum_tasks()` (RLVE-Gym's generators), one per task under `<key>/<task>`.
When the driver launches a round of n new groups it passes `assignments(n)`: each plain entry's current
level, and for an entry with tasks n (task, level) proposals, least-sampled tasks first, each at its
task's current level. The rollout worker draws the entry's prompts at them and returns the (scheduler
key, level) on the group's ticket; `report()` feeds (key, level, successes, G) to the scheduler. A group drawn at a level that is no longer current (the
scheduler moved while it was generating) is trained on but updates nothing ("stale"). A response counts
as a success when its reward is at least SUCCESS_REWARD (binary environments give 0 or 1); a group with
a verifier error updates nothing (a timeout says nothing about the level).

Calibration: a stage that starts from a fresh scheduler state first brings every adaptive entry to its
0.5 crossing with the starting weights. Until then verified groups are reported here and then dropped,
not trained (`calibrating`); an entry stops holding the stage back once it is calibrated or has reported
`calibration_max_groups` groups (one pinned at its lowest or highest level may never calibrate: the log
and `curriculum/<key>/calibrated` say so). A stage resumed from a checkpoint, or one that inherits the
previous stage's state, is past calibration for the entries that state holds.

Invariants: `state_dict()` is JSON-serialisable and restores the schedulers exactly; metric names are
`curriculum/<key>/<name>` plus `curriculum/calibrating`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from zrl.curriculum import Curriculum, SchedulerConfig
from zrl.prompts import MixtureEntry
from zrl.types import Verification

log = logging.getLogger("zrl")

SUCCESS_REWARD = 0.5
MAX_NAMED = 10  # schedulers named one by one in the calibration log
TASK_METRICS = ("difficulty", "mu_mean", "solve_rate")  # per task of a many-task entry (hundreds of them)


@dataclass(frozen=True)
class AdaptiveEntry:
    key: str                            # the recipe entry's key
    config: SchedulerConfig
    tasks: tuple[str, ...] | None       # a scheduler per task (`<key>/<task>`), or None: one under `key`


def adaptive_entries(entries: Sequence[MixtureEntry]) -> list[AdaptiveEntry]:
    """The stage's `difficulty: adaptive` entries with their scheduler settings; the level range
    defaults to the environment's `difficulty_levels` (zrl validate checks it has some)."""
    adaptive = []
    for entry in entries:
        spec = entry.spec
        if spec.difficulty != "adaptive":
            continue
        levels = entry.env.difficulty_levels
        if levels is None:
            raise ValueError(f"environments.{entry.key}.difficulty: {spec.name!r} takes no difficulty level")
        config = SchedulerConfig(**{"min_level": levels[0], "max_level": levels[1], **spec.curriculum})
        tasks = entry.env.curriculum_tasks()
        adaptive.append(AdaptiveEntry(entry.key, config, None if tasks is None else tuple(tasks)))
    return adaptive


class StageCurriculum:
    def __init__(self, entries: Sequence[AdaptiveEntry], seed: int):
        self.entries = list(entries)
        self.configs = {key: e.config for e in self.entries for key in _scheduler_keys(e)}
        self.curriculum = Curriculum(self.configs, seed)
        self.calibrating = True
        self.calibration_groups = 0   # groups reported while calibrating
        self._window = {key: [0, 0, 0, 0] for key in self.configs}  # successes, responses, stale groups, groups

    @property
    def keys(self) -> list[str]:
        return self.curriculum.names

    def assignments(self, new_groups: int) -> dict[str, int | list[tuple[str, int]]]:
        """What a round of `new_groups` draws its adaptive entries' prompts at: an entry's current level,
        or for an entry with tasks, `new_groups` (task, level) proposals, least-sampled tasks first (the
        round uses as many as the mixture gives the entry, in order)."""
        out = {}
        for e in self.entries:
            if e.tasks is None:
                out[e.key] = self.curriculum.schedulers[e.key].level()
            else:
                keys = _scheduler_keys(e)
                proposals = [self.curriculum.next(among=keys) for _ in range(new_groups)]
                out[e.key] = [(p.environment[len(e.key) + 1:], p.difficulty) for p in proposals]
        return out

    def report(self, key: str, level: int, verifications: Sequence[Verification]) -> bool:
        """A verified group drawn at `level`; False when it updated nothing (stale, or a verifier error)."""
        if any(v.error for v in verifications):
            return False
        return self._record(key, level, sum(v.reward >= SUCCESS_REWARD for v in verifications), len(verifications))

    def report_unposable(self, key: str, level: int, group_size: int) -> bool:
        """A prompt drawn at `level` and skipped as longer than max_prompt_tokens: a group of `group_size`
        failures (the policy cannot solve what it is not shown), so a level whose problems outgrow the
        prompt limit pushes its scheduler down instead of holding it there unheard."""
        return self._record(key, level, 0, group_size)

    def _record(self, key: str, level: int, successes: int, responses: int) -> bool:
        window = self._window[key]
        window[0] += successes
        window[1] += responses
        window[3] += 1
        accepted = self.curriculum.report(key, level, successes, responses)
        window[2] += not accepted
        if self.calibrating:
            self.calibration_groups += 1
            self._end_calibration_when_done()
        return accepted

    def _end_calibration_when_done(self) -> None:
        schedulers = self.curriculum.schedulers
        waiting = [k for k in self.keys if not schedulers[k].calibrated
                   and schedulers[k].n_updates < self.configs[k].calibration_max_groups]
        if waiting:
            return
        self.calibrating = False
        uncalibrated = [k for k in self.keys if not schedulers[k].calibrated]
        for key in self.keys if len(self.keys) <= MAX_NAMED else []:
            s = schedulers[key]
            if s.calibrated:
                log.info("curriculum: %s calibrated at level %s (0.5 crossing %.1f) after %d group(s)", key,
                         s.difficulty, s.crossing, s.n_updates)
        if len(self.keys) > MAX_NAMED:
            levels = [schedulers[k].difficulty for k in self.keys]
            log.info("curriculum: %d of %d schedulers calibrated after %d group(s); levels %d..%d, mean %.1f",
                     len(self.keys) - len(uncalibrated), len(self.keys), self.calibration_groups, min(levels),
                     max(levels), sum(levels) / len(levels))
        if uncalibrated:
            log.warning("curriculum: %s did not calibrate within calibration_max_groups (the policy's 0.5 crossing "
                        "may lie outside the levels: %s); training starts anyway",
                        ", ".join(uncalibrated[:MAX_NAMED]) + (f" and {len(uncalibrated) - MAX_NAMED} more"
                                                              if len(uncalibrated) > MAX_NAMED else ""),
                        ", ".join(f"{k} at {schedulers[k].difficulty} (crossing {schedulers[k].crossing:.1f})"
                                  for k in uncalibrated[:MAX_NAMED]))

    def metrics(self) -> dict[str, float]:
        """The `curriculum/` panel since the last call: per scheduler its summary (for the tasks of a
        many-task entry only level, crossing and solve rate, with the entry's mean level and calibrated
        fraction), the observed solve rate of the window's groups and the stale groups, and whether the
        stage is still calibrating."""
        values = {"curriculum/calibrating": float(self.calibrating)}
        for entry in self.entries:
            keys = _scheduler_keys(entry)
            for key in keys:
                summary = self.curriculum.schedulers[key].summary()
                successes, responses, stale, groups = self._window[key]
                summary |= {"solve_rate": successes / responses if responses else None,
                            "stale_groups": stale, "window_groups": groups}
                names = summary if entry.tasks is None else TASK_METRICS
                values |= {f"curriculum/{key}/{name}": float(summary[name]) for name in names
                           if summary[name] is not None}
                self._window[key] = [0, 0, 0, 0]
            if entry.tasks is not None:
                schedulers = [self.curriculum.schedulers[k] for k in keys]
                levels = [s.difficulty for s in schedulers if s.difficulty is not None]  # reading proposes nothing
                if levels:
                    values[f"curriculum/{entry.key}/mean_difficulty"] = sum(levels) / len(levels)
                values[f"curriculum/{entry.key}/calibrated_fraction"] = sum(s.calibrated for s in schedulers) / len(keys)
        return values

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(), "calibrating": self.calibrating,
                "calibration_groups": self.calibration_groups}

    def load_state_dict(self, state: dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])
        self.calibrating = state["calibrating"]
        self.calibration_groups = state["calibration_groups"]

    def inherit(self, state: dict) -> list[str]:
        """Take over the schedulers of the previous stage's entries with the same keys and settings (their
        posteriors and current levels); those need no calibration. Other entries start fresh. Returns the
        keys taken over."""
        saved = state["curriculum"]["schedulers"]
        taken = []
        for key in self.keys:
            if key not in saved:
                continue
            try:
                self.curriculum.schedulers[key].load_state_dict(saved[key])
                taken.append(key)
            except ValueError as exc:  # other settings in this stage (refused before anything is loaded)
                log.warning("curriculum: %s starts fresh, not from the previous stage's scheduler (%s)", key, exc)
        self.calibrating = self.calibrating and len(taken) < len(self.keys)
        log.info("curriculum: inherited the scheduler state of %s from the previous stage", ", ".join(taken) or "no entry")
        return taken


def _scheduler_keys(entry: AdaptiveEntry) -> list[str]:
    return [entry.key] if entry.tasks is None else [f"{entry.key}/{task}" for task in entry.tasks]
