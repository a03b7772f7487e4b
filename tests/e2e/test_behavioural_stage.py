"""The behavioural stage end to end: `zrl run recipes/tiny-behaviour-cpu.yaml` (SFT warm start, then GRPO
on reward-model scores gated by instruction checks, with the tiny reward model on a Ray actor).

Held-out comparison of the RL stage's final policy with its starting policy (the SFT stage's export),
as the run's stage-end evaluations recorded it (the recipe's `evaluation`): 200 eval prompts x 4 samples
at the training temperature, the recipe's seed, the same prompts for both, scored by the same tiny reward
model. The mean raw reward-model score rises (on the chat prompts) while the instruction-following pass
rate does not fall (on the simple instruction prompts).
"""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ZRL = str(Path(sys.executable).parent / "zrl")
PASS_RATE_SLACK = 0.03  # sampling noise allowed on the pass rate (800 samples: its standard error is <= 0.018)
# Measured on the 2-core CPU machine (seed 0, the recipe's 0.25/0.75 chat/instruction mix): 2026-11-24, with
# `zrl eval --seed 7` on each export, mean RM score -1.84 -> 5.69, pass rate 0.241 -> 0.343 (an equal mix gave
# 0.241 -> 0.303 and 0.216 in two runs); 2026-11-28, the run's own stage-end evaluations (recipe seed 0),
# -1.85 -> 6.01 and 0.215 -> 0.314; with both evaluations on the RL stage's rollout worker, scored by the run's
# reward-model actors, the warm start's figures are the same (-1.853, 0.215), the RL stage's 6.11 and 0.352.
# A rise of at least one raw-score unit is asserted.
MIN_SCORE_RISE = 1.0


def zrl(*args, timeout=1800):
    result = subprocess.run([ZRL, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def held_out(run_dir: Path, stage: str) -> dict:
    """{entry: EvalResult fields} of the stage's export, from its stage record."""
    return json.loads((run_dir / "stages" / stage / "stage.json").read_text())["evaluation"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-behaviour")
    result = zrl("run", "recipes/tiny-behaviour-cpu.yaml", "--set", f"output_dir={run_dir}",
                 "--set", f"model.path={run_dir / 'tiny-model'}", "--set", f"reward_model.path={run_dir / 'tiny-rm'}")
    return run_dir, result.stderr


def test_rl_raises_the_reward_model_score_without_losing_instruction_following(run):
    run_dir, _ = run
    before, after = held_out(run_dir, "sft_warm_start"), held_out(run_dir, "behavioral")
    # the same 200 prompts for both: none skipped under either stage's prompt limit
    assert all(r[k]["num_prompts"] == 200 and r[k]["skipped_long_prompts"] == 0 for r in (before, after) for k in r)
    score = [r["chat_reward_model"]["metadata_means"]["rm_score"] for r in (before, after)]
    passed = [r["simple_instruction_following"]["reasons"].get("scored", 0.0) for r in (before, after)]
    log.info("held-out mean RM score %.3f -> %.3f; instruction pass rate %.3f -> %.3f", *score, *passed)
    assert score[1] >= score[0] + MIN_SCORE_RISE, score
    assert passed[1] >= passed[0] - PASS_RATE_SLACK, passed


def test_the_stage_reports_the_gate_and_the_scores(run):
    run_dir, log_text = run
    assert "step 190/190" in log_text
    # Both exports were evaluated on the RL stage's rollout worker, their reward-model entries scored by the
    # run's reward-model actors: no engine or in-process reward model of their own.
    for stage in ("sft_warm_start", "behavioral"):
        assert f"stage {stage!r}: its export evaluated on the engine of rollout worker 0" in log_text, stage
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Window metrics: a step's row carries those of the groups verified since the previous row.
    windows = [r for r in rows if r["step"] > 160 and "reward/simple_instruction_following" in r]
    assert len(windows) >= 20
    for r in windows:
        reasons = [r.get(f"verify/simple_instruction_following/{reason}", 0.0)
                   for reason in ("scored", "instructions_not_followed", "unfinished_reasoning")]
        assert sum(reasons) == pytest.approx(1.0) and 0.0 <= r["reward/simple_instruction_following"] <= 1.0
        # The gate: only scored responses earn a reward, and each earns less than 1.
        assert r["reward/simple_instruction_following"] <= reasons[0]
