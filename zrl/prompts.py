"""A stage's prompt source: the weighted mixture of its environments, deterministic and resumable.

Draw k (0, 1, 2, ...) picks an environment for each of its n prompts by the recipe weights, then asks
each chosen environment for its share with a seed derived from (stage seed, k, environment index).
The whole stream is therefore a function of the stage seed and the draw counter, which is all that a
checkpoint needs to keep (`state_dict`). Environments are built once, from the registry, with the
recipe's per-environment `options`; a bad option or unknown name is reported with the environment's
place in the recipe.

Each entry of a stage's environment list is one environment *instance* with its own key (the recipe's
`key`, else the environment's name; unique in the stage). The prompt source stamps that key on every
prompt it draws (`Prompt.env`), so whoever verifies or demonstrates a prompt finds the instance that
made it (`stage_environments`), even when one environment is listed twice with different options, and
per-environment metrics are named by it.

An entry with `difficulty: N` is drawn at level N; one with `difficulty: adaptive` at the level the
stage's curriculum hands the draw (`levels`; zrl/pipeline/stage_curriculum.py), which is stamped on its
prompts so the level a group was generated at comes back with it.

An environment whose `sample` raises or returns anything but the prompts asked for stops the stage with
an `EnvironmentFault` naming the entry's key, the call and what came back (no prompt stream can go on
without it; a retry would draw the same failing call, since `sample` is deterministic).
"""

import collections
import dataclasses
import hashlib
import inspect
import random
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment, registry
from zrl.env.base import EnvironmentFault
from zrl.types import Prompt


@dataclass(frozen=True)
class MixtureEntry:
    key: str  # the entry's name in its stage, stamped on its prompts as Prompt.env
    spec: EnvironmentSpec
    env: Environment


def build_environment(spec: EnvironmentSpec) -> Environment:
    """The entry's environment, built with the recipe's options. Errors name the environment: an
    unknown name (UnknownEnvironmentError), a factory that is not a complete Environment or makes
    something else (TypeError), a data file the options name that does not exist (FileNotFoundError), a
    constructor that rejects the options (ValueError)."""
    factory = registry.get(spec.name).factory
    if inspect.isclass(factory):
        if not issubclass(factory, Environment):
            raise TypeError(f"{spec.name!r} is not a subclass of zrl.env.Environment")
        if inspect.isabstract(factory):
            raise TypeError(f"{spec.name!r} does not implement {', '.join(sorted(factory.__abstractmethods__))}")
    try:
        env = factory(**spec.options)
    except FileNotFoundError as exc:  # a data file named by the options is not on this machine
        raise FileNotFoundError(f"{spec.name!r}: {exc}") from None
    except Exception as exc:  # a constructor rejects bad options with whatever exception it likes
        raise ValueError(f"{spec.name!r} rejected options {spec.options}: {type(exc).__name__}: {exc}") from None
    if not isinstance(env, Environment):
        raise TypeError(f"{spec.name!r} made a {type(env).__name__}, not a zrl.env.Environment")
    if not isinstance(getattr(env, "name", None), str) or not env.name:
        raise TypeError(f"{spec.name!r} has no `name` (a non-empty string)")
    return env


def build_entries(environments: list[EnvironmentSpec]) -> list[MixtureEntry]:
    """Build each environment entry of a stage, in recipe order, under its key (unique in the stage)."""
    entries = []
    for spec in environments:
        env = build_environment(spec)
        entries.append(MixtureEntry(spec.key or env.name, spec, env))
    keys = [e.key for e in entries]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:  # the schema catches repeated names; this catches `module:Class` entries of one class
        raise ValueError(f"environments {repeated} are listed more than once in the stage; give each entry a "
                         "distinct `key`")
    return entries


def stage_environments(environments: list[EnvironmentSpec]) -> dict[str, Environment]:
    """Key -> environment instance of a stage: what verifies (and demonstrates) the prompts it made."""
    return {e.key: e.env for e in build_entries(environments)}


