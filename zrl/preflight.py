"""Checks of a validated recipe against this machine that need no Ray: what `zrl validate` reports and
`zrl run` makes before it starts anything.

A finding is `(field, reason)`: the recipe field it concerns (`model.path`, `stages[1].sampling...`,
the same paths schema errors use) and one line saying what is wrong. Three kinds:
- a *problem* would fail the run: an output_dir that cannot be created or written; a model directory
  whose config.json is unreadable or not a zaya config; a `revision` given with a local directory; a
  cached Hub snapshot that is not a checkpoint; build_tiny_if_missing where something other than a
  scratch asset is in the way (a non-empty directory or a file: zrl/hub.py); lengths beyond the
  model's context (`max_position_embeddings`, or the tiny model's when the run builds it); an
  environment reference (`module:Class`) that cannot be imported or is not an `Environment`; options its
  constructor rejects; a `sample` that raises or does not return the prompts asked for; an sft
  environment without demonstrations, or whose demonstrations alone exceed `max_sequence_tokens`; a
  maxrl stage on continuous rewards; an rl stage with a reward-model environment in a recipe without
  `reward_model`.
  An environment name nobody registered is a problem too (with the registered names closest to it):
  a typo must not pass as "not installed here"; a plugin's environment is named by its `module:Class`
  or installed where the recipe is checked.
- a *missing* item is named by the recipe but absent here: a model or reward-model directory that
  does not exist (and is not built: build_tiny_if_missing builds only at a scratch asset path), a
  Hugging Face repo id not in the cache while HF_HUB_OFFLINE is set, a data file an environment's
  options name, or the GPUs `resources` reserves (counted only when `gpus_here`: the run starts its
  own Ray on this machine). `zrl validate` lists these (and fails on them with --strict); `zrl run`
  refuses them. An entry whose data an earlier stage of the run writes (`self_rollouts`, named with
  `{output_dir}`) is not built here.
- a *pending* item is absent here but the run fetches it: a Hugging Face repo downloaded on first use.
  `zrl validate` lists it (and fails on it with --strict); `zrl run` downloads it.

`Findings.models` says, for `model.path` and `reward_model.path`, what a run would read: the local
directory, the cached snapshot of a repo id (revision and commit), a repo downloaded on first use, or
the tiny model the run builds. `Findings.data` lists, per stage, every data file (an option value
ending in .jsonl, .json, .parquet or .csv) with whether it is present, missing or written by an
earlier stage: `zrl validate` prints both.

Every environment of every stage is built with its options and asked for `SAMPLE_SIZE` prompts with
seed `SAMPLE_SEED` (sft stages also for their demonstrations), exactly as the run's prompt source would
call it, so a broken plugin fails here instead of minutes into a run. The demonstration length is
measured with the tokenizer's `tokenizer.json` alone (the `tokenizers` library, no transformers import):
a demonstration that does not fit by itself leaves no room for the prompt the chat template adds.
"""

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from zrl.config.schema import Recipe, RLStage, SFTStage
from zrl.env.episode import transcript_problem

SAMPLE_SIZE = 2
SAMPLE_SEED = 0

Finding = tuple[str, str]


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")  # an option value naming a data file


@dataclass
class Findings:
    problems: list[Finding] = field(default_factory=list)
    missing: list[Finding] = field(default_factory=list)
    pending: list[Finding] = field(default_factory=list)
    data: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)  # stage -> (entry, file, status)
    models: list[Finding] = field(default_factory=list)  # (model.path / reward_model.path, what a run would read)


def check(recipe: Recipe, gpus_here: bool = True) -> Findings:
    """Every problem, missing and pending item of `recipe` on this machine (see the module docstring)."""
    findings = Findings()
    findings.problems += _output_dir(Path(recipe.output_dir))
    if gpus_here:
        findings.missing += _gpus(recipe)
    context, model_dir = _model(recipe, findings)
    tokenizer = _Tokenizer(recipe, model_dir)
    produced = recipe.produced_files()
    for i, stage in enumerate(recipe.stages):
        findings.problems += _context(stage, f"stages[{i}]", context)
        findings.data[stage.name] = data_files(stage, produced)
        _environments(stage, f"stages[{i}]", tokenizer, findings, recipe.reward_model is not None, produced)
    findings.problems += tokenizer.problems
    _reward_model(recipe, findings)
    return findings


TINY = "tiny"  # _checkpoint: the run builds the tiny model at the path


