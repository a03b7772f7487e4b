"""skyrl-gym environments, run unchanged as zrl episodic environments (docs/environment-libraries.md).

Options:
- `env_class`: a skyrl-gym registered id (`gsm8k_multi_turn`, `text2sql`, ...) or a `module:Class`
  reference to a `skyrl_gym.Env` subclass, which is registered with skyrl-gym under that reference. A
  row's own `env_class` takes precedence, as in SkyRL; one of the two must name the class.
- `data`: rows in SkyRL's dataset format, `{prompt: [messages], env_class?, reward_spec: {ground_truth},
  extra_info?, data_source?}`, from a .jsonl or .parquet file or a `module:function` returning them;
  `eval_data` likewise for `split="eval"` (without it, a hash of the prompt holds ~20% of `data` out).
- `env_config`: the mapping given to every env as `env_config` (an OmegaConf config, as SkyRL passes).
- `max_turns`: policy messages per episode (the loop's limit, also handed to the env as SkyRL does).
- `reward`: `last` (the last turn's reward, what SkyRL trains on) or `sum` (the turn rewards so far,
  capped at 1).
- `allow_unsandboxed_code`: run envs that execute the policy's output (`RUNS_CODE`: `lcb`, `searchcode`,
  `text2sql`, the RLM envs, any env with skyrl-gym's Python or SQL tool) with skyrl-gym's own executors,
  on this machine, outside zrl's sandbox (zrl/sandbox.py). Default false: such an env is refused. When
  allowed, each such env is named in a warning once per process.
- `demonstration`: a format string that makes a row's reference response for an `sft` stage (e.g.
  `"#### {ground_truth}"`, or `"{extra_info[answer]}"` for SkyRL's GSM8K rows, whose solutions end with
  `#### N`): its fields are the row's `ground_truth` (of `reward_spec`) and the row's own keys but `prompt`
  and `env_class` (`extra_info`, `data_source`, ...). The demonstration is one assistant turn, the text
  after `</think>` (the chat template opens the reasoning section). Every row is formatted once when the
  environment is built, so a field a row lacks fails there, naming the row. Without it the environment has
  no demonstrations.

As in SkyRL's generator, an env gets `extras` = its row without `prompt` and `env_class`, plus
`max_turns`; it is made once per episode and closed when the episode ends; the prompt the policy sees is
what the env's `init` makes of the row's messages (drawn once at `sample`; the episode's own `init` must
give the same). A turn reward that is not a number in [0, 1] fails the episode with a line naming the env
and the value (the loop scores it 0 and keeps the error). A `postprocessed_action` is ignored: zrl trains
the tokens the policy sampled.
"""

from __future__ import annotations

import copy
import json
import logging
import numbers
import random
import threading
from collections.abc import Mapping
from pathlib import Path

import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.registration import load_env_creator

from zrl.env.base import THINK_END, in_split
from zrl.env.episode import Episode, EpisodicEnvironment, Turn
from zrl.env.registry import UnknownEnvironmentError, load_reference
from zrl.types import Message, Prompt, Split

_REGISTER = threading.Lock()  # two instances built at once (workers' draw threads) register a reference once
log = logging.getLogger("zrl")

# skyrl-gym's classes that execute the policy's output on this machine, outside zrl's sandbox, by the env or
# tool-group class an env is or derives from (`module:qualname`): what each runs, and how.
RUNS_CODE = {
    "skyrl_gym.envs.lcb.env:LCBEnv": "the policy's Python program (exec() in a child process)",
    "skyrl_gym.envs.rlm.env:BaseRLMEnv": "the policy's REPL code (exec() in the env's own process)",
    "skyrl_gym.envs.searchcode.env:SearchCodeEnv": "the policy's Python tool calls (`python -c`)",
    "skyrl_gym.envs.sql.env:SQLEnv": "the policy's SQL on the data's SQLite files",
    "skyrl_gym.tools.python:PythonCodeExecutorToolGroup": "the policy's Python tool calls (`python -c`)",
    "skyrl_gym.tools.sql:SQLCodeExecutorToolGroup": "the policy's SQL on the data's SQLite files",
}
_WARNED: set[str] = set()  # env classes allowed to run code that this process has warned about


