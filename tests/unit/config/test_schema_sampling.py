"""Recipe sampling settings: those the trainer cannot reproduce are refused with one line naming the field."""

import pytest

from zrl.config import RecipeError, parse_recipe


def recipe(**sampling) -> dict:
    stage = {"name": "s", "kind": "rl", "steps": 3, "environments": [{"name": "arithmetic"}], "sampling": sampling}
    return {"name": "r", "model": {"path": "m"}, "output_dir": "out", "stages": [stage]}


@pytest.mark.parametrize("temperature", [0, 0.0, 0.005, -1.0])
def test_temperatures_the_engine_would_not_sample_with_are_refused(temperature):
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe(temperature=temperature), "r.yaml")
    [line] = info.value.lines
    assert line.startswith(f"stages[0].sampling.temperature: {float(temperature)} is below 0.01: ")
    assert "greedily" in line


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.01), dict(temperature=0.7), dict(temperature=1.5, top_p=0.9),
    dict(top_k=1), dict(top_k=0), dict(min_p=0.1), dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.02),
])
def test_matchable_settings_are_accepted(sampling):
    stage = parse_recipe(recipe(**sampling), "r.yaml").stages[0]
    assert all(getattr(stage.sampling, k) == v for k, v in sampling.items())
