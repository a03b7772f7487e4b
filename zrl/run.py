"""`zrl run`: everything that happens before the first stage trains.

Responsibilities: create the run directory and record the resolved recipe in it; make the model
assets exist (building the tiny CPU checkpoint when the recipe asks for it); connect to the Ray
cluster named by `--address` (or the one `ray job submit` provides) or start an embedded one; and
check that the cluster can host the recipe's rollout and trainer pools before anything is launched.
Then it hands the recipe to the cascade controller (zrl/pipeline/controller.py).
"""

import json
import logging
import os
from pathlib import Path

import yaml

from zrl.config import Recipe

log = logging.getLogger("zrl")


def prepare_model(recipe: Recipe) -> Path:
    from zrl.assets import build_tiny_model, is_checkpoint_dir

    path = Path(recipe.model.path)
    if is_checkpoint_dir(path):
        log.info("model: %s", path)
    elif recipe.model.build_tiny_if_missing:
        log.info("model: building the tiny CPU checkpoint and tokenizer at %s", path)
        build_tiny_model(path, seed=recipe.seed)
    else:
        raise FileNotFoundError(f"model.path {path} is not a zaya checkpoint directory")
    return path


def required_resources(recipe: Recipe) -> dict[str, float]:
    r = recipe.resources
    return {
        "CPU": r.rollout_workers * r.cpus_per_rollout_worker + r.trainer_workers * r.cpus_per_trainer_worker,
        "GPU": r.rollout_workers * r.gpus_per_rollout_worker + r.trainer_workers * r.gpus_per_trainer_worker,
    }


def connect_ray(address: str | None):
    """Join the cluster at `address`, the one a `ray job submit` driver runs in, or start an embedded one."""
    import ray

    if address and address.startswith(("http://", "https://")):
        # The jobs/dashboard address is not a driver address; a driver on the cluster joins it with "auto".
        address = "auto"
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address:
        log.info("ray: connecting to %s", address)
        ray.init(address=address, log_to_driver=True)
    else:
        log.info("ray: starting an embedded instance")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True)
    return ray


def check_capacity(cluster: dict[str, float], needed: dict[str, float]) -> list[str]:
    return [f"resources: the recipe needs {amount:g} {kind} but the cluster has {cluster.get(kind, 0):g}"
            for kind, amount in needed.items() if amount > cluster.get(kind, 0) + 1e-9]


def run_recipe(recipe: Recipe, address: str | None = None) -> int:
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    log.info("run directory: %s (resolved recipe written)", out)
    model_path = prepare_model(recipe)
    ray = connect_ray(address)
    try:
        cluster = ray.cluster_resources()
        needed = required_resources(recipe)
        log.info("ray: cluster %s; recipe needs %s", json.dumps({k: cluster.get(k, 0) for k in needed}),
                 json.dumps(needed))
        problems = check_capacity(cluster, needed)
        if problems:
            for line in problems:
                log.error(line)
            return 2
        from zrl.pipeline.controller import Cascade

        step = Cascade(recipe, model_path).run()
        log.info("cascade %r finished at trainer step %d; run directory %s", recipe.name, step, out)
        return 0
    finally:
        ray.shutdown()
