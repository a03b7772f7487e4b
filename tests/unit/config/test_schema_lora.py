"""`model.lora`: off unless written, its fields validated with one line naming the field and the reason."""

import pytest

from zrl.config import RecipeError, parse_recipe


def recipe(lora=None) -> dict:
    stage = {"name": "s", "kind": "rl", "steps": 3, "environments": [{"name": "arithmetic"}]}
    model = {"path": "m"} if lora is None else {"path": "m", "lora": lora}
    return {"name": "r", "model": model, "output_dir": "out", "stages": [stage]}


def test_lora_is_off_unless_written():
    assert parse_recipe(recipe(), "r.yaml").model.lora is None


def test_defaults_and_scale():
    lora = parse_recipe(recipe({"rank": 8}), "r.yaml").model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.scale) == (8, 32.0, 0.0, 4.0)
    targets = lora.targets
    assert (targets.attention, targets.experts, targets.dense_mlp, targets.router) == (True, "per_expert", True, False)
    shared = parse_recipe(recipe({"targets": {"experts": "shared_a", "attention": False}}), "r.yaml").model.lora
    assert shared.targets.experts == "shared_a" and not shared.targets.attention


@pytest.mark.parametrize(("lora", "start"), [
    ({"rank": 0}, "model.lora.rank: Input should be greater than or equal to 1"),
    ({"rank": 4.0}, "model.lora.rank: Input should be a valid integer"),
    ({"alpha": 0}, "model.lora.alpha: Input should be greater than 0"),
    ({"dropout": 1.0}, "model.lora.dropout: Input should be less than 1"),
    ({"targets": {"experts": "all"}}, "model.lora.targets.experts: Input should be 'per_expert' or 'shared_a'"),
    ({"targets": {"mlp": True}}, "model.lora.targets.mlp: unknown field"),
    ({"targets": {"attention": False, "experts": None, "dense_mlp": False}},
     "model.lora: targets: every target is off, so nothing would train"),
])
def test_bad_settings_are_one_line_naming_the_field(lora, start):
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe(lora), "r.yaml")
    [line] = info.value.lines
    assert line.startswith(start), line
