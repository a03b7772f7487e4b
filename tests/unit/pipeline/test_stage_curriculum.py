"""The stage driver's curriculum: levels handed to rounds, reports from verified groups, calibration
before training, metrics, checkpoint state and inheritance (no Ray: zrl.pipeline.stage_curriculum)."""

import json

import numpy as np
import pytest

from zrl.config.schema import EnvironmentSpec
from zrl.curriculum import SchedulerConfig
from zrl.pipeline.stage_curriculum import AdaptiveEntry, StageCurriculum, adaptive_entries
from zrl.prompts import build_entries
from zrl.types import Verification

G = 8


def group(successes: int, error: str | None = None) -> list[Verification]:
    return [Verification(1.0 if i < successes else 0.0, error=error if i == 0 else None) for i in range(G)]


def stage_curriculum(configs: dict[str, SchedulerConfig], seed: int) -> StageCurriculum:
    return StageCurriculum([AdaptiveEntry(key, config, None) for key, config in configs.items()], seed)


def current(c: StageCurriculum, key: str = "strings") -> int:
    return c.assignments(1)[key]


def learner(level: int, crossing: float, rng) -> list[Verification]:
    """A simulated policy that solves level d with probability sigmoid(-(d - crossing))."""
    return group(int(rng.binomial(G, 1 / (1 + np.exp(level - crossing)))))


def test_adaptive_entries_get_the_environments_levels_and_their_own_settings():
    entries = adaptive_entries(build_entries([
        EnvironmentSpec(name="strings", difficulty="adaptive", curriculum={"calibration_max_groups": 9}),
        EnvironmentSpec(name="arithmetic", key="sums", difficulty="adaptive"),
        EnvironmentSpec(name="math"),
        EnvironmentSpec(name="arithmetic", difficulty=3)]))
    configs = {e.key: e.config for e in entries}
    assert set(configs) == {"strings", "sums"} and all(e.tasks is None for e in entries)
    assert (configs["strings"].min_level, configs["strings"].max_level) == (0, 20)
    assert configs["strings"].calibration_max_groups == 9
    assert configs["sums"].calibration_max_groups == SchedulerConfig().calibration_max_groups
    with pytest.raises(ValueError, match=r"^environments.math.difficulty: 'math' takes no difficulty level$"):
        adaptive_entries(build_entries([EnvironmentSpec(name="math", difficulty="adaptive")]))


def test_calibration_holds_training_until_the_crossing_is_found_then_levels_follow_the_learner():
    rng = np.random.default_rng(0)
    c = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=20)}, seed=1)
    calibration = 0
    while c.calibrating:
        level = current(c)
        c.report("strings", level, learner(level, 6.0, rng))
        calibration += 1
        assert calibration < 40
    assert c.curriculum.schedulers["strings"].calibrated
    assert c.calibration_groups == calibration
    assert abs(c.curriculum.schedulers["strings"].crossing - 6.0) < 3
    for _ in range(60):  # the policy improves: its crossing moves to 12
        level = current(c)
        c.report("strings", level, learner(level, 12.0, rng))
    assert current(c) >= 9
    assert not c.calibrating


def test_an_entry_that_never_calibrates_stops_holding_the_stage_after_its_limit():
    c = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=20, calibration_max_groups=6)}, seed=0)
    for _ in range(5):
        c.report("strings", current(c), group(0))  # never solved: pinned at level 0
        assert c.calibrating
    c.report("strings", current(c), group(0))
    assert not c.calibrating and not c.curriculum.schedulers["strings"].calibrated
    assert current(c) == 0


def test_stale_levels_and_verifier_errors_update_nothing():
    c = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=20)}, seed=0)
    scheduler = c.curriculum.schedulers["strings"]
    level = current(c)
    assert not c.report("strings", level, group(4, error="timeout after 5 s"))
    assert scheduler.n_updates == 0
    while current(c) == level:  # accepted groups move the level on (all solved: upwards)
        assert c.report("strings", level, group(G))
    updates = scheduler.n_updates
    assert not c.report("strings", level, group(0))  # a group still in flight at the old level
    assert scheduler.n_updates == updates
    assert c.metrics()["curriculum/strings/stale_groups"] == 1


def test_a_level_whose_prompts_are_too_long_to_pose_counts_as_failed_and_the_level_comes_down():
    """A policy that solves every problem it is shown, but problems above level 12 are longer than
    max_prompt_tokens (skipped, never generated): each skip is a failed group at its level, so the
    scheduler settles at the edge (12-13) instead of stalling above it, unheard."""
    rng = np.random.default_rng(0)
    c = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=20)}, seed=3)
    levels = []
    for _ in range(120):
        levels.append(level := current(c))
        if level > 12:
            c.report_unposable("strings", level, G)
        else:
            c.report("strings", level, learner(level, 30.0, rng))
    assert c.curriculum.schedulers["strings"].n_updates == 120
    assert set(levels[-40:]) == {12, 13}  # measured for seeds 0-3: only 12 and 13 in the last 40 draws