def _checkpoint(field: str, spec, is_checkpoint, what: str, findings: Findings) -> Path | str | None:
    """What `spec.path` (a ModelSpec or RewardModelSpec) gives a run here (zrl/hub.py): the checkpoint
    directory; TINY when the run builds the tiny model there; None when there is none to read now (to be
    downloaded, missing, or refused: the finding is recorded)."""
    from zrl.hub import ModelPathError, locate, scratch_refusal

    try:
        where = locate(spec.path, spec.revision, field)
    except ModelPathError as exc:
        findings.problems.append((field, exc.reason))
        return None
    if where.local is None or is_checkpoint(where.local):
        findings.models.append((field, where.describe()))
        if where.missing is not None:
            findings.missing.append((field, where.missing))
        elif where.local is None:
            findings.pending.append((field, f"{spec.path}: downloaded from the Hugging Face Hub on first use"))
        return where.local
    if where.repo_id is not None:
        findings.problems.append((field, f"{where.local} (the cached snapshot of {where.repo_id}) is not a {what}"))
        return None
    if not spec.build_tiny_if_missing:
        findings.missing.append((field, f"{spec.path} is not a {what} and build_tiny_if_missing is false"))
        return None
    refusal = scratch_refusal(spec.path, what)
    if refusal is None:
        findings.models.append((field, f"{spec.path}: the tiny CPU model, built there by the run "
                                       "(build_tiny_if_missing)"))
        return TINY
    # Something other than a scratch asset is in the way here: the run would fail. A path that does not
    # exist here may exist where the run runs: only missing.
    (findings.problems if Path(spec.path).expanduser().exists() else findings.missing).append((field, refusal))
    return None


def _reward_model(recipe: Recipe, findings: Findings) -> None:
    from zrl.reward_model import is_reward_model_dir

    if recipe.reward_model is not None:
        _checkpoint("reward_model.path", recipe.reward_model, is_reward_model_dir,
                    "sequence-classification checkpoint directory", findings)


def _gpus(recipe: Recipe) -> list[Finding]:
    """The GPUs `resources` reserves, when this machine has fewer (Ray would wait for them forever)."""
    res = recipe.resources
    needed = (res.rollout_workers * res.gpus_per_rollout_worker + res.trainer_workers * res.gpus_per_trainer_worker
              + (res.reward_model_workers * res.gpus_per_reward_model_worker if recipe.reward_model else 0))
    if needed == 0:
        return []
    import torch

    here = torch.cuda.device_count()
    if here >= math.ceil(needed):
        return []
    return [("resources", f"the recipe reserves {needed:g} GPUs; this machine has {here}")]


def unknown_environment(name: str, error: Exception) -> str:
    """The registry's one line for an unknown environment `name`, with the registered names closest to it."""
    from zrl.env import registry

    names = registry.names()
    close = difflib.get_close_matches(name, names, n=3)
    if not close:
        return str(error)
    return (f"unknown environment {name!r}; did you mean {' or '.join(map(repr, close))}? (registered: "
            f"{', '.join(names)}; or a `module:Class` reference)")


