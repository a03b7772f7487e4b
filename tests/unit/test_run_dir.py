"""The run directory's layout (zrl/run_dir.py): names, and what counts as a checkpoint directory."""

from pathlib import Path

from zrl.run_dir import RunDir


def test_checkpoint_directories_are_found_by_their_step_name(tmp_path):
    layout = RunDir(tmp_path)
    for step in (12, 3):
        layout.checkpoint(step).mkdir(parents=True)
    (layout.checkpoints / "step_abc").mkdir()            # not a step
    (layout.checkpoints / "step_000020").write_text("")  # not a directory
    layout.latest.write_text("{}")
    assert layout.checkpoint(12).name == "step_000012"
    assert layout.checkpoint_steps() == [(3, layout.checkpoint(3)), (12, layout.checkpoint(12))]


def test_a_stages_files_live_in_its_directory():
    layout = RunDir("out")
    assert layout.stage_record("sft") == Path("out/stages/sft/stage.json")
    assert layout.self_rollouts("sft", "math") == Path("out/stages/sft/rollouts/math.jsonl")
    assert {p.parent for p in (layout.stage_hf("sft"), layout.stage_summary("sft"))} == {layout.stage("sft")}