def test_metrics_cover_each_entry_and_reset_the_window():
    c = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=20)}, seed=0)
    level = current(c)
    c.report("strings", level, group(6))
    values = c.metrics()
    assert values["curriculum/strings/solve_rate"] == 6 / G
    assert values["curriculum/strings/window_groups"] == 1
    assert values["curriculum/calibrating"] == 1.0
    assert {"curriculum/strings/difficulty", "curriculum/strings/mu_mean", "curriculum/strings/ess"} <= set(values)
    assert "curriculum/strings/solve_rate" not in c.metrics()  # no group since the last call


def test_checkpoint_state_continues_identically_and_the_next_stage_inherits_it():
    rng = np.random.default_rng(3)
    configs = {"strings": SchedulerConfig(min_level=0, max_level=20)}
    a = stage_curriculum(configs, seed=5)
    for _ in range(10):
        level = current(a)
        a.report("strings", level, learner(level, 8.0, rng))
    b = stage_curriculum(configs, seed=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(10):
        level = current(a)
        assert current(b) == level
        result = learner(level, 8.0, rng)
        assert a.report("strings", level, result) == b.report("strings", level, result)
    assert a.state_dict() == b.state_dict()

    following = stage_curriculum({**configs, "sums": SchedulerConfig(min_level=0, max_level=20)}, seed=9)
    following.inherit(a.state_dict())
    assert following.curriculum.schedulers["strings"].state_dict() == a.curriculum.schedulers["strings"].state_dict()
    assert following.calibrating  # "sums" is new: it still calibrates
    same = stage_curriculum(configs, seed=9)
    same.inherit(a.state_dict())
    assert not same.calibrating
    other = stage_curriculum({"strings": SchedulerConfig(min_level=0, max_level=10)}, seed=9)
    other.inherit(a.state_dict())  # other settings: starts fresh, with a warning
    assert other.calibrating and other.curriculum.schedulers["strings"].n_updates == 0


def test_an_environment_with_tasks_gets_a_scheduler_per_task_and_least_sampled_proposals():
    from zrl.prompts import PromptSource

    specs = [EnvironmentSpec(name="rlve_gym", options={"environments": ["Multiplication", "Sorting"]},
                             difficulty="adaptive"),
             EnvironmentSpec(name="strings", difficulty="adaptive")]
    entries = adaptive_entries(build_entries(specs))
    assert [(e.key, e.tasks) for e in entries] == [("rlve_gym", ("Multiplication", "Sorting")), ("strings", None)]
    c = StageCurriculum(entries, seed=0)
    assert c.keys == ["rlve_gym/Multiplication", "rlve_gym/Sorting", "strings"]
    proposals = c.assignments(6)["rlve_gym"]
    assert len(proposals) == 6 and {task for task, _ in proposals} == {"Multiplication", "Sorting"}
    counts = c.curriculum.groups_proposed()
    assert abs(counts["rlve_gym/Multiplication"] - counts["rlve_gym/Sorting"]) <= 2

    source = PromptSource(specs[:1], seed=0)
    drawn = source.draw(4, {"rlve_gym": [("Sorting", 2), ("Multiplication", 0), ("Sorting", 2), ("Sorting", 1)]})
    assert [level for _, level in drawn] == [("rlve_gym/Sorting", 2), ("rlve_gym/Multiplication", 0),
                                              ("rlve_gym/Sorting", 2), ("rlve_gym/Sorting", 1)]
    assert [(p.payload["environment"], p.difficulty, p.env) for p, _ in drawn] == [
        ("Sorting", 2, "rlve_gym"), ("Multiplication", 0, "rlve_gym"), ("Sorting", 2, "rlve_gym"),
        ("Sorting", 1, "rlve_gym")]
    source.entries[0].env.close()

    key, at = "rlve_gym/Sorting", c.curriculum.schedulers["rlve_gym/Sorting"].level()
    assert c.report(key, at, group(3))
    assert c.curriculum.schedulers[key].n_updates == 1
    assert c.curriculum.schedulers["rlve_gym/Multiplication"].n_updates == 0
    values = c.metrics()
    assert values["curriculum/rlve_gym/Sorting/solve_rate"] == 3 / G
    assert "curriculum/rlve_gym/Sorting/ess" not in values  # per task: level, crossing and solve rate only
    assert values["curriculum/rlve_gym/calibrated_fraction"] == 0.0
    assert "curriculum/strings/ess" in values
