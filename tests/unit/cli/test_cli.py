"""The `zrl` console script: one clear line per bad input, no traceback, non-zero exit; `zrl validate`
fails on whatever is wrong in the recipe and only lists what is absent on this machine; results on stdout
(a table, or JSON with --json), logs on stderr."""

import json
import logging
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import zrl.env as env_package
from zrl.cli import _ConsoleFormatter, build_parser, main
from zrl.env import Registry

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


VALID = GOOD.replace("{name: no_such_env}", "{name: strings, options: {tasks: copy}}")  # its model `m` is absent here
NOT_A_CHECKPOINT = "model.path: m is not a model checkpoint directory (config.json and *.safetensors)"


def test_validate_summarises_on_one_screen_and_lists_what_is_absent(tmp_path):
    result = zrl("validate", write(tmp_path, VALID), "--set", "stages.s.steps=5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["r: valid, 1 stage, output_dir out", "stage  kind  steps  environments", "s      rl        5  strings"]
    assert lines[-2:] == ["absent on this machine (1 item; a run needs them, --strict fails on them):",
                          f"  {NOT_A_CHECKPOINT} and build_tiny_if_missing is false"]
    assert "group_size" not in result.stdout and result.stderr == ""
    full = zrl("validate", write(tmp_path, VALID), "--set", "stages.s.steps=5", "--full")
    assert full.stdout.startswith(result.stdout) and "  steps: 5\n" in full.stdout and "group_size: 16" in full.stdout


def test_validate_refuses_a_typo_in_an_environment_name_with_the_close_match(tmp_path):
    result = zrl("validate", write(tmp_path, VALID.replace("name: strings", "name: strngs")))
    assert_clean_error(result, "stages[0].environments[0].name: unknown environment 'strngs'; did you mean 'strings'?")
    assert result.stdout == ""


def test_validate_lists_an_absent_dataset_and_strict_fails_on_it(tmp_path):
    recipe = write(tmp_path, VALID.replace("{name: strings, options: {tasks: copy}}",
                                           "{name: math, options: {data_files: [nowhere/m.jsonl]}}"))
    absent = "stages[0].environments[0].options: 'math': Unable to find"
    result = zrl("validate", recipe)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert f"\n  {absent} '{ROOT}/nowhere/m.jsonl'\n" in result.stdout
    strict = zrl("validate", recipe, "--strict")
    assert strict.returncode == 2 and strict.stdout == result.stdout
    assert [line.split(": ", 3)[-1] for line in strict.stderr.splitlines()] == [
        f"{NOT_A_CHECKPOINT} and build_tiny_if_missing is false (--strict: absent on this machine)",
        f"{absent} '{ROOT}/nowhere/m.jsonl' (--strict: absent on this machine)"]


def test_validate_json_is_one_document(tmp_path):
    result = zrl("validate", write(tmp_path, VALID), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["recipe"], summary["ok"], summary["problems"]) == ("r", True, [])
    assert summary["stages"] == [{"name": "s", "kind": "rl", "steps": 2, "environments": ["strings"]}]
    assert [a["field"] for a in summary["absent"]] == ["model.path"] and "resolved" not in summary
    typo = zrl("validate", write(tmp_path, VALID.replace("name: strings", "name: strngs")), "--json")
    assert typo.returncode == 2 and json.loads(typo.stdout)["ok"] is False


def test_validate_lists_each_stages_data_files(tmp_path):
    run = tmp_path / "run"
    result = zrl("validate", "recipes/zaya1-mini-cpu.yaml", "--set", f"output_dir={run}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("absent on this machine: nothing\n")
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["math_code_ttc_general", "copy_ttc_self", f"{run}/stages/rlve_gym/rollouts/strings.jsonl", "written", "by",
            "stage", "rlve_gym"] in rows
    present = GOOD.replace("{name: no_such_env}", "{name: math, options: {data_files: environments/data/math_sample.jsonl}}, "
                                                  "{name: math, key: m2, options: {data_files: [nowhere/m.jsonl]}}")
    rows = [line.split() for line in zrl("validate", write(tmp_path, present)).stdout.splitlines()]
    assert ["s", "math", "environments/data/math_sample.jsonl", "present"] in rows
    assert ["s", "m2", "nowhere/m.jsonl", "missing"] in rows


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_validates(recipe):
    result = zrl("validate", f"recipes/{recipe}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{recipe.removesuffix('.yaml')}: valid, ")  # each file is named after its recipe


def test_run_refuses_a_missing_model_before_starting_anything(tmp_path):
    result = zrl("run", write(tmp_path, GOOD))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"zrl: error: {tmp_path / 'r.yaml'}: stages[0].environments[0].name: unknown environment 'no_such_env'; "
        "valid names: aggregation, arithmetic, chat_reward_model, code, code_auxiliary, hard_instruction_following, "
        "math, reasoning_gym, rlve_gym, simple_instruction_following, skyrl_gym, strings, tool_arithmetic (or use a `module:Class` reference)",
        f"zrl: error: {tmp_path / 'r.yaml'}: {NOT_A_CHECKPOINT} and build_tiny_if_missing is false"]


def test_run_refuses_a_job_submission_address(tmp_path):
    assert_clean_error(zrl("run", write(tmp_path, VALID), "--address", "http://127.0.0.1:8265"),
                       "--address: http://127.0.0.1:8265 is a Ray job submission", "ray job submit --address")


def test_envs_lists_entry_points_or_says_none():
    result = zrl("envs")
    assert result.returncode == 0 and result.stdout.strip()
    names = [e["name"] for e in json.loads(zrl("envs", "--json").stdout)]
    assert "strings" in names and [line.split()[0] for line in result.stdout.splitlines()[1:]] == names


def test_envs_columns_fit_a_long_name(monkeypatch, capsys):
    class Short:
        """a short one"""

    class Long:
        """a long one"""
        reward_type = "continuous"

    registry = Registry(group="zrl.no_such_group")
    registry.register("s", Short)
    registry.register("a_rather_long_environment_name_of_a_plugin", Long)
    monkeypatch.setattr(env_package, "registry", registry)
    assert main(["envs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.index("a ") for line in lines[1:]] == [len("a_rather_long_environment_name_of_a_plugin  continuous  ")] * 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"zrl {version('zrl')}\n"


def test_plan_names_the_rl_stages_when_the_stage_is_unknown():
    assert_clean_error(zrl("plan", "recipes/zaya1-mini-cpu.yaml", "--stage", "nope", "--rollout-gpus", "1"),
                       "--stage: no RL stage 'nope'", "its RL stages: reasoning_warmup, rlve_gym, math_code_ttc_general, "
                       "math_code_ttc_code, behavioral")


@pytest.mark.parametrize("command", ["eval", "ttc"])
def test_eval_and_ttc_help_shows_defaults(command):
    help_text = " ".join(zrl(command, "--help").stdout.split())
    assert "problems evaluated (default: 200)" in help_text if command == "eval" else "(default: 50)" in help_text
    assert "(default: float32)" in help_text and "(default: None)" not in help_text


def test_eval_names_the_close_environment_before_loading_anything(capsys):
    assert main(["eval", "no/such/checkpoint", "--env", "strngs"]) == 2
    assert capsys.readouterr().err.startswith("zrl: error: --env: unknown environment 'strngs'; did you mean 'strings'?")


def test_only_zrls_own_log_lines_carry_its_prefix():
    def line(name):
        return _ConsoleFormatter().format(logging.LogRecord(name, logging.WARNING, "f.py", 1, "hello", None, None))

    assert line("zrl").startswith("[zrl ") and line("zrl.run").startswith("[zrl ")
    assert line("vllm.triton_utils").startswith("[WARNING vllm.triton_utils ")


def test_init_tiny_model_builds_the_chosen_architecture(tmp_path):
    from zrl.models import family_of_checkpoint

    result = zrl("init-tiny-model", str(tmp_path / "tiny-qwen3moe"), "--arch", "qwen3_moe")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"tiny qwen3_moe checkpoint and tokenizer written to {tmp_path / 'tiny-qwen3moe'}\n"
    family = family_of_checkpoint(tmp_path / "tiny-qwen3moe")
    assert family.model_type == "qwen3_moe"
    assert family.read_config(tmp_path / "tiny-qwen3moe").num_experts == family.tiny_config["num_experts"]
    again = zrl("init-tiny-model", str(tmp_path / "tiny-qwen3moe"))  # over the model: refused, nothing written
    assert_clean_error(again, f"zrl: error: {tmp_path / 'tiny-qwen3moe'}: holds a checkpoint already")


def test_init_tiny_model_refuses_a_file_and_a_directory_with_files(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(["init-tiny-model", str(tmp_path / "a-file")]) == 2
    assert capsys.readouterr().err == f"zrl: error: {tmp_path / 'a-file'}: exists and is not a directory\n"
    assert main(["init-tiny-model", str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err == (f"zrl: error: {tmp_path / 'full'}: directory is not empty; the tiny model is "
                                       "written only into a new or empty one\n")
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["notes.txt"]


def test_init_tiny_model_defaults_to_zaya_and_lists_the_architectures_on_a_miss():
    assert build_parser().parse_args(["init-tiny-model", "d"]).arch == "zaya"
    result = zrl("init-tiny-model", "d", "--arch", "llama")
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (ROOT / "d").exists()
    last = result.stderr.strip().splitlines()[-1]
    assert "--arch: invalid choice: 'llama'" in last and "qwen3_moe" in last and "zaya" in last


def test_no_command_is_a_usage_error():
    result = zrl()
    assert result.returncode == 2 and "usage: zrl" in result.stderr


def test_gpus_the_recipe_reserves_are_absent_here_for_validate_and_refused_by_an_embedded_run(tmp_path, monkeypatch,
                                                                                            capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    recipe = write(tmp_path, VALID + "resources: {rollout_workers: 3, gpus_per_rollout_worker: 0.5, "
                                     "gpus_per_trainer_worker: 1}\n")
    gpus = "resources: the recipe reserves 3.5 GPUs; this machine has 1"
    assert main(["validate", recipe]) == 0
    assert f"\n  {gpus}\n" in capsys.readouterr().out
    assert main(["run", recipe]) == 2
    assert f"zrl: error: {recipe}: {gpus}\n" in capsys.readouterr().err
