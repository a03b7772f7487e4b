"""`evaluation.every_steps`: off by default; a bad value is one line naming the field and the reason."""

import pytest

from zrl.config import RecipeError, parse_recipe


def recipe(kind="rl", **evaluation) -> dict:
    stage = {"name": "s", "kind": kind, "steps": 6, "environments": [{"name": "arithmetic"}],
             "evaluation": {"prompts": 8, "max_response_tokens": 16, **evaluation}}
    if kind == "rl":
        stage["sampling"] = {"max_response_tokens": 32}
        stage["asynchrony"] = {"sync_every_steps": 2}  # every_steps must be a multiple of it
    return {"name": "r", "model": {"path": "m"}, "output_dir": "out", "stages": [stage]}


def error_of(data) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "r.yaml")
    [line] = info.value.lines
    return line


def test_default_is_off_and_a_multiple_of_the_sync_cadence_is_accepted():
    assert parse_recipe(recipe()).stages[0].evaluation.every_steps is None
    assert parse_recipe(recipe(every_steps=4)).stages[0].evaluation.every_steps == 4


@pytest.mark.parametrize("evaluation, message", [
    ({"every_steps": 0}, "stages[0].evaluation.every_steps: Input should be greater than or equal to 1 (got 0)"),
    ({"every_steps": "5"}, "stages[0].evaluation.every_steps: Input should be a valid integer (got '5')"),
    ({"every_steps": 2, "prompts": 0}, "stages[0].evaluation: every_steps=2 needs prompts > 0"),
    ({"every_steps": 3}, "stages[0]: evaluation.every_steps=3 must be a multiple of asynchrony.sync_every_steps=2"),
    ({"every_steps": 2, "max_response_tokens": 64},
     "stages[0]: evaluation.max_response_tokens=64 exceeds sampling.max_response_tokens=32"),
])
def test_bad_values_are_one_line_naming_the_field(evaluation, message):
    assert error_of(recipe(**evaluation)).startswith(message)


def test_an_sft_stage_has_no_engine_to_evaluate_on_during_training():
    line = error_of(recipe(kind="sft", every_steps=2))
    assert line.startswith("stages[0]: evaluation.every_steps=2: an SFT stage has no rollout engine")
