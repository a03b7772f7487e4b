"""Results on stdout, logs on stderr: `zrl eval`, `ttc` and `plan` print a table, or one JSON document
with --json, and nothing else on stdout. These tests stand a fake result in for the engine's; with a real
engine (whose own log lines must go to stderr) `zrl eval --json` is checked on the export of the
asynchronous pipeline test's run (tests/integration/pipeline/test_async_pipeline.py), which parses stdout
whole."""

import dataclasses
import json
from pathlib import Path

import pytest

import serving.rsa
import zrl.evaluate
from zrl.cli import main
from zrl.evaluate import EvalResult

ROOT = Path(__file__).resolve().parents[3]
RESULT = EvalResult(checkpoint="ckpt", environment="strings", num_prompts=2, accuracy=float("nan"), verifier_errors=0,
                    mean_response_tokens=8.0, reasons={"wrong": 1.0}, metadata_means={}, samples_per_prompt=4,
                    avg_at_k=float("nan"), pass_at_1=0.25, pass_at_k=0.5)


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(zrl.evaluate, "evaluate_checkpoints", lambda checkpoints, *args, **kwargs: [
        [dataclasses.replace(RESULT, checkpoint=str(c))] for c in checkpoints])
    return str(tmp_path)


def test_eval_prints_a_table_or_json_with_no_nan(checkpoint, capsys):
    assert main(["eval", checkpoint, "--env", "strings", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "checkpoint": checkpoint, "environment": "strings", "num_prompts": 2, "accuracy": None, "verifier_errors": 0,
        "mean_response_tokens": 8.0, "reasons": {"wrong": 1.0}, "metadata_means": {}, "skipped_long_prompts": 0,
        "samples_per_prompt": 4, "avg_at_k": None, "pass_at_1": 0.25, "pass_at_k": 0.5}
    assert main(["eval", checkpoint, "--env", "strings"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["result", "value"] and ["accuracy", "-"] in rows and ["reasons.wrong", "1"] in rows
    assert ["samples_per_prompt", "4"] in rows and ["pass_at_1", "0.25"] in rows and ["pass_at_k", "0.5"] in rows


def test_eval_of_several_checkpoints_prints_a_list_in_their_order(checkpoint, tmp_path, capsys):
    """Several checkpoints go to one evaluation (one engine, evaluate_checkpoints) and --json prints one list;
    what applies to one checkpoint only is refused in one line."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert main(["eval", checkpoint, str(other), "--env", "strings", "--json"]) == 0
    assert [r["checkpoint"] for r in json.loads(capsys.readouterr().out)] == [checkpoint, str(other)]
    assert main(["eval", checkpoint, str(tmp_path / "missing"), "--env", "strings"]) == 2
    assert capsys.readouterr().err == f"zrl: error: {tmp_path / 'missing'}: not a checkpoint directory (no config.json)\n"
    for flag in (["--adapter", str(other)], ["--save-rollouts", str(tmp_path / "r.jsonl")]):
        assert main(["eval", checkpoint, str(other), "--env", "strings", *flag]) == 2
        assert capsys.readouterr().err.startswith(f"zrl: error: {flag[0]}: ")


class FakeRSA:
    def write_jsonl(self, path):
        Path(path).write_text("")

    def round_summary(self, i):
        return {"round": i, "mean_reward": 0.5 * i, "majority_accuracy": None}


def test_ttc_prints_one_row_per_round_or_json(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serving.rsa, "evaluate_rsa", lambda *args, **kwargs: FakeRSA())
    out = str(tmp_path / "c.jsonl")
    assert main(["ttc", checkpoint, "--env", "strings", "-T", "1", "--output", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "rounds": [{"round": 0, "mean_reward": 0.0, "majority_accuracy": None},
                   {"round": 1, "mean_reward": 0.5, "majority_accuracy": None}], "candidates": out}
    assert main(["ttc", checkpoint, "--env", "strings", "-T", "1", "--output", out]) == 0
    assert capsys.readouterr().out.splitlines() == ["round  mean_reward  majority_accuracy", "    0            0  -",
                                                    "    1          0.5  -", f"candidates: {out}"]


def test_plan_json(capsys):
    assert main(["plan", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--rollout-gpus", "1", "--steps", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["stage"], plan["steps"], plan["rollout_workers"]) == ("copy_rl", 8, 1)
    assert plan["async"]["mode"] == "async" and plan["sync"]["mode"] == "sync"
    assert plan["speedup"] == pytest.approx(plan["async"]["steps_per_hour"] / plan["sync"]["steps_per_hour"])
