"""Held-out evaluation during an RL stage (zrl/pipeline/held_out.py): which synced versions are evaluated,
the requests (those of the stage-end evaluation), the logged values, and where the stage plot draws them."""

import json

from zrl.config import parse_recipe
from zrl.evaluate import EvalResult
from zrl.pipeline.held_out import HeldOutSchedule, held_out_metrics, held_out_requests, in_training_requests
from zrl.plots import PANELS, panel_series, stage_rows


def stage(**evaluation):
    return parse_recipe({"name": "r", "model": {"path": "m"}, "output_dir": "out", "stages": [
        {"name": "rl", "kind": "rl", "steps": 10, "environments": [{"name": "strings"}, {"name": "arithmetic"}],
         "sampling": {"max_prompt_tokens": 40, "max_response_tokens": 16}, "evaluation": evaluation}]}).stages[0]


def test_the_start_and_every_multiple_before_the_last_step_are_evaluated_once():
    schedule = HeldOutSchedule(every_steps=4, start_version=10, end_version=20)
    synced = [10, 10, 12, 14, 16, 16, 18, 20]  # each worker reports a sync; the last step is the stage end's
    assert [v for v in synced if schedule.due(v)] == [10, 12, 16]


def test_off_by_default():
    assert not HeldOutSchedule(every_steps=None, start_version=0, end_version=8).due(0)
    assert stage(prompts=8).evaluation.every_steps is None
    assert in_training_requests(stage(prompts=8)) == []  # the stage-end evaluation only


def test_the_requests_are_the_stage_end_evaluations():
    s = stage(prompts=8, samples=2, temperature=0.0, max_response_tokens=16, every_steps=2)
    requests = in_training_requests(s)
    assert requests == held_out_requests(s)
    assert [k for k, _ in requests] == ["strings", "arithmetic"]
    _, r = requests[0]
    assert (r.num_prompts, r.samples_per_prompt, r.temperature, r.max_response_tokens, r.max_prompt_tokens,
            r.split) == (8, 2, 0.0, 16, 40, "eval")


def result(accuracy, tokens):
    return EvalResult(checkpoint="c", environment="strings", num_prompts=8, accuracy=accuracy, verifier_errors=0,
                      mean_response_tokens=tokens, reasons={}, metadata_means={})


def test_logged_values_and_their_place_in_the_stage_plot(tmp_path):
    values = held_out_metrics(12, [("strings", result(0.5, 7.0))])
    assert values == {"eval/policy_version": 12.0, "eval/strings/accuracy": 0.5,
                      "eval/strings/response_tokens_mean": 7.0}
    rows = [{"step": s, "stage/index": 1.0, "reward/mean": 0.1 * s} for s in (11, 12, 13, 14)]
    rows[3].update(values)  # evaluated at version 12, carried by the row of step 14
    rows.append({"step": 14, "stage/index": 1.0, **held_out_metrics(14, [("strings", result(0.75, 6.0))])})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = next(p for p in PANELS if p.title.startswith("reward"))
    series = panel_series(reward, stage_rows(path, 1))
    assert series["eval/strings/accuracy"] == ([12, 14], [0.5, 0.75])
    assert series["reward/mean"][0] == [11, 12, 13, 14]


def test_a_multi_turn_entry_logs_its_turns_and_tool_use():
    episodes = EvalResult(checkpoint="c", environment="tool_arithmetic", num_prompts=8, accuracy=0.25,
                          verifier_errors=0, mean_response_tokens=80.0, reasons={"done": 1.0},
                          metadata_means={"turns": 1.75, "tool_calls": 0.875, "tool_errors": 0.125, "used_tools": 0.75})
    values = held_out_metrics(4, [("tools", episodes)])
    assert {k: v for k, v in values.items() if k.startswith("eval/tools/") and "accuracy" not in k} == {
        "eval/tools/response_tokens_mean": 80.0, "eval/tools/turns_mean": 1.75, "eval/tools/tool_calls_mean": 0.875,
        "eval/tools/used_tools_frac": 0.75}