def _output_dir(out: Path) -> list[Finding]:
    if out.exists():
        if not out.is_dir():
            return [("output_dir", f"{out} exists and is not a directory")]
        existing = out
    else:
        existing = next(p for p in out.absolute().parents if p.exists())
        if not existing.is_dir():
            return [("output_dir", f"{out} cannot be created: {existing} is not a directory")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [("output_dir", f"{out} cannot be written: {existing} is not writable")]
    return []


@dataclass(frozen=True)
class _Context:
    tokens: int
    source: str  # where the number comes from, for the message


def _model(recipe: Recipe, findings: Findings) -> tuple[_Context | None, Path | None]:
    """The model's context length when known, and the directory its files are read from when there is
    one here; records problems and missing items of `model.path`."""
    from zrl.assets import is_checkpoint_dir
    from zrl.models import get_family

    what = "model checkpoint directory (config.json and *.safetensors)"
    found = _checkpoint("model.path", recipe.model, is_checkpoint_dir, what, findings)
    if found == TINY:
        return (_Context(get_family(recipe.model.tiny_arch).tiny_config["max_position_embeddings"],
                         f"the tiny model build_tiny_if_missing builds ({recipe.model.tiny_arch})"), None)
    if found is not None:
        return _model_config(found / "config.json", findings), found
    # A config.json without weights is still checked: a wrong one is worth knowing before the weights arrive.
    config = Path(recipe.model.path).expanduser() / "config.json"
    return (_model_config(config, findings) if config.is_file() else None), None


def _model_config(config: Path, findings: Findings) -> _Context | None:
    from zrl.models import get_family, model_type_of

    try:
        raw = json.loads(config.read_bytes())
    except OSError as exc:
        findings.problems.append(("model.path", f"{config}: cannot read: {exc.strerror}"))
        return None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        findings.problems.append(("model.path", f"{config}: not valid JSON: {exc}"))
        return None
    if not isinstance(raw, dict):
        findings.problems.append(("model.path", f"{config}: expected a JSON object, got {type(raw).__name__}"))
        return None
    try:  # the model family of its model_type parses it (a ConfigError is a ValueError)
        get_family(model_type_of(raw)).parse_config(raw)
    except (TypeError, ValueError) as exc:
        findings.problems.append(("model.path", f"{config}: not a supported model config: {exc}"))
        return None
    tokens = raw.get("max_position_embeddings")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
        return _Context(tokens, f"max_position_embeddings in {config}")
    return None


def _context(stage, where: str, context: _Context | None) -> list[Finding]:
    if context is None:
        return []
    if isinstance(stage, RLStage):
        total = stage.sampling.max_prompt_tokens + stage.sampling.max_response_tokens
        if total > context.tokens:
            return [(f"{where}.sampling.max_response_tokens",
                     f"max_prompt_tokens + max_response_tokens = {total} exceeds the model's context of "
                     f"{context.tokens} tokens ({context.source})")]
    elif isinstance(stage, SFTStage) and stage.max_sequence_tokens > context.tokens:
        return [(f"{where}.max_sequence_tokens", f"{stage.max_sequence_tokens} exceeds the model's context of "
                                                 f"{context.tokens} tokens ({context.source})")]
    return []


class _Tokenizer:
    """The recipe's tokenizer, loaded on first use from `tokenizer.json` when the files exist."""

    def __init__(self, recipe: Recipe, model_dir: Path | None):
        self.field = "model.tokenizer_path" if recipe.model.tokenizer_path else "model.path"
        folder = Path(recipe.model.tokenizer_path) if recipe.model.tokenizer_path else model_dir
        self.file = None if folder is None else folder / "tokenizer.json"
        self.problems: list[Finding] = []
        self._loaded = False
        self._tokenizer = None

    def count(self, text: str) -> int | None:
        """Tokens of `text` (no special tokens added), or None when there is no usable tokenizer here."""
        if not self._loaded:
            self._loaded = True
            if self.file is not None and self.file.is_file():
                from tokenizers import Tokenizer

                try:
                    self._tokenizer = Tokenizer.from_file(str(self.file))
                except Exception as exc:  # the tokenizers library raises its own exception type
                    self.problems.append((self.field, f"{self.file}: cannot load the tokenizer: {exc}"))
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _file_options(value) -> list[str]:
    if isinstance(value, str):
        return [value] if value.endswith(DATA_SUFFIXES) else []
    if isinstance(value, dict):
        return [f for v in value.values() for f in _file_options(v)]
    if isinstance(value, list):
        return [f for v in value for f in _file_options(v)]
    return []


def data_files(stage, produced: dict[str, str]) -> list[tuple[str, str, str]]:
    """(entry, file, status) for every data file the stage's entries name in their options; status is
    "present", "missing" or "written by stage <name>" (an earlier stage's self-rollouts)."""
    out = []
    for key, spec in zip(stage.entry_keys(), stage.environments):
        for path in _file_options(spec.options):
            status = (f"written by stage {produced[path]}" if path in produced
                      else "present" if Path(path).exists() else "missing")
            out.append((key, path, status))
    return out


def _environments(stage, where: str, tokenizer: _Tokenizer, findings: Findings, reward_model: bool,
                  produced: dict[str, str]) -> None:
    keys = []
    for j, spec in enumerate(stage.environments):
        entry = f"{where}.environments[{j}]"
        if set(_file_options(spec.options)) & set(produced):
            keys.append(spec.key or spec.name)  # its data is written by an earlier stage of the run
            continue
        env = _build(spec, entry, findings)
        if env is None:
            continue
        keys.append(spec.key or env.name)
        if not _difficulty(env, spec, entry, findings):
            continue
        prompts = _sample(env, spec, entry, findings)
        if prompts is None:
            continue
        if isinstance(stage, RLStage) and stage.algorithm.advantage == "maxrl" \
                and (spec.reward_type or env.reward_type) == "continuous":
            findings.problems.append((entry, f"{spec.name!r} has continuous rewards but the stage uses maxrl "
                                             "(binary rewards only; use grpo or drgrpo)"))
        if isinstance(stage, RLStage) and getattr(env, "uses_reward_model", False) and not reward_model:
            findings.problems.append((f"{entry}.name", f"{spec.name!r} scores responses with a reward model; add a "
                                                       "`reward_model` section to the recipe"))
        if isinstance(stage, SFTStage):
            _demonstrations(stage, where, env, spec, entry, prompts, tokenizer, findings)
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:  # the schema catches repeated names; this catches `module:Class` entries of one class
        findings.problems.append((f"{where}.environments", f"{repeated} are listed more than once; give each entry "
                                                           "a distinct `key`"))


def _build(spec, entry: str, findings: Findings):
    """The entry's environment built as the run builds it (zrl.prompts), or None after a finding."""
    from zrl.env import UnknownEnvironmentError
    from zrl.prompts import build_environment

    try:
        return build_environment(spec)
    except UnknownEnvironmentError as exc:
        reason = str(exc) if ":" in spec.name else unknown_environment(spec.name, exc)
        findings.problems.append((f"{entry}.name", reason))
    except FileNotFoundError as exc:  # data the recipe names may live only where it runs
        findings.missing.append((f"{entry}.options", str(exc)))
    except ValueError as exc:
        findings.problems.append((f"{entry}.options", str(exc)))
    except TypeError as exc:
        findings.problems.append((f"{entry}.name", str(exc)))
    return None


def _difficulty(env, spec, entry: str, findings: Findings) -> bool:
    """False after a finding: a difficulty set for an environment that takes none, or outside its levels."""
    if spec.difficulty is None:
        return True
    levels = env.difficulty_levels
    if levels is None:
        findings.problems.append((f"{entry}.difficulty", f"{spec.name!r} takes no difficulty level (its "
                                                         "`difficulty_levels` is None)"))
        return False
    low, high = levels
    if isinstance(spec.difficulty, int) and not low <= spec.difficulty <= high:
        findings.problems.append((f"{entry}.difficulty", f"{spec.difficulty} is outside the levels of {spec.name!r} "
                                                         f"({low}..{high})"))
        return False
    for bound in ("min_level", "max_level"):
        value = spec.curriculum.get(bound)
        if value is not None and not low <= value <= high:
            findings.problems.append((f"{entry}.curriculum.{bound}", f"{value} is outside the levels of {spec.name!r} "
                                                                     f"({low}..{high})"))
            return False
    return True


def _sample(env, spec, entry: str, findings: Findings):
    """SAMPLE_SIZE prompts drawn as the run draws them (zrl.prompts), or None after a finding."""
    from zrl.env.base import EnvironmentFault
    from zrl.prompts import checked_sample, fixed_level

    try:
        return checked_sample(env, spec.key or env.name, SAMPLE_SIZE, SAMPLE_SEED, fixed_level(spec))
    except EnvironmentFault as exc:
        findings.problems.append((entry, str(exc)))
        return None


def _demonstrations(stage: SFTStage, where: str, env, spec, entry: str, prompts, tokenizer: _Tokenizer,
                    findings: Findings) -> None:
    lengths = []
    for prompt in prompts:
        try:
            demo = env.demonstration(prompt)
        except Exception as exc:  # a plugin's demonstration may raise anything
            findings.problems.append((entry, f"{spec.name!r}: demonstration() raised {type(exc).__name__}: {exc}"))
            return
        if demo is None:
            findings.problems.append((entry, f"{spec.name!r} has no demonstrations (demonstration() returned None): "
                                             "it cannot feed an sft stage"))
            return
        if isinstance(demo, list):  # a multi-turn transcript: its messages' text is a lower bound of its tokens
            problem = transcript_problem(demo)
            if problem:
                findings.problems.append((entry, f"{spec.name!r}: demonstration(): {problem}"))
                return
            demo = "".join(m["content"] for m in demo)
        if not isinstance(demo, str):
            findings.problems.append((entry, f"{spec.name!r}: demonstration() returned a {type(demo).__name__}, "
                                             "not a str or a list of chat messages"))
            return
        lengths.append(tokenizer.count(demo))
    if lengths and None not in lengths and min(lengths) >= stage.max_sequence_tokens:
        findings.problems.append((f"{where}.max_sequence_tokens", f"{stage.max_sequence_tokens} leaves no room for "
                                  f"the prompt: {spec.name!r}'s sampled demonstrations alone take at least "
                                  f"{min(lengths)} tokens, so every example would be skipped"))
