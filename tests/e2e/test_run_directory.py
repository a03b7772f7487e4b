"""The run-directory rules of `zrl run` (no Ray, seconds): no silent overwrite, what --resume accepts,
how a resume forgets what the interrupted run did after its checkpoint, the driver lock, wandb ids."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from e2e_testlib import recipe, rl_stage, sft_stage, write_recipe

from zrl.cli import main
from zrl.config import parse_recipe
from zrl.pipeline.controller import Cascade, ResumePoint, latest_checkpoint, rewind_run_dir, stage_bounds
from zrl.run import RunDirectoryError, claim_run_dir, prepare_run_dir, recipe_changes


def _recipe_file(tmp_path, **changes):
    data = recipe(tmp_path / "run", tmp_path / "tiny-model", [sft_stage(steps=2), rl_stage(steps=4, env="arithmetic")])
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[leaf] = value
    return write_recipe(tmp_path / "recipe.yaml", data)


def _fake_interrupted_run(tmp_path, step=4, stage="rl"):
    """What a run leaves on disk at a checkpoint: its resolved recipe, latest.json, a checkpoint dir."""
    run = tmp_path / "run"
    data = yaml.safe_load(_recipe_file(tmp_path).read_text())
    (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (run / "recipe.resolved.yaml").write_text(yaml.safe_dump(parse_recipe(data).model_dump(mode="json")))
    (run / "checkpoints" / "latest.json").write_text(
        json.dumps({"stage": stage, "step": step, "path": str(run / "checkpoints" / f"step_{step:06d}")}))
    return run


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    _fake_interrupted_run(tmp_path)
    assert main(["run", str(_recipe_file(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of an earlier run (latest: trainer step 4, stage 'rl')" in err and "--resume" in err


def test_a_fresh_run_refuses_a_directory_with_metrics(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["run", str(_recipe_file(tmp_path))]) == 2
    assert "holds metrics of an earlier run" in capsys.readouterr().err


def test_resume_needs_a_checkpoint(tmp_path, capsys):
    assert main(["run", str(_recipe_file(tmp_path)), "--resume"]) == 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err


def test_resume_refuses_a_recipe_that_changes_the_optimisation(tmp_path, capsys):
    _fake_interrupted_run(tmp_path)
    path = _recipe_file(tmp_path)
    assert main(["run", str(path), "--resume", "--set", "stages.1.steps=6",
                 "--set", "stages.rl.optimizer.muon.lr=0.01", "--set", "seed=4"]) == 2
    err = capsys.readouterr().err
    assert "change the optimisation: seed, stages.1.optimizer.muon.lr, stages.1.steps." in err


def test_resume_accepts_resources_sinks_and_intervals(tmp_path):
    run = _fake_interrupted_run(tmp_path)
    changed = parse_recipe(yaml.safe_load(_recipe_file(
        tmp_path, **{"resources.trainer_workers": 1, "resources.trainer_microbatch_tokens": 512,
                     "metrics.tensorboard": True, "stages.0.checkpoint_every_steps": 7, "name": "renamed"}).read_text()))
    point, (driver_file, tag) = prepare_run_dir(changed, resume=True)
    assert point == ResumePoint("rl", 4, run / "checkpoints" / "step_000004")
    assert json.loads(driver_file.read_text())["tag"] == tag and len(tag) == 32
    # The new recipe is recorded (it says which resources the continued run used).
    assert yaml.safe_load((run / "recipe.resolved.yaml").read_text())["resources"]["trainer_workers"] == 1


def test_recipe_changes_lists_paths_outside_the_resumable_fields():
    saved = {"name": "a", "seed": 0, "resources": {"trainer_workers": 2},
             "stages": [{"name": "s", "steps": 3, "checkpoint_every_steps": 5, "asynchrony": {"verifier_timeout_s": 30,
                                                                                            "sync_every_steps": 2}}]}
    new = json.loads(json.dumps(saved))
    assert recipe_changes(saved, new) == []
    new.update(name="b", resources={"trainer_workers": 8})
    new["stages"][0].update(checkpoint_every_steps=1)
    new["stages"][0]["asynchrony"]["verifier_timeout_s"] = 5
    assert recipe_changes(saved, new) == []
    new["stages"][0]["asynchrony"]["sync_every_steps"] = 1
    new["stages"].append({"name": "t", "steps": 1})
    assert recipe_changes(saved, new) == ["stages.0.asynchrony.sync_every_steps", "stages.1.name", "stages.1.steps"]


def test_latest_checkpoint_is_found_inside_a_moved_run_directory(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.json").write_text(
        json.dumps({"stage": "sft", "step": 2, "path": "/elsewhere/run/checkpoints/step_000002"}))
    assert latest_checkpoint(tmp_path) == ResumePoint("sft", 2, tmp_path / "checkpoints" / "step_000002")


def test_stage_bounds_follow_the_recipe():
    r = parse_recipe(recipe("out", "model", [sft_stage(steps=2), rl_stage(name="a", steps=4),
                                             rl_stage(name="b", steps=1)]))
    assert stage_bounds(r) == [(0, 2), (2, 6), (6, 7)]


def test_rewind_drops_later_rows_a_cut_line_and_later_checkpoints(tmp_path):
    rows = [{"step": s, "loss/sft": float(s)} for s in (1, 2, 3, 4, 5)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo'  # the kill cut the last line
    (tmp_path / "metrics.jsonl").write_text(text)
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    rewind_run_dir(tmp_path, 4)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_a_live_driver_holds_the_directory_and_a_dead_ones_processes_are_reaped(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # A stand-in for a driver: its command line names zrl, its environment carries the driver tag.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "zrl-driver"],
                              env={**os.environ, "ZRL_DRIVER_TAG": "deadbeef"})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "ZRL_DRIVER_TAG": "deadbeef"})  # e.g. a Ray agent it started
    try:
        # Popen returns once exec has begun; the kernel fills in the new command line a moment later
        deadline = time.monotonic() + 10
        while b"zrl-driver" not in Path(f"/proc/{holder.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        (out / "driver.json").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                     "tag": "deadbeef"}))
        with pytest.raises(RunDirectoryError, match=f"in use by a running zrl driver \\(pid {holder.pid}\\)"):
            claim_run_dir(out)
        holder.kill()
        holder.wait()
        file, tag = claim_run_dir(out)  # the holder is dead: its tagged process is killed
        assert child.wait(timeout=10) == -9
        assert json.loads(file.read_text())["pid"] == os.getpid() and tag != "deadbeef"
    finally:
        for proc in (holder, child):
            proc.kill()
            proc.wait()


def test_wandb_keeps_one_run_id_across_a_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    data = recipe(tmp_path / "run", tmp_path / "tiny-model", [sft_stage(steps=2)])
    data["metrics"] = {"wandb": {"enabled": True, "mode": "offline"}, "tensorboard": False}
    r = parse_recipe(data)
    first = Cascade(r, tmp_path / "tiny-model")
    logger = first._open_metrics()
    logger.log(1, {"loss/sft": 1.0})
    logger.close()
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    resumed = Cascade(r, tmp_path / "tiny-model", resume=ResumePoint("sft", 1, tmp_path / "run" / "checkpoints" / "x"))
    logger = resumed._open_metrics()
    logger.log(2, {"loss/sft": 0.5})
    logger.close()
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with "-1" appended when both runs start within the same second
    assert len(runs) == 2 and all(p.name.split("-")[3] == run_id for p in runs)
    assert "WANDB_RUN_ID" not in os.environ and "WANDB_RESUME" not in os.environ
