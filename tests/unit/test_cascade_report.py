"""The cascade report: per-stage numbers from stage records and metrics rows, one self-contained page."""

import json

from zrl.cascade_report import stage_summary, write_cascade_report
from zrl.run_dir import REPORT_FILE


def _run_dir(tmp_path):
    rows = [{"step": 1, "stage/index": 0, "loss/sft": 2.0}, {"step": 2, "stage/index": 0, "loss/sft": 0.5},
            {"step": 3, "stage/index": 1, "reward/mean": 0.25, "staleness/mean": 1.0, "staleness/max": 2,
             "canary/lz77_flagged_fraction": 0.0, "mismatch/kl_k3": "nan"},
            {"step": 4, "stage/index": 1, "reward/mean": 0.75, "staleness/mean": 0.5, "staleness/max": 1,
             "canary/lz77_flagged_fraction": 0.5, "mismatch/kl_k3": 0.002}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = [
        {"stage": "sft", "index": 0, "first_step": 0, "last_step": 2, "wall_s": 12.0, "summary_png": None,
         "evaluation": {"strings": {"accuracy": 0.5}}, "self_rollouts": {}, "inherited": None,
         "handoff": {"length_reward_frontier": {}, "curriculum": []}},
        {"stage": "rl", "index": 1, "first_step": 2, "last_step": 4, "wall_s": 30.0, "summary_png": None,
         "evaluation": {"strings": {"accuracy": 0.75}, "code": {"accuracy": 0.0}},
         "self_rollouts": {"strings": str(tmp_path / "x.jsonl")},
         "inherited": {"length_reward_frontier": ["strings"], "curriculum": ["strings"]},
         "handoff": {"length_reward_frontier": {"strings": 0.9}, "curriculum": ["strings"]}}]
    for record in records:
        (tmp_path / "stages" / record["stage"]).mkdir(parents=True)
        (tmp_path / "stages" / record["stage"] / "stage.json").write_text(json.dumps(record))
    return tmp_path, records, rows


def test_stage_numbers_come_from_the_stages_own_rows(tmp_path):
    _, records, rows = _run_dir(tmp_path)
    sft = stage_summary(records[0], rows[:2])
    assert (sft["steps"], sft["reward_mean"], sft["sft_loss_final"]) == ("1-2", None, 0.5)
    rl = stage_summary(records[1], rows[2:])
    assert rl["reward_mean"] == 0.5 and rl["staleness_mean"] == 0.75 and rl["staleness_max"] == 2
    assert rl["lz77_flagged"] == 0.25 and rl["mismatch_kl"] == 0.002  # a non-finite value is a gap
    assert rl["held_out"] == {"strings": 0.75, "code": 0.0}


def test_the_report_is_one_page_with_every_stage(tmp_path):
    run_dir, _, _ = _run_dir(tmp_path)
    page = write_cascade_report(run_dir, "mini").read_text()
    assert page.startswith("<!doctype html>") and page.count("<tr>") == 3  # header + two stages
    assert "strings: 0.750<br>code: 0.000" in page and "loss 0.500" in page
    assert "p* of 1 data source(s); curriculum of strings" in page and "self-rollouts strings" in page
    assert page.count("data:image/png;base64,") == 1  # the reward figure; the stages have no summary PNG


def test_no_finished_stage_writes_no_report(tmp_path):
    assert write_cascade_report(tmp_path, "empty") is None and not (tmp_path / REPORT_FILE).exists()


def test_a_stage_with_alarms_is_marked_and_its_export_compared_with_its_start(tmp_path):
    run_dir, _, rows = _run_dir(tmp_path)
    rows[2].update({"eval/policy_version": 2, "eval/strings/accuracy": 0.9})  # the RL stage's start: 0.9
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "alarms.jsonl").write_text(json.dumps(
        {"stage": "rl", "step": 4, "signal": "canary", "message": "canary/lz77_flagged_fraction 0.500 > 0.2",
         "action": "warn", "good_step": 3}) + "\n")
    page = write_cascade_report(run_dir, "mini").read_text()
    assert "<tr style='background:#fdd'>" in page and page.count("<tr>") == 2  # header + the quiet SFT stage
    assert "step 4 canary: canary/lz77_flagged_fraction 0.500 &gt; 0.2" in page
    assert "<span style='color:#b00'>strings: 0.900 → 0.750 ▼</span>" in page  # worse than its start
    rl = stage_summary(json.loads((run_dir / "stages/rl/stage.json").read_text()), rows[2:],
                       [{"stage": "rl", "step": 4, "signal": "canary"}, {"stage": "sft", "step": 1, "signal": "x"}])
    assert rl["held_out_start"] == {"strings": 0.9} and [a["step"] for a in rl["alarms"]] == [4]
