"""The `zrl` console script: one clear line per bad input, no traceback, non-zero exit."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ZRL = str(Path(sys.executable).parent / "zrl")


def zrl(*args, cwd=ROOT):
    return subprocess.run([ZRL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_clean_error(result, *fragments):
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0]


def write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


GOOD = """name: r
model: {path: m}
output_dir: out
stages:
  - {name: s, kind: rl, steps: 2, environments: [{name: no_such_env}]}
"""


def test_missing_file():
    assert_clean_error(zrl("validate", "nope.yaml"), "nope.yaml: file not found")


def test_bad_yaml(tmp_path):
    assert_clean_error(zrl("validate", write(tmp_path, "name: [x\n")), "invalid YAML: line")


def test_unknown_field(tmp_path):
    assert_clean_error(zrl("validate", write(tmp_path, GOOD + "colour: blue\n")), "colour: unknown field")


def test_wrong_type(tmp_path):
    assert_clean_error(zrl("validate", write(tmp_path, GOOD.replace("steps: 2", "steps: two"))),
                       "stages[0].steps:", "'two'")


def test_out_of_range_from_override(tmp_path):
    assert_clean_error(zrl("validate", write(tmp_path, GOOD), "--set", "stages.0.sampling.group_size=0"),
                       "stages[0].sampling.group_size:", "greater than or equal to 1")


def test_validate_prints_resolved_recipe_and_availability(tmp_path):
    result = zrl("validate", write(tmp_path, GOOD), "--set", "stages.s.steps=5")
    assert result.returncode == 0, result.stderr
    assert "steps: 5" in result.stdout and "group_size: 16" in result.stdout
    assert "# schema: OK (1 stages)" in result.stdout
    assert "stages[0].environments[0].name: unknown environment 'no_such_env'; valid names: aggregation, arithmetic" in result.stdout
    assert "model.path: m is not a zaya checkpoint directory" in result.stdout


def test_validate_lists_each_stages_data_files(tmp_path):
    run = tmp_path / "run"
    result = zrl("validate", "recipes/zaya1-mini-cpu.yaml", "--set", f"output_dir={run}")
    assert result.returncode == 0, result.stderr
    assert "# availability: every environment and the model are available" in result.stdout
    assert (f"# data of stage math_code_ttc_general:\n#   copy_ttc_self: {run}/stages/rlve_gym/rollouts/strings.jsonl: "
            "written by stage rlve_gym\n") in result.stdout
    present = GOOD.replace("{name: no_such_env}", "{name: math, options: {data_files: environments/data/math_sample.jsonl}}, "
                                                  "{name: math, key: m2, options: {data_files: [nowhere/m.jsonl]}}")
    result = zrl("validate", write(tmp_path, present))
    assert ("# data of stage s:\n#   math: environments/data/math_sample.jsonl: present\n"
            "#   m2: nowhere/m.jsonl: missing\n") in result.stdout


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_validates(recipe):
    result = zrl("validate", f"recipes/{recipe}")
    assert result.returncode == 0, result.stderr
    assert "# schema: OK" in result.stdout


def test_run_refuses_a_missing_model_before_starting_anything(tmp_path):
    result = zrl("run", write(tmp_path, GOOD))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"zrl: error: {tmp_path / 'r.yaml'}: model.path: m is not a zaya checkpoint directory (config.json and "
        "*.safetensors) and build_tiny_if_missing is false",
        f"zrl: error: {tmp_path / 'r.yaml'}: stages[0].environments[0].name: unknown environment 'no_such_env'; "
        "valid names: aggregation, arithmetic, chat_reward_model, code, code_auxiliary, hard_instruction_following, "
        "math, reasoning_gym, rlve_gym, simple_instruction_following, strings (or use a `module:Class` reference)"]


def test_envs_lists_entry_points_or_says_none():
    result = zrl("envs")
    assert result.returncode == 0 and result.stdout.strip()


def test_no_command_is_a_usage_error():
    result = zrl()
    assert result.returncode == 2 and "usage: zrl" in result.stderr
