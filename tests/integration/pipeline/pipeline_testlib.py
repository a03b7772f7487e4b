"""Recipes for the pipeline tests: one small RL stage on the tiny model with the coin-flip environment."""

import yaml

STEPS = 8


def recipe_data(tmp_path, model_dir, steps=STEPS, evaluation=None, **asynchrony) -> dict:
    """`model_dir`: a checkpoint, or a scratch path (last component `tiny-*`) where the run builds the tiny
    model (build_tiny_if_missing builds nowhere else: zrl/hub.py); `evaluation`: the stage's block."""
    data = {
        "name": "pipeline-test", "model": {"path": str(model_dir), "build_tiny_if_missing": True, "dtype": "float32"},
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "resources": {"rollout_workers": 1, "trainer_workers": 2, "cpus_per_rollout_worker": 0.5,
                      "cpus_per_trainer_worker": 0.5, "trainer_microbatch_tokens": 256},
        "metrics": {"wandb": {"enabled": False}, "tensorboard": False},
        "stages": [{
            "name": "rl", "kind": "rl", "steps": steps, "checkpoint_every_steps": 4,
            "environments": [{"name": "coinflip_env:CoinFlip"}],
            "sampling": {"prompts_per_batch": 4, "group_size": 4, "max_prompt_tokens": 48, "max_response_tokens": 8},
            "algorithm": {"length_reward": {"enabled": False}, "canaries": {"lz77": {"enabled": False}}},
            "optimizer": {"muon": {"lr": 1e-3}},
            "asynchrony": {"sync_every_steps": 1, "max_staleness_steps": 2, "min_ready_batches": 2,
                           "buffer_capacity_batches": 4, **asynchrony},
        }],
    }
    if evaluation is not None:
        data["stages"][0]["evaluation"] = evaluation
    return data


def write_recipe(tmp_path, model_dir, **kwargs):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_data(tmp_path, model_dir, **kwargs)))
    return path


