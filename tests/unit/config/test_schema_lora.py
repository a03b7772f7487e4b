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


def cascade(*stage_lora, lora=None, inherit_optimizer=False) -> dict:
    """A recipe of one stage per entry of `stage_lora` (the stage's `lora`; None: not written)."""
    data = recipe(lora)
    first = {"name": "s0", "kind": "sft", "steps": 2, "environments": [{"name": "arithmetic"}]}
    stages = []
    for i, value in enumerate(stage_lora):
        stage = {**(first if i == 0 else data["stages"][0]), "name": f"s{i}"}
        if value is not None:
            stage["lora"] = value
        if i and inherit_optimizer:
            stage["inherit"] = {"optimizer_state": True}
        stages.append(stage)
    return {**data, "stages": stages}


def test_a_stage_trains_model_loras_adapters_unless_it_says_lora_false():
    from zrl.pipeline.controller import trainer_settings

    r = parse_recipe(cascade(False, None, True, False, lora={"rank": 4}), "r.yaml")
    assert [r.stage_lora(i) for i in range(4)] == [None, r.model.lora, r.model.lora, None]
    assert [trainer_settings(r, s).lora for s in r.stages] == [None, r.model.lora, r.model.lora, None]
    # Each switch builds the trainer on the export of the stage before it; a run of equal stages keeps it.
    assert [r.trainer_base(i) for i in range(4)] == [None, "s0", "s0", "s2"]
    plain = parse_recipe(cascade(None, False), "r.yaml")
    assert [plain.stage_lora(i) for i in range(2)] == [None, None] and plain.trainer_base(1) is None


@pytest.mark.parametrize(("kwargs", "stages", "line"), [
    ({}, (None, True), "<recipe>: stages[1].lora: true needs model.lora (the adapters' rank, alpha and targets)"),
    ({"lora": {"rank": 4}, "inherit_optimizer": True}, (False, None),
     "<recipe>: stages[1].inherit.optimizer_state: stage 's0' trains every weight and 's1' adapters, so there is no "
     "optimizer state to carry over; set it to false"),
])
def test_a_stage_switch_that_cannot_work_is_one_line_naming_the_field(kwargs, stages, line):
    with pytest.raises(RecipeError) as info:
        parse_recipe(cascade(*stages, **kwargs), "r.yaml")
    assert info.value.lines == [line]


def test_inheriting_the_optimizer_between_two_lora_stages_stays_allowed():
    data = cascade(False, None, None, lora={"rank": 4})
    data["stages"][2]["inherit"] = {"optimizer_state": True}
    assert parse_recipe(data, "r.yaml").stages[2].inherit.optimizer_state
