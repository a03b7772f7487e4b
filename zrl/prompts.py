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
"""

import dataclasses
import hashlib
import random
from dataclasses import dataclass

from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment, registry
from zrl.types import Prompt


@dataclass(frozen=True)
class MixtureEntry:
    key: str  # the entry's name in its stage, stamped on its prompts as Prompt.env
    spec: EnvironmentSpec
    env: Environment


def build_environment(spec: EnvironmentSpec) -> Environment:
    info = registry.get(spec.name)
    try:
        env = info.factory(**spec.options)
    except TypeError as exc:  # unknown or missing constructor options: the user's recipe
        raise ValueError(f"environment {spec.name!r}: bad options {spec.options}: {exc}") from None
    if not isinstance(env, Environment):
        raise TypeError(f"environment {spec.name!r} ({info.factory!r}) is not a zrl.env.Environment")
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


def _derived_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


class PromptSource:
    def __init__(self, environments: list[EnvironmentSpec], seed: int):
        self.entries = build_entries(environments)
        self.seed = seed
        self.draws = 0

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next `n` prompts of the stream (one draw), each stamped with its entry's key."""
        rng = random.Random(_derived_seed(self.seed, self.draws, "mixture"))
        weights = [e.spec.weight for e in self.entries]
        picks = rng.choices(range(len(self.entries)), weights=weights, k=n)
        per_env = {i: picks.count(i) for i in sorted(set(picks))}
        drawn = {i: iter(self.entries[i].env.sample(count, seed=_derived_seed(self.seed, self.draws, i)))
                 for i, count in per_env.items()}
        self.draws += 1
        return [dataclasses.replace(next(drawn[i]), env=self.entries[i].key) for i in picks]

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"prompt-source state was saved with seed {state['seed']}, this stage uses {self.seed}")
        self.draws = state["draws"]