class SkyRLGym(EpisodicEnvironment):
    name = "skyrl_gym"
    description = "skyrl-gym environments (multi-turn, tools) on SkyRL-format dataset rows"
    reward_type = "continuous"

    def __init__(self, data: str, env_class: str | None = None, eval_data: str | None = None,
                 env_config: Mapping | None = None, max_turns: int = 5, reward: str = "last",
                 allow_unsandboxed_code: bool = False, demonstration: str | None = None):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: must be an integer >= 1, got {max_turns!r}")
        if reward not in ("last", "sum"):
            raise ValueError(f"reward: must be 'last' or 'sum', got {reward!r}")
        if env_config is not None and not isinstance(env_config, Mapping):
            raise ValueError(f"env_config: must be a mapping, got {env_config!r}")
        if not isinstance(allow_unsandboxed_code, bool):
            raise ValueError(f"allow_unsandboxed_code: must be true or false, got {allow_unsandboxed_code!r}")
        if demonstration is not None and not isinstance(demonstration, str):
            raise ValueError(f"demonstration: must be a format string such as '#### {{ground_truth}}', got "
                             f"{demonstration!r}")
        self.template = demonstration
        self.max_turns, self.reward, self.allow_unsandboxed_code = max_turns, reward, allow_unsandboxed_code
        self.env_config = OmegaConf.create(dict(env_config or {}))
        self.env_class = None if env_class is None else _registered(env_class, "env_class")
        rows = self._rows(data, "data")
        if eval_data is None:
            self.pools = {split: [row for row in rows if in_split(json.dumps(row["prompt"], sort_keys=True), split)]
                          for split in ("train", "eval")}
        else:
            self.pools = {"train": rows, "eval": self._rows(eval_data, "eval_data")}
        for env_class in sorted({row["env_class"] for pool in self.pools.values() for row in pool}):
            self._check_code(env_class, skyrl_gym.registry[env_class].entry_point)
        if self.template is not None:
            for split, pool in self.pools.items():
                for index, row in enumerate(pool):
                    try:
                        self._demonstrate(_extras(row))
                    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
                        raise ValueError(f"demonstration: {self.template!r} cannot be formatted with {split} row "
                                         f"{index} ({type(exc).__name__}: {exc})") from None

    def _rows(self, source: str, option: str) -> list[dict]:
        """The rows of `source`, each checked and with its env class resolved."""
        rows = []
        for index, row in enumerate(_load_rows(source, option)):
            where = f"{option}: row {index}"
            messages = row.get("prompt") if isinstance(row, Mapping) else None
            if not (isinstance(messages, list) and messages
                    and all(isinstance(m, Mapping) and {"role", "content"} <= m.keys() for m in messages)):
                raise ValueError(f"{where} has no `prompt` list of {{role, content}} messages")
            if not row.get("env_class") and self.env_class is None:
                raise ValueError(f"{where} has no env_class and the option env_class is not set")
            env_class = _registered(row["env_class"], f"{where} env_class") if row.get("env_class") else self.env_class
            rows.append({**row, "env_class": env_class})
        return rows

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        pool = self.pools[split]
        if not pool:
            raise ValueError(f"no {split} rows in the data")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        prompts = []
        for index in range(n):
            row = rng.choice(pool)
            extras = _extras(row)
            env = self._make(row["env_class"], extras)
            try:
                messages, _ = env.init(copy.deepcopy(row["prompt"]))
            finally:
                env.close()
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{index}",
                messages=tuple(Message(m["role"], m["content"]) for m in messages),
                answer=str((row.get("reward_spec") or {}).get("ground_truth", "")),
                data_source=row.get("data_source") or row["env_class"], difficulty=difficulty,
                payload={"env_class": row["env_class"], "prompt": row["prompt"], "extras": extras}))
        return prompts

    def episode(self, prompt: Prompt) -> SkyRLEpisode:
        env_class = prompt.payload["env_class"]
        env = self._make(env_class, prompt.payload["extras"])
        messages, _ = env.init(copy.deepcopy(prompt.payload["prompt"]))
        drawn = prompt.chat()
        error = None if [{"role": m["role"], "content": m["content"]} for m in messages] == drawn else (
            f"skyrl-gym env {env_class!r}: init gave a different prompt than when it was drawn (init must be "
            "deterministic)")
        return SkyRLEpisode(env, env_class, self.reward, error)

    def demonstration(self, prompt: Prompt) -> str | None:
        """The option `demonstration` formatted with the prompt's row, after `</think>`; None without it."""
        return None if self.template is None else THINK_END + self._demonstrate(prompt.payload["extras"])

    def _demonstrate(self, extras: Mapping) -> str:
        ground_truth = (extras.get("reward_spec") or {}).get("ground_truth", "")
        return self.template.format_map({**extras, "ground_truth": ground_truth})

    def verify(self, prompt: Prompt, response: str) -> float:
        """The env's reward for `response` as the episode's only policy message."""
        episode = self.episode(prompt)
        try:
            return episode.step(response).reward
        finally:
            episode.close()

    def _make(self, env_class: str, extras: Mapping):
        env = skyrl_gym.make(env_class, env_config=self.env_config,
                             extras={**copy.deepcopy(dict(extras)), "max_turns": self.max_turns})
        for group in getattr(env, "tool_groups", None) or ():  # an env of the user's with skyrl-gym's code tools
            self._check_code(env_class, type(group))
        return env

    def _check_code(self, env_class: str, cls) -> None:
        """Refuse (or, allowed, warn once about) env `env_class` when `cls`, its env class or one of its tool
        groups' (a `module:Class` string is imported), executes the policy's output (RUNS_CODE)."""
        cls = load_env_creator(cls) if isinstance(cls, str) else cls
        runs = next((RUNS_CODE[name] for base in getattr(cls, "__mro__", ())
                     if (name := f"{base.__module__}:{base.__qualname__}") in RUNS_CODE), None)
        if runs is None:
            return
        if not self.allow_unsandboxed_code:
            raise ValueError(f"allow_unsandboxed_code: skyrl-gym env {env_class!r} runs {runs} outside zrl's "
                             "sandbox; set allow_unsandboxed_code: true to run it anyway")
        if env_class not in _WARNED:
            _WARNED.add(env_class)
            log.warning("skyrl-gym env %r runs %s on this machine, outside zrl's sandbox (allow_unsandboxed_code)",
                        env_class, runs)