def checked_sample(env: Environment, key: str, n: int, seed: int,
                   difficulty: int | Mapping[str, int] | None = None) -> list[Prompt]:
    """`env.sample(n, seed, difficulty=difficulty)`, checked: exactly `n` Prompt objects, else an
    `EnvironmentFault` naming the entry `key` and what came back (a stage cannot go on without prompts)."""
    level = "" if difficulty is None else f", difficulty={difficulty}"
    call = f"environment {key!r}: sample({n}, seed={seed}{level})"
    try:
        prompts = env.sample(n, seed=seed, difficulty=difficulty)
    except Exception as exc:  # a plugin's bug: one line naming it, the traceback kept as the cause
        raise EnvironmentFault(f"{call} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(prompts, (list, tuple)):
        raise EnvironmentFault(f"{call} returned {reprlib.repr(prompts)} ({type(prompts).__name__}), "
                               "not a list of prompts")
    if len(prompts) != n:
        raise EnvironmentFault(f"{call} returned {len(prompts)} prompts")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, Prompt):
            raise EnvironmentFault(f"{call} returned {reprlib.repr(prompt)} ({type(prompt).__name__}) at "
                                   f"index {index}, not a zrl.types.Prompt")
    return list(prompts)


def fixed_level(spec: EnvironmentSpec) -> int | None:
    """The level a recipe entry draws every prompt at (`difficulty: N`), or None."""
    return spec.difficulty if isinstance(spec.difficulty, int) else None


Assignment = int | list[tuple[str, int]]  # an adaptive entry's level for a draw, or its (task, level) proposals


def _derived_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


class PromptSource:
    def __init__(self, environments: list[EnvironmentSpec], seed: int):
        self.entries = build_entries(environments)
        self.seed = seed
        self.draws = 0

    def next_prompts(self, n: int, levels: Mapping[str, Assignment] | None = None) -> list[Prompt]:
        """The next `n` prompts of the stream (one draw), each stamped with its entry's key."""
        return [prompt for prompt, _ in self.draw(n, levels)]

    def draw(self, n: int, levels: Mapping[str, Assignment] | None = None) -> list[tuple[Prompt, tuple[str, int] | None]]:
        """The next `n` prompts (one draw), each with the (scheduler key, level) it was drawn at when its
        entry is adaptive. `levels`, by adaptive entry key: its level for this draw, or for an entry with
        curriculum tasks a list of (task, level) proposals, used in order (scheduler key `<key>/<task>`);
        the level is stamped as `Prompt.difficulty`. An adaptive entry missing from `levels` is drawn at
        the environment's default."""
        rng = random.Random(_derived_seed(self.seed, self.draws, "mixture"))
        weights = [e.spec.weight for e in self.entries]
        picks = rng.choices(range(len(self.entries)), weights=weights, k=n)
        drawn = {}
        for i in sorted(set(picks)):
            entry, count = self.entries[i], picks.count(i)
            level = (levels or {}).get(entry.key) if entry.spec.difficulty == "adaptive" else None
            seed = _derived_seed(self.seed, self.draws, i)
            if level is None:
                prompts = checked_sample(entry.env, entry.key, count, seed, fixed_level(entry.spec))
                drawn[i] = iter([(dataclasses.replace(p, env=entry.key), None) for p in prompts])
            elif isinstance(level, int):
                prompts = checked_sample(entry.env, entry.key, count, seed, level)
                drawn[i] = iter([(dataclasses.replace(p, env=entry.key, difficulty=level), (entry.key, level))
                                 for p in prompts])
            else:
                drawn[i] = iter(self._draw_tasks(entry, level[:count], seed))
        self.draws += 1
        return [next(drawn[i]) for i in picks]

    def _draw_tasks(self, entry: MixtureEntry, proposals: list[tuple[str, int]], seed: int):
        """One prompt per (task, level) proposal, in order: one `sample` call per distinct proposal."""
        counts = collections.Counter(proposals)
        made = {(task, level): iter(checked_sample(entry.env, entry.key, k, _derived_seed(seed, task, level),
                                                   {task: level}))
                for (task, level), k in counts.items()}
        return [(dataclasses.replace(next(made[p]), env=entry.key, difficulty=p[1]), (f"{entry.key}/{p[0]}", p[1]))
                for p in proposals]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"prompt-source state was saved with seed {state['seed']}, this stage uses {self.seed}")
        self.draws = state["draws"]
