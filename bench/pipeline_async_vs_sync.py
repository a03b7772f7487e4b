"""Asynchronous vs synchronous pipeline on the same tiny RL stage: steps/minute and pool idle fractions.

The runs use the same code (zrl.pipeline), model, environment, batch and seed; only the asynchrony
differs (MODES): sync = generation paused while the trainer steps (sync every step, staleness 0, 1 ready
batch); async = staleness <= 2, 2 ready batches, weights synced every step (zrl's default); async-every2 =
the same with the ZAYA1-8B report's sync every 2 steps (zrl's default before the planner's finding,
bench/results/plan_zaya1.md). The environment is the test suite's coin flip (an untrained model gets
mixed rewards from it, so every step has signal).

    .venv/bin/python bench/pipeline_async_vs_sync.py [--steps 10]
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = ROOT / "tests" / "integration" / "pipeline"


MODES = {"sync": {"sync_every_steps": 1, "max_staleness_steps": 0, "min_ready_batches": 1},
         "async": {"sync_every_steps": 1, "max_staleness_steps": 2, "min_ready_batches": 2},
         "async-every2": {"sync_every_steps": 2, "max_staleness_steps": 2, "min_ready_batches": 2}}


def recipe_for(mode: str, steps: int, workdir: Path, model_dir: Path):
    """The tiny stage in `mode` (a key of MODES), running in workdir/mode."""
    from zrl.config import parse_recipe

    sys.path.insert(0, str(ENV_DIR))
    from pipeline_testlib import recipe_data

    data = recipe_data(workdir / mode, model_dir, steps=steps, **MODES[mode])
    data["stages"][0]["sampling"].update(prompts_per_batch=8, group_size=8, max_response_tokens=32)
    data["stages"][0]["checkpoint_every_steps"] = 10 * steps
    return parse_recipe(data)


def run(mode: str, steps: int, workdir: Path, model_dir: Path) -> dict:
    import ray

    from zrl.pipeline.controller import Cascade
    from zrl.plan.calibrate import measured
    from zrl.run import prepare_model

    recipe = recipe_for(mode, steps, workdir, model_dir)
    model_path = prepare_model(recipe)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    try:
        started = time.perf_counter()
        Cascade(recipe, model_path).run()
        wall = time.perf_counter() - started
    finally:
        ray.shutdown()
    rows = metric_rows(workdir, mode)
    # steps after the first (it includes engine start-up and compilation), as the stage report counts them
    return {"mode": mode, "steps": steps, "wall_s": wall,
            **measured(rows, recipe.stages[0].asynchrony.max_staleness_steps),
            "max_staleness": max(r["batch/max_staleness"] for r in rows)}


def metric_rows(workdir: Path, mode: str) -> list[dict]:
    return [json.loads(line) for line in (workdir / mode / "run" / "metrics.jsonl").read_text().splitlines()]


def each_mode(fn, steps: int) -> list:
    """fn(mode, steps, workdir) for each of MODES in order, in one temporary directory (one tiny model)."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ENV_DIR), str(ROOT)])  # actors import this tree's zrl
    from zrl.runtime_env import apply_defaults

    apply_defaults()
    with tempfile.TemporaryDirectory() as tmp:
        return [fn(mode, steps, Path(tmp)) for mode in MODES]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results = each_mode(lambda mode, steps, tmp: run(mode, steps, tmp, tmp / "tiny-model"), args.steps)
    for r in results:
        print(f"{r['mode']:12s}: {r['steps_per_min']:6.1f} steps/min | rollout idle {100 * r['rollout_idle']:4.0f}% | "
              f"trainer idle {100 * r['trainer_idle']:4.0f}% | max staleness {r['max_staleness']} | "
              f"rollouts by staleness {r['staleness']} | wall {r['wall_s']:.0f} s")
    for r in results[1:]:
        print(f"{r['mode']} / sync steps per minute: {r['steps_per_min'] / results[0]['steps_per_min']:.2f}x")


if __name__ == "__main__":
    main()
