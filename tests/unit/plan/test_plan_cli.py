"""`zrl plan`: a small end-to-end call of the console script on the tiny recipe, one cluster in-process,
and bad input as one line with exit 2."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zrl.cli import main

ROOT = Path(__file__).resolve().parents[3]
ZRL = str(Path(sys.executable).parent / "zrl")
TINY = str(ROOT / "recipes" / "tiny-cpu.yaml")


def test_console_script_sweeps_and_plots(tmp_path):
    plot = tmp_path / "plan.png"
    result = subprocess.run([ZRL, "plan", TINY, "--sweep", "0.5,1", "--steps", "8", "--plot", str(plot)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "knee: ratio" in result.stdout
    assert plot.stat().st_size > 0


def test_one_cluster(capsys):
    assert main(["plan", TINY, "--rollout-gpus", "1", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "async / sync:" in out and "1 of 1 rollout workers" in out


def bad(capsys, *args) -> str:
    assert main(["plan", TINY, *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("args, fragments", [
    (("--rollout-gpus", "0"), ("--rollout-gpus", ">= 1")),
    (("--sweep", "a,b"), ("--sweep",)),
    (("--sweep", "1,-2"), ("--sweep", "> 0")),
    ((), ("--rollout-gpus", "required")),
    (("--rollout-gpus", "1", "--stage", "nope"), ("--stage", "nope")),
    (("--rollout-gpus", "1", "--steps", "1"), ("--steps", ">= 2")),
    (("--rollout-gpus", "1", "--workload", "missing.yaml"), ("missing.yaml", "file not found")),
])
def test_bad_arguments(capsys, args, fragments):
    line = bad(capsys, *args)
    for fragment in fragments:
        assert fragment in line


@pytest.mark.parametrize("text, fragments", [
    ("decode_step_s: -1\n", ("decode_step_s", "greater than or equal to 0")),
    ("colour: blue\n", ("colour", "Extra inputs")),
    ("median_response_tokens: 100\np90_response_tokens: 50\n", ("p90_response_tokens", "below")),
])
def test_bad_workload(capsys, tmp_path, text, fragments):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    line = bad(capsys, "--rollout-gpus", "1", "--workload", str(path))
    for fragment in (str(path), *fragments):
        assert fragment in line


NODE_TABLE = (  # README "One 8-GPU node": (rollout GPUs, trainer GPUs, prompts per batch, async, sync)
    (5, 2, 16, "7.74", "4.30"), (11, 4, 32, "7.70", "3.96"), (23, 8, 64, "7.62", "3.87"),
    (44, 16, 128, "7.28", "3.61"))


def test_the_readme_quotes_what_plan_prints_for_the_node_recipe(capsys):
    readme = (ROOT / "README.md").read_text()
    node = str(ROOT / "recipes" / "zaya1-node.yaml")
    for rollout, trainer, prompts, async_rate, sync_rate in NODE_TABLE:
        assert main(["plan", node, "--stage", "reasoning_warmup", "--rollout-gpus", str(rollout), "--trainer-gpus",
                     str(trainer), "--set", f"resources.trainer_workers={trainer}", "--set",
                     f"stages.1.sampling.prompts_per_batch={prompts}", "--steps", "20"]) == 0
        rates = dict(re.findall(r"^(async|sync) +([\d.]+) ", capsys.readouterr().out, flags=re.M))
        assert rates == {"async": async_rate, "sync": sync_rate}
        row = f"| {rollout} : {trainer} "
        assert any(line.startswith("| ") and row in line and f"{async_rate} ({sync_rate})" in line
                   for line in readme.splitlines()), row
    assert "prints 7.74 steps/hour asynchronous, 4.30 synchronous" in readme
