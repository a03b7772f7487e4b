"""Does the planner reproduce a measured run? Runs the tiny RL stage of bench/pipeline_async_vs_sync.py
(same recipe, async and sync), fits the plan's workload to each run's own metrics
(zrl.plan.calibrate.fit_workload), simulates the stage with the real schedule and buffer, and prints
predicted vs measured steps/min, idle fractions and staleness histogram with the relative errors.

    flock /tmp/zrl-heavy.lock .venv/bin/python bench/plan_calibration.py [--steps 10]
"""

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from pipeline_async_vs_sync import each_mode, metric_rows, recipe_for, run  # noqa: E402


def calibrate(mode: str, steps: int, tmp: Path) -> dict:
    from zrl.plan import simulate
    from zrl.plan.calibrate import fit_workload, measured

    run(mode, steps, tmp, tmp / "tiny-model")
    rows = metric_rows(tmp, mode)
    recipe = recipe_for(mode, steps, tmp, tmp / "tiny-model")
    stage = recipe.stages[0]
    workers = recipe.resources.rollout_workers
    workload = fit_workload(rows, stage, workers)
    sim = simulate(stage, workload, workers, steps=steps)
    return {"mode": mode, "measured": measured(rows, stage.asynchrony.max_staleness_steps),
            "predicted": {"steps_per_min": sim.steps_per_hour / 60, "rollout_idle": sim.rollout_idle_frac,
                          "trainer_idle": sim.trainer_idle_frac, "staleness": sim.staleness_rollouts},
            "workload": {"mean_response_tokens": workload.notes["mean_response_tokens"],
                         "response_tokens_std": workload.notes["response_tokens_std"],
                         "prompt_tokens": workload.prompt_tokens,
                         "rollout_tokens_per_busy_s": workload.notes["rollout_tokens_per_busy_s"],
                         "trainer_tokens_per_s": workload.trainer.tokens_per_s,
                         "trainer_overhead_s": workload.trainer.overhead_s, "sync_s": workload.sync_s,
                         "zero_signal_fraction": workload.zero_signal_fraction}}


def rel(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.0f}%" if measured else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results = each_mode(calibrate, args.steps)
    for r in results:
        m, p = r["measured"], r["predicted"]
        print(f"{r['mode']}: fitted workload {json.dumps({k: round(v, 4) for k, v in r['workload'].items()})}")
        for key, label in (("steps_per_min", "steps/min"), ("rollout_idle", "rollout idle"),
                           ("trainer_idle", "trainer idle")):
            print(f"  {label:13s} measured {m[key]:7.3f}  predicted {p[key]:7.3f}  error {rel(p[key], m[key])}")
        print(f"  staleness (rollouts per staleness) measured {m['staleness']}  predicted {p['staleness']}")
    for r in results[1:]:
        ratio = lambda side: r[side]["steps_per_min"] / results[0][side]["steps_per_min"]  # noqa: E731
        print(f"{r['mode']} / sync: measured {ratio('measured'):.2f}x, predicted {ratio('predicted'):.2f}x")


if __name__ == "__main__":
    main()
