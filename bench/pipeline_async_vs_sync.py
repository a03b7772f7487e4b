"""Asynchronous vs synchronous pipeline on the same tiny RL stage: steps/minute and pool idle fractions.

Both runs use the same code (zrl.pipeline), model, environment, batch and seed; only the asynchrony
differs: async = PipelineRL (sync every 2 steps, staleness <= 2, 2 ready batches), sync = generation
paused while the trainer steps (sync every step, staleness 0, 1 ready batch). The environment is the
test suite's coin flip (an untrained model gets mixed rewards from it, so every step has signal).

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


def run(mode: str, steps: int, workdir: Path, model_dir: Path) -> dict:
    import ray

    from zrl.config import parse_recipe
    from zrl.pipeline.controller import Cascade
    from zrl.run import prepare_model

    sys.path.insert(0, str(ENV_DIR))
    from pipeline_testlib import recipe_data

    asynchrony = ({"sync_every_steps": 2, "max_staleness_steps": 2, "min_ready_batches": 2} if mode == "async"
                  else {"sync_every_steps": 1, "max_staleness_steps": 0, "min_ready_batches": 1})
    data = recipe_data(workdir / mode, model_dir, steps=steps, **asynchrony)
    data["stages"][0]["sampling"].update(prompts_per_batch=8, group_size=8, max_response_tokens=32)
    data["stages"][0]["checkpoint_every_steps"] = 10 * steps
    recipe = parse_recipe(data)
    model_path = prepare_model(recipe)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    try:
        started = time.perf_counter()
        Cascade(recipe, model_path).run()
        wall = time.perf_counter() - started
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (workdir / mode / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:]  # the first step includes engine start-up and compilation
    span = steady[-1]["time"] - rows[0]["time"]
    mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
    return {"mode": mode, "steps": steps, "wall_s": wall, "steps_per_min": 60 * len(steady) / span,
            "rollout_idle": mean("throughput/rollout_idle_frac"), "trainer_idle": mean("throughput/trainer_idle_frac"),
            "max_staleness": max(r["batch/max_staleness"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(ENV_DIR)
    from zrl.runtime_env import apply_defaults

    apply_defaults()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = [run(mode, args.steps, tmp, tmp / "model") for mode in ("sync", "async")]
    for r in results:
        print(f"{r['mode']:5s}: {r['steps_per_min']:6.1f} steps/min | rollout idle {100 * r['rollout_idle']:4.0f}% | "
              f"trainer idle {100 * r['trainer_idle']:4.0f}% | max staleness {r['max_staleness']} | wall {r['wall_s']:.0f} s")
    print(f"async / sync steps per minute: {results[1]['steps_per_min'] / results[0]['steps_per_min']:.2f}x")


if __name__ == "__main__":
    main()
