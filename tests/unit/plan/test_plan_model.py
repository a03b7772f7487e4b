"""The planner's trainer FLOP model comes from the recipe's checkpoint through the model contract
(zrl/models), except for the fields a workload file sets itself."""

import json
from pathlib import Path

from zrl.cli import main
from zrl.models import FlopModel, get_family
from zrl.plan.report import WorkloadSpec, with_model

TINY = str(Path(__file__).resolve().parents[3] / "recipes" / "tiny-cpu.yaml")


def test_with_model_fills_what_the_workload_left_unset():
    flops = FlopModel(total_params=10**6, active_params=2 * 10**5, num_layers=3, attention_dim=128)
    spec = with_model(WorkloadSpec(), flops)
    assert (spec.active_params, spec.layers, spec.attention_dim) == (2e5, 3, 128)
    kept = with_model(WorkloadSpec.model_validate({"layers": 7}), flops)
    assert (kept.active_params, kept.layers, kept.attention_dim) == (2e5, 7, 128)


def plan_json(capsys, model_path) -> dict:
    args = ["plan", TINY, "--rollout-gpus", "1", "--steps", "8", "--json", "--set", f"model.path={model_path}"]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_takes_the_checkpoints_flop_model(tmp_path, capsys):
    """A tiny checkpoint's trainer is orders of magnitude faster than the ZAYA1-8B default: it idles more."""
    tiny = plan_json(capsys, get_family("qwen3_moe").build_tiny(tmp_path / "tiny-qwen"))
    default = plan_json(capsys, tmp_path / "no-such-checkpoint")
    assert tiny["async"]["trainer_idle_frac"] > default["async"]["trainer_idle_frac"]