class SkyRLEpisode(Episode):
    def __init__(self, env, env_class: str, reward: str, error: str | None = None):
        self.env, self.env_class, self.reward, self.error = env, env_class, reward, error
        self.total = 0.0

    def step(self, text: str) -> Turn:
        if self.error:
            raise RuntimeError(self.error)
        out = self.env.step(text)
        value = out["reward"]
        reward = float(value) if isinstance(value, numbers.Real) else None
        if reward is None or not 0.0 <= reward <= 1.0:
            raise ValueError(f"skyrl-gym env {self.env_class!r} returned reward {value!r}, not a number in [0, 1]")
        self.total += reward
        return Turn(messages=tuple(dict(m) for m in out["observations"] or ()), done=bool(out["done"]),
                    reward=reward if self.reward == "last" else min(1.0, self.total),
                    metadata=dict(out.get("metadata") or {}))

    def close(self) -> None:
        self.env.close()


def _extras(row: Mapping) -> dict:
    """What a row's env gets as `extras` (before `max_turns`): the row without `prompt` and `env_class`."""
    return {k: v for k, v in row.items() if k not in ("prompt", "env_class")}


def _registered(env_class: str, where: str) -> str:
    """`env_class` as a skyrl-gym registry id: a registered id, or a `module:Class` registered under itself."""
    with _REGISTER:
        if env_class in skyrl_gym.registry:
            return env_class
        if ":" not in str(env_class):
            raise ValueError(f"{where}: {env_class!r} is not a registered skyrl-gym environment "
                             f"({', '.join(sorted(skyrl_gym.registry))}) nor a `module:Class` reference")
        try:
            factory = load_reference(env_class)
        except UnknownEnvironmentError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not (isinstance(factory, type) and issubclass(factory, skyrl_gym.Env)):
            raise ValueError(f"{where}: {env_class!r} is not a skyrl_gym.Env subclass")
        skyrl_gym.register(id=env_class, entry_point=factory)
        return env_class


