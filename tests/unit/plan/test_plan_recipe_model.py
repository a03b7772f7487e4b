"""`zrl plan` plans the recipe's own model: a Hub model whose config.json is not here needs a workload
that gives its FLOP model, and the GLM-4.5-Air recipe's workload file gives it."""

from pathlib import Path

from zrl.cli import main

ROOT = Path(__file__).resolve().parents[3]
AIR = str(ROOT / "recipes" / "glm-4.5-air.yaml")
AIR_WORKLOAD = str(ROOT / "bench" / "plan_glm45_air_workload.yaml")


def test_an_absent_hub_model_without_its_flop_model_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))  # nothing cached
    assert main(["plan", AIR, "--rollout-gpus", "8", "--steps", "4"]) == 2
    line = capsys.readouterr().err.strip()
    assert "model.path: zai-org/GLM-4.5-Air: its config.json is not here" in line
    assert "active_params, layers, attention_dim" in line and "hf download zai-org/GLM-4.5-Air" in line
    partial = tmp_path / "w.yaml"
    partial.write_text("layers: 46\n")
    assert main(["plan", AIR, "--rollout-gpus", "8", "--steps", "4", "--workload", str(partial)]) == 2
    assert "active_params, attention_dim" in capsys.readouterr().err


def test_the_air_recipe_plans_with_its_workload(capsys):
    assert main(["plan", AIR, "--workload", AIR_WORKLOAD, "--rollout-gpus", "8", "--steps", "4"]) == 0
    assert "rollout 8 GPU(s) = 8 worker(s), trainer 4 GPU(s)" in capsys.readouterr().out
