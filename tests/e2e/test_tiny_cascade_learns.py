"""The README's main job, end to end: `zrl run recipes/tiny-cpu.yaml` (SFT warm start, then RL) learns.

Held-out accuracy (unseen words, the environment's eval split, 200 prompts x 4 samples at the
training temperature, fixed seed) of the RL stage's final policy is compared with that of its starting
policy (the SFT stage's export): same prompts, same sampling, only the weights differ. The run measures
both itself (the recipe's `evaluation` blocks) and records them in the stage records.
Measured on the 2-core CPU machine (2026-11-21): 0.33 -> 0.52 after 20 RL steps; the recipe runs 30.
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
SERIES = ("reward/mean", "canary/lz77_flagged_fraction", "canary/rare_token_frac_top10%", "staleness/max",
          "mismatch/kl_k3")


def zrl(*args, timeout=1500):
    result = subprocess.run([ZRL, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def held_out_accuracy(run_dir: Path, stage: str) -> float:
    """The stage export's held-out accuracy that the run measured itself (the recipe's `evaluation`: what
    `zrl eval EXPORT --env strings --options '{tasks: copy}' --num-prompts 200 --samples 4 --temperature 1
    --max-response-tokens 24` measures)."""
    record = json.loads((run_dir / "stages" / stage / "stage.json").read_text())
    return record["evaluation"]["strings"]["accuracy"]


@pytest.fixture(scope="module")
def cascade(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-cascade")
    result = zrl("run", "recipes/tiny-cpu.yaml", "--set", f"output_dir={run_dir}",
                 "--set", f"model.path={run_dir / 'tiny-model'}")
    return run_dir, result.stderr


def test_rl_stage_improves_held_out_accuracy(cascade):
    run_dir, _ = cascade
    before = held_out_accuracy(run_dir, "sft_warm_start")
    after = held_out_accuracy(run_dir, "copy_rl")
    log.info(f"held-out accuracy: SFT start {before:.3f} -> after RL {after:.3f}")
    assert after >= before + 0.08, (before, after)


def test_dashboards_hold_the_canary_series(cascade):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log = cascade
    assert "step 190/190 (stage 30/30)" in log  # 160 SFT + 30 RL steps, one progress line each
    assert "step 160/160 (stage 160/160) | sft loss" in log
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(SERIES) <= tags, set(SERIES) - tags
    [wandb_file] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    data = wandb_file.read_bytes()
    missing = [name for name in SERIES if name.encode() not in data]
    assert not missing, missing
