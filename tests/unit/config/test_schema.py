"""Recipe schema: defaults, cross-field rules, error paths, overrides, and every shipped recipe."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zrl.config import RecipeError, apply_override, load_recipe, parse_recipe
from zrl.config.schema import Asynchrony, DPPOBinaryTV, RLStage

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def minimal(**stage_fields) -> dict:
    stage = {"name": "s", "kind": "rl", "steps": 3, "environments": [{"name": "arithmetic"}], **stage_fields}
    return {"name": "r", "model": {"path": "m"}, "output_dir": "out", "stages": [stage]}


def errors_of(data) -> list[str]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "r.yaml")
    return info.value.lines


def test_every_recipe_parses():
    assert {p.name for p in RECIPES} >= {"tiny-cpu.yaml", "zaya1-cascade.yaml"}
    for path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.stages, path


def test_production_cascade_matches_table_iv():
    recipe = load_recipe(ROOT / "recipes" / "zaya1-cascade.yaml")
    steps = {s.name: s.steps for s in recipe.stages}
    assert steps["reasoning_warmup_65k"] + steps["reasoning_warmup"] == 232
    assert steps["rlve_gym"] == 400
    assert (steps["math_code_ttc_general"], steps["math_code_ttc_code"]) == (384, 464)
    assert steps["behavioral"] == 384
    rl = [s for s in recipe.stages if s.kind == "rl"]
    assert all(s.sampling.prompts_per_batch == 128 and s.sampling.group_size == 16 for s in rl)
    assert all(s.algorithm.trust_region.delta == 0.1 for s in rl)
    assert [s.algorithm.advantage for s in rl] == ["maxrl"] * 5 + ["grpo"]
    assert recipe.stages[0].sampling.max_response_tokens == 65536
    assert all(s.sampling.max_response_tokens == 81920 for s in rl[1:])
    lrs = [s.optimizer.muon.lr for s in rl]
    assert all(2e-6 <= lr <= 1e-5 for lr in lrs) and min(lrs) == rl[-1].optimizer.muon.lr
    assert rl[-1].algorithm.length_reward.enabled is False
    assert [s.algorithm.length_reward.c_end for s in rl[3:5]] == [1.0, 1.0]


def test_defaults_are_zaya1_production_values_but_the_sync_cadence():
    stage = parse_recipe(minimal()).stages[0]
    assert isinstance(stage, RLStage)
    assert (stage.sampling.prompts_per_batch, stage.sampling.group_size) == (128, 16)
    assert stage.algorithm.advantage == "maxrl"
    assert stage.algorithm.trust_region == DPPOBinaryTV(delta=0.1)
    assert stage.algorithm.loss_aggregation == "seq_mean_token_sum_norm"
    # The report syncs every 2 steps; zrl syncs every step (the planner's finding, bench/results/plan_zaya1.md).
    assert (stage.asynchrony.sync_every_steps, stage.asynchrony.max_staleness_steps,
            stage.asynchrony.min_ready_batches) == (1, 2, 2)
    assert stage.optimizer.muon.momentum == 0.0


def test_unknown_field_names_its_path():
    data = minimal(sampling={"group_sise": 8})
    assert errors_of(data) == ["stages[0].sampling.group_sise: unknown field"]


def test_wrong_type_names_its_path_and_value():
    [line] = errors_of(minimal(steps="many"))
    assert line.startswith("stages[0].steps: ") and "'many'" in line


def test_out_of_range_names_its_path():
    [line] = errors_of(minimal(sampling={"top_p": 1.5}))
    assert line.startswith("stages[0].sampling.top_p: ") and "less than or equal to 1" in line


def test_missing_required_field():
    data = minimal()
    del data["model"]
    assert errors_of(data) == ["model: required field is missing"]


def test_trust_region_is_a_discriminated_union():
    stage = parse_recipe(minimal(algorithm={"trust_region": {"type": "ppo_clip", "clip_high": 0.28}})).stages[0]
    assert stage.algorithm.trust_region.type == "ppo_clip"
    [line] = errors_of(minimal(algorithm={"trust_region": {"type": "ppo_clip", "delta": 0.1}}))
    assert line == "stages[0].algorithm.trust_region.delta: unknown field"
    [line] = errors_of(minimal(algorithm={"trust_region": {"type": "kl_penalty"}}))
    assert line.startswith("stages[0].algorithm.trust_region: ") and "dppo_binary_tv" in line


def test_group_size_rule():
    [line] = errors_of(minimal(sampling={"group_size": 1}))
    assert line.startswith("stages[0]: sampling.group_size=1: group advantages")


def test_maxrl_requires_binary_rewards():
    data = minimal(environments=[{"name": "rm", "reward_type": "continuous"}])
    [line] = errors_of(data)
    assert "maxrl needs binary rewards" in line and "'rm'" in line
    data["stages"][0]["algorithm"] = {"advantage": "grpo", "length_reward": {"enabled": False}}
    assert parse_recipe(data).stages[0].algorithm.advantage == "grpo"


def test_grpo_rejects_the_length_reward():
    # The length bonus is on by default; GRPO divides by the group's std, which a pure length signal would blow up.
    data = minimal(algorithm={"advantage": "grpo"})
    [line] = errors_of(data)
    assert line.startswith("stages[0]: algorithm.advantage=grpo takes no length reward") and \
        "length_reward.enabled: false" in line
    data["stages"][0]["algorithm"]["length_reward"] = {"enabled": False}
    assert not parse_recipe(data).stages[0].algorithm.length_reward.enabled


@pytest.mark.parametrize("sync, staleness, ok", [(2, 2, True), (2, 1, True), (3, 1, False), (1, 0, True), (4, 2, False)])
def test_staleness_bound_vs_sync_interval(sync, staleness, ok):
    fields = dict(sync_every_steps=sync, max_staleness_steps=staleness)
    if ok:
        assert Asynchrony(**fields).max_staleness_steps == staleness
    else:
        [line] = errors_of(minimal(asynchrony=fields))
        assert line.startswith("stages[0].asynchrony: max_staleness_steps=")


def test_buffer_capacity_must_hold_the_ready_batches():
    [line] = errors_of(minimal(asynchrony={"min_ready_batches": 3, "buffer_capacity_batches": 2}))
    assert "the trainer could never pull" in line


def test_stage_names_unique_and_kinds_checked():
    data = minimal()
    data["stages"].append(dict(data["stages"][0]))
    assert errors_of(data) == ["<recipe>: stage names must be unique; repeated: ['s']"]
    [line] = errors_of(minimal(kind="dpo"))
    assert line.startswith("stages[0]: ") and "'rl', 'sft'" in line


def test_sft_stage_has_no_rl_fields():
    data = minimal(kind="sft")
    assert parse_recipe(data).stages[0].kind == "sft"
    data["stages"][0]["algorithm"] = {}
    assert errors_of(data) == ["stages[0].algorithm: unknown field"]


def test_several_errors_are_all_reported():
    lines = errors_of(minimal(steps=0, sampling={"temperature": -1}))
    assert len(lines) == 2 and {l.split(":")[0] for l in lines} == {"stages[0].steps", "stages[0].sampling.temperature"}


def test_overrides_by_index_and_by_stage_name():
    data = minimal()
    apply_override(data, "stages.0.steps=7")
    apply_override(data, "stages.s.sampling.group_size=4")
    apply_override(data, "algorithm_free_field_is_rejected_later=1")
    assert data["stages"][0]["steps"] == 7 and data["stages"][0]["sampling"] == {"group_size": 4}
    assert errors_of(data) == ["algorithm_free_field_is_rejected_later: unknown field"]
    with pytest.raises(RecipeError, match="no item named 'nope'"):
        apply_override(minimal(), "stages.nope.steps=1")
    with pytest.raises(RecipeError, match="index out of range"):
        apply_override(minimal(), "stages.3.steps=1")
    with pytest.raises(RecipeError, match="expected path.to.field=value"):
        apply_override(minimal(), "stages.0.steps")


def test_load_errors_for_files(tmp_path):
    with pytest.raises(RecipeError, match="file not found"):
        load_recipe(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match=r"invalid YAML: line \d+, column \d+"):
        load_recipe(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_recipe(scalar)


def test_resolved_recipe_round_trips():
    recipe = load_recipe(ROOT / "recipes" / "tiny-cpu.yaml")
    dumped = yaml.safe_load(yaml.safe_dump(recipe.model_dump(mode="json")))
    assert parse_recipe(dumped) == recipe


def test_config_imports_no_heavy_frameworks():
    code = ("import sys, zrl.config; heavy = {'torch', 'ray', 'vllm', 'transformers'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernel_backend_reaches_the_trainer_settings():
    from zrl.pipeline.controller import trainer_settings

    data = minimal()
    assert parse_recipe(data).model.kernels == "auto"
    apply_override(data, "model.kernels=reference")
    recipe = parse_recipe(data)
    assert trainer_settings(recipe, recipe.stages[0]).kernels == "reference"
    apply_override(data, "model.kernels=cuda")
    [line] = errors_of(data)
    assert line.startswith("model.kernels: ") and "'auto', 'triton' or 'reference'" in line


def test_lora_reaches_the_trainer_settings():
    from zrl.pipeline.controller import trainer_settings

    data = minimal()
    assert trainer_settings(parse_recipe(data), parse_recipe(data).stages[0]).lora is None
    apply_override(data, "model.lora={rank: 4, alpha: 8}")
    recipe = parse_recipe(data)
    lora = trainer_settings(recipe, recipe.stages[0]).lora
    assert lora == recipe.model.lora and (lora.rank, lora.alpha) == (4, 8)


def test_trainer_memory_settings_reach_the_trainer_settings():
    from zrl.pipeline.controller import trainer_settings

    data = minimal()
    defaults = trainer_settings(parse_recipe(data), parse_recipe(data).stages[0])
    assert (defaults.activation_checkpointing, defaults.activation_offload, defaults.hsdp_replicas) == (True, False, 1)
    for assignment in ("resources.trainer_workers=8", "resources.hsdp_replicas=2", "resources.activation_offload=true",
                       "resources.activation_checkpointing=false"):
        apply_override(data, assignment)
    recipe = parse_recipe(data)
    settings = trainer_settings(recipe, recipe.stages[0])
    assert (settings.activation_checkpointing, settings.activation_offload, settings.hsdp_replicas) == (False, True, 2)


@pytest.mark.parametrize("workers, replicas", [(2, 3), (6, 4), (16, 0)])
def test_hsdp_replicas_must_divide_the_trainer_ranks(workers, replicas):
    [line] = errors_of(minimal() | {"resources": {"trainer_workers": workers, "hsdp_replicas": replicas}})
    if replicas:
        assert line == (f"resources: hsdp_replicas={replicas} must divide trainer_workers={workers}: every replica "
                        "group shards the model over the same number of ranks")
    else:
        assert line.startswith("resources.hsdp_replicas: ") and "greater than or equal to 1" in line


def test_production_cascade_uses_the_reports_trainer_memory_setup():
    r = load_recipe(ROOT / "recipes" / "zaya1-cascade.yaml").resources
    assert r.activation_offload and r.activation_checkpointing
    assert r.trainer_workers // r.hsdp_replicas == 4  # FSDP shard size 4


def test_an_environment_listed_twice_needs_distinct_keys():
    twice = [{"name": "strings", "options": {"tasks": "copy"}}, {"name": "strings", "options": {"tasks": "reverse"}}]
    assert errors_of(minimal(environments=twice)) == [
        "stages[0]: environments ['strings'] are listed more than once; give each entry a distinct `key` "
        "(its prompts, verifier and reward/<key> metric are found by it)"]
    keyed = [twice[0] | {"key": "copy"}, twice[1] | {"key": "reverse"}]
    stage = parse_recipe(minimal(environments=keyed)).stages[0]
    assert [(e.name, e.key) for e in stage.environments] == [("strings", "copy"), ("strings", "reverse")]
    # One entry may keep the name as its key; a key must be usable in a metric name.
    assert parse_recipe(minimal(environments=[twice[0], keyed[1]])).stages[0].environments[0].key is None
    [line] = errors_of(minimal(environments=[twice[0] | {"key": "strings/copy"}]))
    assert line.startswith("stages[0].environments[0].key: ") and "pattern" in line


def test_output_dir_in_environment_options_is_the_recipes_output_dir():
    data = minimal()
    data["stages"][0]["environments"] = [{"name": "aggregation", "options": {
        "env": "strings", "rollouts": "{output_dir}/stages/a/rollouts/strings.jsonl", "nested": ["{output_dir}/x"]}}]
    apply_override(data, "output_dir=/runs/here")
    recipe = parse_recipe(data, "r.yaml")
    options = recipe.stages[0].environments[0].options
    assert options["rollouts"] == "/runs/here/stages/a/rollouts/strings.jsonl"
    assert options["nested"] == ["/runs/here/x"]


def test_self_rollouts_name_an_entry_of_their_stage_and_say_where_they_are_written():
    data = minimal(self_rollouts=[{"entry": "arithmetic", "prompts": 4, "samples": 2}])
    data["stages"].append({"name": "t", "kind": "rl", "steps": 1, "environments": [{"name": "strings"}]})
    recipe = parse_recipe(data, "r.yaml")
    assert recipe.produced_files() == {"out/stages/s/rollouts/arithmetic.jsonl": "s"}
    data["stages"][0]["self_rollouts"] = [{"entry": "strings"}]
    assert errors_of(data) == ["stages[0]: self_rollouts: ['strings'] are not entries of this stage "
                               "(entries: ['arithmetic'])"]
    data["stages"][0]["self_rollouts"] = [{"entry": "arithmetic", "samples": 1}]
    assert any("stages[0].self_rollouts[0].samples:" in line for line in errors_of(data))


def test_evaluation_is_off_unless_asked_for():
    assert RLStage(name="s", steps=1, environments=[{"name": "strings"}]).evaluation.prompts == 0
    assert errors_of(minimal(evaluation={"prompts": -1}))[0].startswith("stages[0].evaluation.prompts:")


def test_tiny_arch_is_any_registered_family_with_a_tiny_checkpoint():
    from zrl.config.schema import ModelSpec
    from zrl.models import get_family, registered_types

    assert parse_recipe(minimal(), "r.yaml").model.tiny_arch == "zaya"
    for model_type in registered_types():
        data = minimal()
        data["model"]["tiny_arch"] = model_type
        assert parse_recipe(data, "r.yaml").model.tiny_arch == model_type
        assert get_family(model_type).tiny_config["max_position_embeddings"] > 0  # what preflight reads
    data = minimal()
    data["model"]["tiny_arch"] = "llama"
    [line] = [line for line in errors_of(data) if line.startswith("model.tiny_arch")]
    registered = ", ".join(registered_types())
    assert line == f"model.tiny_arch: 'llama' is not a registered model_type (registered: {registered})"
    assert all(name in ModelSpec.model_fields["path"].description for name in registered_types())
