"""A corpus of malformed inputs to `zrl validate` / `zrl run`: every one ends in exit code 2 and one
`zrl: error: <file or option>: <field>: <reason>` line per problem on stderr, never a traceback.

Each case mutates a valid two-stage recipe (sft then rl, the `strings` environment, the tiny model
built once for the module) and runs `zrl.cli.main` in-process. The checks that need no Ray
(zrl.preflight) are exercised with plugin modules written to a temporary directory on sys.path.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from zrl.cli import main

PLUGINS = '''
from zrl.env import Environment
from zrl.types import Message, Prompt


def _prompts(n, seed):
    return [Prompt(env="p", prompt_id=f"{seed}:{i}", messages=(Message("user", "say a"),), answer="a",
                   data_source="p") for i in range(n)]


class Good(Environment):
    name = "good"

    def sample(self, n, seed, split="train", difficulty=None):
        return _prompts(n, seed)

    def verify(self, prompt, response):
        return 1.0


class NotAnEnvironment:
    name = "plain"


class SampleRaises(Good):
    def sample(self, n, seed, split="train", difficulty=None):
        raise ValueError("no prompts today")


class SampleEmpty(Good):
    def sample(self, n, seed, split="train", difficulty=None):
        return []


class SampleStrings(Good):
    def sample(self, n, seed, split="train", difficulty=None):
        return ["a"] * n


class NoVerify(Environment):
    name = "noverify"

    def sample(self, n, seed, split="train", difficulty=None):
        return _prompts(n, seed)


class DemoRaises(Good):
    def demonstration(self, prompt):
        raise KeyError("answer")


class DemoTranscriptEndsWithTool(Good):
    def demonstration(self, prompt):
        return [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "42"}]


class Continuous(Good):
    reward_type = "continuous"


class Nameless(Good):
    name = ""
'''


@dataclass
class Case:
    id: str
    expect: list[tuple[str, str]]  # per stderr line: (where: "<field>" after the recipe path, or "--set..."), reason
    edit: Callable[[dict, Path], None] | None = None  # mutates the recipe data (tmp_path for files it needs)
    text: Callable[[str], str | bytes] | None = None  # rewrites the recipe's YAML text
    sets: tuple[str, ...] = ()
    command: str = "validate"
    flags: tuple[str, ...] = ()


def at(path: str, value) -> Callable[[dict, Path], None]:
    """An edit setting `path` (dots; list items by index) to `value`."""
    def edit(data, tmp_path):
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


def env(reference: str, stage: int = 1, **fields) -> Callable[[dict, Path], None]:
    return at(f"stages.{stage}.environments", [{"name": reference, **fields}])


def replace(old: str, new: str) -> Callable[[str], str]:
    def rewrite(text):
        assert old in text, old
        return text.replace(old, new, 1)
    return rewrite


def file_at(name: str, content: bytes | str | None, then: Callable[[dict, Path], None]):
    """Write `content` to tmp_path/name (a directory when None), then apply `then`."""
    def edit(data, tmp_path):
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            target.mkdir()
        else:
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        then(data, tmp_path)
    return edit


def model_dir_with(config: str | bytes) -> Callable[[dict, Path], None]:
    def point(data, tmp_path):
        (tmp_path / "model" / "model.safetensors").write_bytes(b"")
        data["model"]["path"] = str(tmp_path / "model")
    return file_at("model/config.json", config, point)


def output_dir(relative: str) -> Callable[[dict, Path], None]:
    def point(data, tmp_path):
        data["output_dir"] = str(tmp_path / relative)
    return point


UNKNOWN = "unknown field"
NOT_INT = "Input should be a valid integer"
NOT_FLOAT = "Input should be a valid number"
NOT_FINITE = "Input should be a finite number"
PLUGIN = "zrl_corpus_plugins"

CASES = [
    # --- YAML syntax -------------------------------------------------------------------------------
    Case("yaml-unclosed-flow", [("invalid YAML", "line 2, column 5: expected ',' or ']'")], text=lambda t: "name: [x\n" + t),
    Case("yaml-bad-indent", [("invalid YAML", "mapping values are not allowed here")],
         text=replace("name: r\n", "name: r\n  oops: x: y\n")),
    Case("yaml-tab-indent", [("invalid YAML", "found character '\\t'")], text=replace("name: r\n", "name: r\n\tx: 1\n")),
    Case("yaml-undefined-alias", [("invalid YAML", "found undefined alias 'nope'")],
         text=replace("name: r\n", "name: *nope\n")),
    Case("yaml-unhashable-key", [("invalid YAML", "found unhashable key")], text=lambda t: t + "[a, b]: 1\n"),
    Case("yaml-python-tag", [("invalid YAML", "could not determine a constructor for the tag")],
         text=replace("name: r\n", "name: !!python/object/apply:os.getcwd []\n")),
    Case("yaml-two-documents", [("invalid YAML", "but found another document")], text=lambda t: t + "---\nname: s\n"),
    Case("yaml-duplicate-top-key", [("invalid YAML", "duplicate key 'name' (first at line 1)")],
         text=lambda t: t + "name: again\n"),
    Case("yaml-duplicate-nested-key", [("invalid YAML", "duplicate key 'group_size'")],
         text=replace("group_size: 2", "group_size: 2\n    group_size: 4")),
    Case("yaml-duplicate-flow-key", [("invalid YAML", "duplicate key 'jsonl'")],
         text=replace("name: r\n", "name: r\nmetrics: {jsonl: true, jsonl: false}\n")),
    Case("yaml-empty-file", [("<recipe>", "expected a mapping at the top level, got NoneType")], text=lambda t: ""),
    Case("yaml-top-level-list", [("<recipe>", "expected a mapping at the top level, got list")],
         text=lambda t: "- a\n- b\n"),
    # --- encodings ---------------------------------------------------------------------------------
    Case("encoding-latin-1", [("not UTF-8 text", "byte 0xe9 at offset")],
         text=lambda t: t.encode() + "description: caf\xe9\n".encode("latin-1")),
    Case("encoding-utf-16", [("not UTF-8 text", "byte 0xff at offset 0")], text=lambda t: t.encode("utf-16")),
    Case("encoding-nul-character", [("invalid YAML", "unacceptable character #x0000")],
         text=lambda t: t + "description: a\x00b\n"),
    # --- types -------------------------------------------------------------------------------------
    Case("type-steps-bool", [("stages[1].steps", NOT_INT)], edit=at("stages.1.steps", True)),
    Case("type-steps-string", [("stages[1].steps", NOT_INT)], edit=at("stages.1.steps", "3")),
    Case("type-steps-float", [("stages[1].steps", NOT_INT)], edit=at("stages.1.steps", 2.5)),
    Case("type-lr-string", [("stages[1].optimizer.muon.lr", NOT_FLOAT)], edit=at("stages.1.optimizer.muon.lr", "0.001")),
    Case("type-temperature-bool", [("stages[1].sampling.temperature", NOT_FLOAT)],
         edit=at("stages.1.sampling.temperature", True)),
    Case("type-flag-string", [("resources.activation_checkpointing", "Input should be a valid boolean")],
         edit=at("resources.activation_checkpointing", "yes")),
    Case("type-name-int", [("name", "Input should be a valid string")], edit=at("name", 123)),
    Case("type-model-list", [("model", "Input should be a valid dictionary")], edit=at("model", ["a", "b"])),
    Case("type-stages-dict", [("stages", "Input should be a valid list")], edit=at("stages", {"a": 1})),
    Case("type-options-list", [("stages[1].environments[0].options", "Input should be a valid dictionary")],
         edit=at("stages.1.environments.0.options", [1, 2])),
    Case("type-stop-string", [("stages[1].sampling.stop", "Input should be a valid list")],
         edit=at("stages.1.sampling.stop", "x")),
    Case("type-betas-one", [("stages[1].optimizer.adamw.betas[1]", "required field is missing")],
         edit=at("stages.1.optimizer.adamw.betas", [0.9])),
    Case("type-dtype-choice", [("model.dtype", "Input should be 'bfloat16' or 'float32'")], edit=at("model.dtype", "fp8")),
    # --- ranges ------------------------------------------------------------------------------------
    Case("range-steps-zero", [("stages[1].steps", "greater than or equal to 1")], edit=at("stages.1.steps", 0)),
    Case("range-steps-negative", [("stages[0].steps", "greater than or equal to 1")], edit=at("stages.0.steps", -3)),
    Case("range-lr-inf", [("stages[1].optimizer.muon.lr", NOT_FINITE)], edit=at("stages.1.optimizer.muon.lr", float("inf"))),
    Case("range-lr-nan", [("stages[0].optimizer.muon.lr", NOT_FINITE)], edit=at("stages.0.optimizer.muon.lr", float("nan"))),
    Case("range-lr-overflow", [("stages[1].optimizer.muon.lr", NOT_FINITE)],
         text=replace("  sampling:\n", "  optimizer: {muon: {lr: 1e400}}\n  sampling:\n")),
    Case("range-lr-negative", [("stages[1].optimizer.muon.lr", "greater than 0")], edit=at("stages.1.optimizer.muon.lr", -1e-3)),
    Case("range-bands-nan", [("stages[1].algorithm.canaries.rare_token_bands[0]", NOT_FINITE)],
         edit=at("stages.1.algorithm", {"canaries": {"rare_token_bands": [float("nan")]}})),
    Case("range-temperature-zero", [("stages[1].sampling.temperature", "is below 0.01")],
         edit=at("stages.1.sampling.temperature", 0)),
    Case("range-top-p", [("stages[1].sampling.top_p", "less than or equal to 1")], edit=at("stages.1.sampling.top_p", 1.5)),
    Case("range-cpus-negative", [("resources.cpus_per_rollout_worker", "greater than 0")],
         edit=at("resources.cpus_per_rollout_worker", -1)),
    Case("range-sft-min-length", [("stages[0].max_sequence_tokens", "greater than or equal to 8")],
         edit=at("stages.0.max_sequence_tokens", 4)),
    # --- unknown fields at every depth -------------------------------------------------------------
    Case("unknown-top", [("colour", UNKNOWN)], edit=at("colour", "blue")),
    Case("unknown-model", [("model.colour", UNKNOWN)], edit=at("model.colour", "blue")),
    Case("unknown-resources", [("resources.colour", UNKNOWN)], edit=at("resources.colour", "blue")),
    Case("unknown-metrics", [("metrics.colour", UNKNOWN)], edit=at("metrics.colour", "blue")),
    Case("unknown-wandb", [("metrics.wandb.colour", UNKNOWN)], edit=at("metrics.wandb.colour", "blue")),
    Case("unknown-stage", [("stages[0].colour", UNKNOWN)], edit=at("stages.0.colour", "blue")),
    Case("unknown-sampling", [("stages[1].sampling.group_sise", UNKNOWN)], edit=at("stages.1.sampling.group_sise", 4)),
    Case("unknown-algorithm", [("stages[1].algorithm.colour", UNKNOWN)], edit=at("stages.1.algorithm.colour", 1)),
    Case("unknown-trust-region", [("stages[1].algorithm.trust_region.colour", UNKNOWN)],
         edit=at("stages.1.algorithm.trust_region", {"type": "dppo_binary_tv", "colour": 1})),
    Case("unknown-asynchrony", [("stages[1].asynchrony.colour", UNKNOWN)], edit=at("stages.1.asynchrony.colour", 1)),
    Case("unknown-optimizer", [("stages[0].optimizer.colour", UNKNOWN)], edit=at("stages.0.optimizer.colour", 1)),
    Case("unknown-muon", [("stages[1].optimizer.muon.colour", UNKNOWN)], edit=at("stages.1.optimizer.muon.colour", 1)),
    Case("unknown-environment-entry", [("stages[1].environments[0].colour", UNKNOWN)],
         edit=at("stages.1.environments.0.colour", 1)),
    Case("unknown-inherit", [("stages[1].inherit.colour", UNKNOWN)], edit=at("stages.1.inherit.colour", 1)),
    Case("unknown-two-at-once", [("model.size", UNKNOWN), ("colour", UNKNOWN)],
         edit=lambda d, p: (at("colour", 1)(d, p), at("model.size", 1)(d, p))),
    # --- cross-field rules -------------------------------------------------------------------------
    Case("cross-duplicate-stage-names", [("<recipe>", "stage names must be unique; repeated: ['rl']")],
         edit=at("stages.0.name", "rl")),
    Case("cross-hsdp-divides", [("resources", "hsdp_replicas=3 must divide trainer_workers=2")],
         edit=at("resources.hsdp_replicas", 3)),
    Case("cross-staleness", [("stages[1].asynchrony", "every rollout would be evicted as stale")],
         edit=at("stages.1.asynchrony", {"sync_every_steps": 4, "max_staleness_steps": 1})),
    Case("cross-buffer-capacity", [("stages[1].asynchrony", "the trainer could never pull")],
         edit=at("stages.1.asynchrony", {"min_ready_batches": 3, "buffer_capacity_batches": 2})),
    Case("cross-group-size", [("stages[1]", "need G >= 2")], edit=at("stages.1.sampling.group_size", 1)),
    Case("cross-maxrl-continuous-declared", [("stages[1]", "maxrl needs binary rewards")],
         edit=at("stages.1.environments.0.reward_type", "continuous")),
    Case("cross-environment-twice", [("stages[1]", "are listed more than once")],
         edit=at("stages.1.environments", [{"name": "strings"}, {"name": "strings"}])),
    Case("cross-missing-model", [("model", "required field is missing")], edit=lambda d, p: d.pop("model")),
    Case("cross-unknown-kind", [("stages[1]", "does not match any of the expected tags")], edit=at("stages.1.kind", "dpo")),
    Case("cross-unknown-trust-region", [("stages[1].algorithm.trust_region", "does not match any of the expected tags")],
         edit=at("stages.1.algorithm.trust_region", {"type": "kl_penalty"})),
    # --- --set -------------------------------------------------------------------------------------
    Case("set-no-equals", [("--set: 'foo'", "expected path.to.field=value")], sets=("foo",)),
    Case("set-empty-path", [("--set: '=5'", "has an empty part")], sets=("=5",)),
    Case("set-empty-part", [("--set: 'stages..steps=1'", "has an empty part")], sets=("stages..steps=1",)),
    Case("set-unknown-stage", [("--set: stages.x", "no item named 'x'")], sets=("stages.x.steps=1",)),
    Case("set-index-out-of-range", [("--set: stages.9", "index out of range (list has 2 items)")], sets=("stages.9.steps=1",)),
    Case("set-descend-into-int", [("--set: stages.0.steps.x", "cannot descend into a int")], sets=("stages.0.steps.x=1",)),
    Case("set-value-not-yaml", [("--set: stages.0.steps", "the value is not YAML")], sets=("stages.0.steps=[1",)),
    Case("set-unknown-field", [("model.colour", UNKNOWN)], sets=("model.colour=1",)),
    Case("set-yes-for-a-number", [("stages[1].sampling.temperature", NOT_FLOAT)], sets=("stages.rl.sampling.temperature=yes",)),
    Case("set-inf", [("stages[1].optimizer.muon.lr", NOT_FINITE)], sets=("stages.rl.optimizer.muon.lr=.inf",)),
    # --- difficulty ---------------------------------------------------------------------------------
    Case("difficulty-env-takes-none", [("stages[1].environments[0].difficulty", "'reasoning_gym' takes no difficulty")],
         edit=env("reasoning_gym", difficulty="adaptive")),
    Case("difficulty-out-of-levels", [("stages[1].environments[0].difficulty", "99 is outside the levels of 'strings' (0..20)")],
         edit=env("strings", difficulty=99)),
    Case("difficulty-negative", [("stages[1].environments[0].difficulty", "must be an integer level >= 0 or 'adaptive'")],
         edit=env("strings", difficulty=-1)),
    Case("difficulty-word", [("stages[1].environments[0].difficulty", "must be an integer level >= 0 or 'adaptive' (got 'hard')")],
         edit=env("strings", difficulty="hard")),
    Case("curriculum-without-adaptive", [("stages[1].environments[0]", "need difficulty: adaptive")],
         edit=env("strings", curriculum={"max_level": 5})),
    Case("curriculum-unknown-setting", [("stages[1].environments[0]", "curriculum.maxlevel: unknown setting; did you mean max_level")],
         edit=env("strings", difficulty="adaptive", curriculum={"maxlevel": 5})),
    Case("curriculum-bad-setting", [("stages[1].environments[0]", "curriculum.min_level: must be <= max_level (got 9 > 3)")],
         edit=env("strings", difficulty="adaptive", curriculum={"min_level": 9, "max_level": 3})),
    Case("curriculum-outside-levels", [("stages[1].environments[0].curriculum.max_level", "40 is outside the levels of 'strings'")],
         edit=env("strings", difficulty="adaptive", curriculum={"max_level": 40})),
    # --- broken plugins ----------------------------------------------------------------------------
    Case("plugin-missing-module", [("stages[1].environments[0].name", "cannot import 'zrl_corpus_absent'")],
         edit=env("zrl_corpus_absent:Env")),
    Case("plugin-missing-class", [("stages[1].environments[0].name", f"'{PLUGIN}' has no attribute 'Nope'")],
         edit=env(f"{PLUGIN}:Nope")),
    Case("plugin-raises-at-import", [("stages[1].environments[0].name", "raised RuntimeError: boom at import")],
         edit=env("zrl_corpus_boom:Env")),
    Case("plugin-not-an-environment", [("stages[1].environments[0].name", "is not a subclass of zrl.env.Environment")],
         edit=env(f"{PLUGIN}:NotAnEnvironment")),
    Case("plugin-abstract", [("stages[1].environments[0].name", "does not implement verify")],
         edit=env(f"{PLUGIN}:NoVerify")),
    Case("plugin-no-name", [("stages[1].environments[0].name", "has no `name`")], edit=env(f"{PLUGIN}:Nameless")),
    Case("plugin-sample-raises", [("stages[1].environments[0]", "sample(2, seed=0) raised ValueError: no prompts today")],
         edit=env(f"{PLUGIN}:SampleRaises")),
    Case("plugin-sample-empty", [("stages[1].environments[0]", "sample(2, seed=0) returned 0 prompts")],
         edit=env(f"{PLUGIN}:SampleEmpty")),
    Case("plugin-sample-not-prompts", [("stages[1].environments[0]", "not a zrl.types.Prompt")],
         edit=env(f"{PLUGIN}:SampleStrings")),
    Case("plugin-bad-option", [("stages[1].environments[0].options", "rejected options {'colour': 1}: TypeError: Good() takes no")],
         edit=env(f"{PLUGIN}:Good", options={"colour": 1})),
    Case("plugin-continuous-under-maxrl", [("stages[1].environments[0]", "has continuous rewards but the stage uses maxrl")],
         edit=env(f"{PLUGIN}:Continuous")),
    Case("plugin-same-class-twice", [("stages[1].environments", "['good'] are listed more than once")],
         edit=at("stages.1.environments", [{"name": f"{PLUGIN}:Good"}, {"name": f"{PLUGIN}:DemoRaises"}])),
    Case("sft-no-demonstrations", [("stages[0].environments[0]", "has no demonstrations")], edit=env(f"{PLUGIN}:Good", stage=0)),
    Case("sft-demonstration-raises", [("stages[0].environments[0]", "demonstration() raised KeyError")],
         edit=env(f"{PLUGIN}:DemoRaises", stage=0)),
    Case("sft-demonstration-bad-transcript", [("stages[0].environments[0]", "demonstration(): a multi-turn "
                                                "demonstration starts and ends with an assistant message, got roles "
                                                "['assistant', 'tool']")],
         edit=env(f"{PLUGIN}:DemoTranscriptEndsWithTool", stage=0)),
    Case("unknown-environment-typo", [("stages[1].environments[0].name", "unknown environment 'strngs'; did you mean "
                                                                          "'strings'?")], edit=env("strngs")),
    Case("builtin-unknown-option", [("stages[1].environments[0].options", "unexpected keyword argument 'colour'")],
         edit=at("stages.1.environments.0.options", {"colour": 1})),
    Case("builtin-bad-option-value", [("stages[0].environments[0].options", "tasks must be among")],
         edit=at("stages.0.environments.0.options", {"tasks": "sort"})),
    # --- paths and the model -----------------------------------------------------------------------
    Case("path-recipe-missing", [("file not found", "file not found")], text=lambda t: None),
    Case("path-output-dir-is-a-file", [("output_dir", "exists and is not a directory")],
         edit=file_at("taken", "x", output_dir("taken"))),
    Case("path-output-dir-under-a-file", [("output_dir", "cannot be created")],
         edit=file_at("taken", "x", output_dir("taken/run"))),
    Case("path-model-empty", [("model.path", "String should have at least 1 character")], edit=at("model.path", "")),
    Case("path-model-is-a-file", [("model.path", "exists and is not a directory")],
         edit=file_at("tiny-m", "x", lambda d, p: d["model"].update(path=str(p / "tiny-m"), build_tiny_if_missing=True))),
    Case("model-config-not-json", [("model.path", "config.json: not valid JSON")], edit=model_dir_with("{garbage")),
    Case("model-config-not-utf8", [("model.path", "config.json: not valid JSON")],
         edit=model_dir_with(b'{"model_type": "\xe9"}')),
    Case("model-config-a-list", [("model.path", "config.json: expected a JSON object, got list")], edit=model_dir_with("[]")),
    Case("model-config-unregistered", [("model.path", "model_type 'llama' is not supported; registered: glm4_moe, qwen3_moe, zaya")],
         edit=model_dir_with('{"model_type": "llama"}')),
    Case("model-config-without-weights", [("model.path", "config.json: not valid JSON")],
         edit=file_at("bare/config.json", "{garbage", lambda d, p: d["model"].update(path=str(p / "bare")))),
    Case("context-rl-too-long", [("stages[1].sampling.max_response_tokens", "= 2064 exceeds the model's context of 1024")],
         edit=at("stages.1.sampling.max_response_tokens", 2000)),
    Case("context-sft-too-long", [("stages[0].max_sequence_tokens", "4096 exceeds the model's context of 1024 tokens")],
         edit=at("stages.0.max_sequence_tokens", 4096)),
    Case("context-tiny-model-to-build", [("stages[1].sampling.max_response_tokens", "the tiny model build_tiny_if_missing")],
         edit=lambda d, p: (d["model"].update(path=str(p / "tiny-to-build"), build_tiny_if_missing=True),
                            at("stages.1.sampling.max_response_tokens", 4096)(d, p))),
    Case("sft-demonstration-too-long", [("stages[0].max_sequence_tokens", "leaves no room for the prompt")],
         edit=lambda d, p: (at("stages.0.max_sequence_tokens", 8)(d, p),
                            at("stages.0.environments.0.options", {"min_letters": 9, "max_letters": 10})(d, p))),
    # --- `zrl run` makes the same checks before it starts Ray ----------------------------------------
    Case("run-output-dir-is-a-file", [("output_dir", "exists and is not a directory")],
         edit=file_at("taken", "x", output_dir("taken")), command="run"),
    Case("run-plugin-sample-raises", [("stages[1].environments[0]", "raised ValueError: no prompts today")],
         edit=env(f"{PLUGIN}:SampleRaises"), command="run"),
    Case("run-unknown-environment", [("stages[1].environments[0].name", "unknown environment 'no_such_env'")],
         edit=env("no_such_env"), command="run"),
    Case("run-model-missing", [("model.path", "is not a model checkpoint directory")],
         edit=lambda d, p: d["model"].update(path=str(p / "absent")), command="run"),
    Case("run-context-too-long", [("stages[0].max_sequence_tokens", "exceeds the model's context")],
         edit=at("stages.0.max_sequence_tokens", 2048), command="run"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from zrl.assets import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("corpus") / "tiny-zaya")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / f"{PLUGIN}.py").write_text(PLUGINS)
    (tmp_path / "zrl_corpus_boom.py").write_text('raise RuntimeError("boom at import")\n')
    monkeypatch.syspath_prepend(str(tmp_path))


def valid_recipe(model: Path, tmp_path: Path) -> dict:
    return {
        "name": "r",
        "model": {"path": str(model), "dtype": "float32"},
        "output_dir": str(tmp_path / "out"),
        "resources": {"rollout_workers": 1, "trainer_workers": 2},
        "stages": [
            {"name": "warm", "kind": "sft", "steps": 2, "environments": [{"name": "strings", "options": {"tasks": "copy"}}],
             "max_sequence_tokens": 96},
            {"name": "rl", "kind": "rl", "steps": 2, "environments": [{"name": "strings", "options": {"tasks": "copy"}}],
             "sampling": {"prompts_per_batch": 2, "group_size": 2, "max_prompt_tokens": 64, "max_response_tokens": 24}},
        ],
    }


def run_case(case: Case, model: Path, tmp_path: Path, capsys) -> tuple[int, str, str, str]:
    data = valid_recipe(model, tmp_path)
    if case.edit:
        case.edit(data, tmp_path)
    text = yaml.safe_dump(data, sort_keys=False)
    recipe = tmp_path / "r.yaml"
    content = case.text(text) if case.text else text
    if content is None:
        recipe = tmp_path / "no-such.yaml"
    else:
        recipe.write_bytes(content.encode() if isinstance(content, str) else content)
    argv = [case.command, str(recipe), *case.flags] + [arg for s in case.sets for arg in ("--set", s)]
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err, str(recipe)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_is_one_line_per_problem(case, tiny_model, tmp_path, plugins, capsys):
    code, out, err, recipe = run_case(case, tiny_model, tmp_path, capsys)
    assert "Traceback" not in err + out
    assert code == 2, (out, err)  # validate too: anything wrong in the recipe itself fails it
    lines = err.splitlines()
    assert len(lines) == len(case.expect), lines
    for line, (where, reason) in zip(lines, case.expect):
        source = "" if where.startswith("--set") else f"{recipe}: "
        assert line.startswith(f"zrl: error: {source}{where}"), line
        assert reason in line, line
    if case.command == "validate":
        assert out == ""  # the resolved recipe is printed only for a recipe without problems


def test_corpus_is_large_and_ids_are_unique():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


def test_the_base_recipe_validates(tiny_model, tmp_path, capsys):
    """Guards the corpus: every failure above comes from its mutation, not from the base recipe."""
    code, out, err, _ = run_case(Case("valid", []), tiny_model, tmp_path, capsys)
    assert (code, err) == (0, "")
    assert out.startswith("r: valid, 2 stages, ") and out.endswith("\nabsent on this machine: nothing\n")


@pytest.mark.parametrize("spelling", ["\ufeff", "", "  # a comment\n"])
def test_a_utf8_byte_order_mark_and_yaml_1_2_floats_are_accepted(spelling, tiny_model, tmp_path, capsys):
    text = spelling + yaml.safe_dump(valid_recipe(tiny_model, tmp_path), sort_keys=False)
    text = text.replace("max_sequence_tokens: 96", "max_sequence_tokens: 96\n  optimizer: {muon: {lr: 2e-3}}")
    case = Case("ok", [], text=lambda _: text, flags=("--full",))
    code, out, err, _ = run_case(case, tiny_model, tmp_path, capsys)
    assert (code, err) == (0, "")
    assert "lr: 0.002" in out


def test_a_good_plugin_validates(tiny_model, tmp_path, plugins, capsys):
    case = Case("good-plugin", [], edit=env(f"{PLUGIN}:Good"))
    code, out, err, _ = run_case(case, tiny_model, tmp_path, capsys)
    assert (code, err) == (0, ""), err
    assert out.splitlines()[3].split() == ["rl", "rl", "2", f"{PLUGIN}:Good"]


def test_eval_options_that_are_not_a_mapping(capsys):
    assert main(["eval", "ckpt", "--env", "strings", "--options", "[1, 2]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zrl: error: --options: expected a mapping") and "Traceback" not in err



def test_eval_of_a_checkpoint_that_does_not_exist(capsys, tmp_path):
    assert main(["eval", str(tmp_path / "stages" / "x" / "hf"), "--env", "strings"]) == 2
    assert capsys.readouterr().err == f"zrl: error: {tmp_path}/stages/x/hf: not a checkpoint directory (no config.json)\n"