def _load_rows(source: str, option: str) -> list:
    """The rows a .jsonl/.parquet file or a `module:function` reference holds."""
    if not isinstance(source, str):
        raise ValueError(f"{option}: expected a .jsonl/.parquet path or a `module:function`, got {source!r}")
    if source.endswith((".jsonl", ".parquet")):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{option}: no file {source}")
        if source.endswith(".parquet"):
            import pyarrow.parquet

            rows = pyarrow.parquet.read_table(path).to_pylist()
        else:
            try:
                rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            except json.JSONDecodeError as exc:
                raise ValueError(f"{option}: {source}: not JSON lines ({exc})") from None
    elif ":" in source:
        try:
            rows = list(load_reference(source)())
        except UnknownEnvironmentError as exc:
            raise ValueError(f"{option}: {exc}") from None
    else:
        raise ValueError(f"{option}: {source!r} is neither a .jsonl/.parquet file nor a `module:function` reference")
    if not rows:
        raise ValueError(f"{option}: {source} holds no rows")
    return rows


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli")
_ITEMS = ("apples", "books", "coins", "shells")
_COUNT_NAMES = (*_NAMES, "Femi", "Gus", "Hana")
_COUNT_ITEMS = (*_ITEMS, "pens", "cards")


def arithmetic_rows() -> list[dict]:
    """Word problems for skyrl-gym's own `gsm8k_multi_turn` env (answer `#### N`): every sum and
    difference of 2..12 and 1..12 over fixed names and items, one row each, in a fixed order."""
    rows = []
    for a in range(2, 13):
        for b in range(1, 13):
            name, item = _NAMES[(a + b) % len(_NAMES)], _ITEMS[(a * b) % len(_ITEMS)]
            problems = [(f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b)]
            if a > b:
                problems.append((f"{name} has {a} {item} and gives away {b}. How many {item} now?", a - b))
            for question, answer in problems:
                rows.append({"data_source": "skyrl_arithmetic", "env_class": "gsm8k_multi_turn",
                             "prompt": [{"role": "user", "content": f"{question} End with #### and the number."}],
                             "reward_spec": {"method": "rule", "ground_truth": str(answer)}})
    return rows


def count_rows() -> list[dict]:
    """Questions for skyrl-gym's own `gsm8k_multi_turn` env whose answer the question states ("Ana has 7
    apples. How many apples does Ana have?"): every count 1..20 of every item for every name, one row each, in
    a fixed order (960 rows, ~190 held out by the prompt's hash). Copying the number in the `#### N` format is
    within the tiny CPU model's reach after a short warm start (recipes/tiny-skyrl-gym-cpu.yaml)."""
    return [{"data_source": "skyrl_count", "env_class": "gsm8k_multi_turn",
             "prompt": [{"role": "user", "content": f"{name} has {count} {item}. How many {item} does {name} have? "
                                                    "End with #### and the number."}],
             "reward_spec": {"method": "rule", "ground_truth": str(count)}}
            for name in _COUNT_NAMES for item in _COUNT_ITEMS for count in range(1, 21)]
