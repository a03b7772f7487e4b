"""The skyrl-gym adapter (environments/skyrl_gym_env.py): its options, its draws, episodes of skyrl-gym's own
`gsm8k_multi_turn` env by hand and in the episode loop, a `module:Class` env, rewards outside [0, 1], and
the refusal of envs that run the policy's code outside zrl's sandbox unless `allow_unsandboxed_code`, and the
`demonstration` option that feeds an sft stage."""

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import pytest
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv
from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv
from skyrl_gym.envs.lcb.env import LCBEnv
from skyrl_gym.tools import PythonCodeExecutorToolGroup

from environments import skyrl_gym_env
from environments.skyrl_gym_env import SkyRLGym, arithmetic_rows, count_rows
from zrl.env.episode import Episode, Turn
from zrl.types import Message

ROWS = "environments.skyrl_gym_env:arithmetic_rows"
SCRIPTED = f"{__name__}:ScriptedEnv"
FEEDBACK = ("Please provide your step-by-step reasoning, and also include a tentative numeric answer at the end in the "
            "exact format: '#### ANSWER'.",  # gsm8k_multi_turn's replies: more than one turn left, the last turn left
            "Now provide only the final numeric answer in the exact format: '#### ANSWER'.")

# The episode loop's stand-in engine and driver, shared with its own tests.
_spec = importlib.util.spec_from_file_location("episode_loop_tests",
                                               Path(__file__).parents[1] / "pipeline" / "test_episodes.py")
_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_loop)


class ScriptedEnv(BaseTextEnv):
    """A library env written against skyrl-gym alone: turn k's reward is the row's ground_truth[k]; its init
    puts a system message before the prompt."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.env_config, self.max_turns = env_config, extras["max_turns"]
        self.rewards = extras["reward_spec"]["ground_truth"]

    def init(self, prompt):
        return [{"role": "system", "content": "Be brief."}, *prompt], {}

    def step(self, action):
        self.turns += 1
        done = self.turns == len(self.rewards)
        return {"observations": [] if done else [{"role": "user", "content": f"heard {action}"}],
                "reward": self.rewards[self.turns - 1], "done": done, "metadata": {"turn": self.turns}}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def scripted_row(rewards, text="q"):
    return {"prompt": [{"role": "user", "content": text}], "env_class": SCRIPTED,
            "reward_spec": {"ground_truth": rewards}}


@pytest.fixture
def closes(monkeypatch):
    """Counts the closes of gsm8k_multi_turn envs."""
    calls = []
    monkeypatch.setattr(GSM8kMultiTurnEnv, "close", lambda self: calls.append(self))
    return calls


@pytest.mark.parametrize("options, error", [
    ({"max_turns": 0}, r"^max_turns: must be an integer >= 1, got 0"),
    ({"reward": "mean"}, r"^reward: must be 'last' or 'sum', got 'mean'"),
    ({"env_config": [1]}, r"^env_config: must be a mapping"),
    ({"env_class": "gsm9k"}, r"^env_class: 'gsm9k' is not a registered skyrl-gym environment \(aime, gsm8k, "),
    ({"env_class": "no_such_module:Env"}, r"^env_class: 'no_such_module:Env': cannot import"),
    ({"env_class": "environments.skyrl_gym_env:SkyRLGym"}, r"^env_class: .* is not a skyrl_gym.Env subclass"),
    ({"data": "rows.csv"}, r"^data: 'rows.csv' is neither a .jsonl/.parquet file nor a `module:function`"),
    ({"data": "environments.skyrl_gym_env:no_rows"}, r"^data: .* has no attribute 'no_rows'"),
    ({"demonstration": ["#### {ground_truth}"]}, r"^demonstration: must be a format string"),
    ({"demonstration": "{answer}"}, r"^demonstration: '\{answer\}' cannot be formatted with train row 0 \(KeyError"),
])
def test_bad_options_fail_in_one_line_naming_the_option(options, error):
    with pytest.raises(ValueError, match=error):
        SkyRLGym(**{"data": ROWS, **options})


def test_bad_data_files_and_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^data: no file .*absent.jsonl"):  # preflight: absent here
        SkyRLGym(data=str(tmp_path / "absent.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    with pytest.raises(ValueError, match=r"^eval_data: .*broken.jsonl: not JSON lines"):
        SkyRLGym(data=ROWS, eval_data=str(tmp_path / "broken.jsonl"))
    for row, error in [({"prompt": "q"}, r"^data: row 1 has no `prompt` list of \{role, content\} messages"),
                       ({"prompt": [{"role": "user", "content": "q"}]}, r"^data: row 1 has no env_class and the "
                                                                         r"option env_class is not set"),
                       ({**scripted_row([1.0]), "env_class": "nope"}, r"^data: row 1 env_class: 'nope' is not")]:
        with pytest.raises(ValueError, match=error):
            SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", [scripted_row([1.0]), row]))


def test_draws_are_deterministic_and_the_splits_disjoint(tmp_path):
    env = SkyRLGym(data=ROWS, env_class="gsm8k_multi_turn")
    first = env.sample(16, seed=3)
    assert first == env.sample(16, seed=3) == SkyRLGym(data=ROWS).sample(16, seed=3)
    assert [p.prompt_id for p in first] == [f"skyrl_gym:train:3:{i}" for i in range(16)]
    assert [p.messages for p in first] != [p.messages for p in env.sample(16, seed=4)]
    every = {(Message("user", row["prompt"][0]["content"]),) for row in arithmetic_rows()}
    train = {p.messages for p in env.sample(2000, seed=0)}
    held_out = {p.messages for p in env.sample(2000, seed=0, split="eval")}
    assert not train & held_out and train | held_out == every and len(held_out) < len(train)
    # eval_data: the eval split is exactly those rows, the train split all of data.
    eval_rows = [dict(row, prompt=[{"role": "user", "content": f"held out {i}"}])
                 for i, row in enumerate(arithmetic_rows()[:3])]
    env = SkyRLGym(data=ROWS, eval_data=write_rows(tmp_path / "eval.jsonl", eval_rows))
    assert {p.messages[0].content for p in env.sample(30, seed=1, split="eval")} == {f"held out {i}" for i in range(3)}
    assert {p.messages for p in env.sample(2000, seed=0)} == every


def test_demonstrations_are_the_option_formatted_with_the_row_after_think_end(tmp_path):
    env = SkyRLGym(data="environments.skyrl_gym_env:count_rows", demonstration="#### {ground_truth}")
    for prompt in env.sample(8, seed=0):
        count = prompt.messages[0].content.split()[2]  # "<name> has <count> <items>. ..."
        assert prompt.answer == count and env.demonstration(prompt) == f"</think>#### {count}"
        assert env.verify(prompt, env.demonstration(prompt)) == 1.0  # what the env itself scores right
    assert SkyRLGym(data=ROWS).demonstration(env.sample(1, seed=0)[0]) is None  # no option: no demonstrations
    # The row's own keys are fields too (SkyRL's GSM8K rows carry the worked solution in extra_info).
    rows = [{**scripted_row([1.0]), "extra_info": {"answer": "2 + 2 = 4\n#### 4"}}]
    env = SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", rows), demonstration="{extra_info[answer]}")
    assert env.demonstration(env.sample(1, seed=0)[0]) == "</think>2 + 2 = 4\n#### 4"
    with pytest.raises(ValueError, match=r"^demonstration: '\{extra_info\[solution\]\}' cannot be formatted with "
                                         r"train row 0 \(KeyError: 'solution'\)"):
        SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", rows), demonstration="{extra_info[solution]}")


def test_count_rows_state_their_answer_and_hold_out_enough_questions():
    rows = count_rows()
    assert len({row["prompt"][0]["content"] for row in rows}) == len(rows) == 960
    for row in rows:
        question, answer = row["prompt"][0]["content"], row["reward_spec"]["ground_truth"]
        assert f" has {answer} " in question and question.endswith("End with #### and the number.")
    env = SkyRLGym(data="environments.skyrl_gym_env:count_rows")
    assert len(env.pools["eval"]) >= 150 and {row["env_class"] for row in rows} == {"gsm8k_multi_turn"}


def test_parquet_and_jsonl_files_give_the_rows_a_function_gives(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = arithmetic_rows()
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet")
    drawn = SkyRLGym(data=ROWS).sample(32, seed=2)
    assert SkyRLGym(data=str(tmp_path / "rows.parquet")).sample(32, seed=2) == drawn
    assert SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", rows)).sample(32, seed=2) == drawn


def test_an_episode_of_skyrl_gyms_own_env_by_hand(closes):
    env = SkyRLGym(data=ROWS, max_turns=3)
    prompt = env.sample(1, seed=0)[0]
    assert len(closes) == 1  # the env that made the prompt (its init) is closed
    row = next(r for r in arithmetic_rows() if r["prompt"] == prompt.chat())
    assert prompt.answer == row["reward_spec"]["ground_truth"] and prompt.data_source == "skyrl_arithmetic"
    wrong = str(int(prompt.answer) + 1)
    episode = env.episode(prompt)
    first = episode.step("I am not sure.")
    assert (first.done, first.reward) == (False, 0.0)
    assert first.messages == ({"role": "user", "content": FEEDBACK[0]},)
    second = episode.step(f"#### {wrong}")  # well formed, wrong: the env's format score, 0.2 / max_turns
    assert (second.done, second.reward) == (False, pytest.approx(0.2 / 3))
    assert second.messages == ({"role": "user", "content": FEEDBACK[1]},)
    last = episode.step(f"So: #### {prompt.answer}")
    assert (last.done, last.reward, last.messages) == (True, 1.0, ())
    episode.close()
    assert len(closes) == 2 and closes[-1] is episode.env
    # reward: sum adds the turn rewards, capped at 1.
    env = SkyRLGym(data=ROWS, max_turns=3, reward="sum")
    episode = env.episode(prompt)
    rewards = [episode.step(text).reward for text in (f"#### {wrong}", f"#### {wrong}", f"#### {prompt.answer}")]
    assert rewards == [pytest.approx(0.2 / 3), pytest.approx(0.4 / 3), 1.0]
    assert env.verify(prompt, f"#### {prompt.answer}") == 1.0 and env.verify(prompt, "no idea") == 0.0


def test_a_module_class_env_its_init_its_config_and_its_rewards(tmp_path, monkeypatch):
    data = write_rows(tmp_path / "rows.jsonl", [scripted_row([0.25, 1.0])])
    env = SkyRLGym(data=data, env_config={"db_path": "x.db"})
    assert skyrl_gym.registry[SCRIPTED].entry_point is ScriptedEnv
    SkyRLGym(data=data, env_class=SCRIPTED)  # registered once, found the second time
    prompt = env.sample(1, seed=0)[0]
    assert prompt.chat() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]
    assert prompt.data_source == SCRIPTED and prompt.answer == "[0.25, 1.0]"
    episode = env.episode(prompt)
    assert episode.env.env_config.db_path == "x.db" and episode.env.max_turns == 5
    assert episode.step("a") == Turn(messages=({"role": "user", "content": "heard a"},), reward=0.25,
                                           metadata={"turn": 1})
    assert episode.step("b").done
    # The episode's init must give the prompt that was drawn; otherwise its first step fails (the loop scores 0).
    monkeypatch.setattr(ScriptedEnv, "init", lambda self, prompt: ([{"role": "system", "content": "Be verbose."},
                                                                    *prompt], {}))
    with pytest.raises(RuntimeError, match=f"{SCRIPTED!r}: init gave a different prompt than when it was drawn"):
        env.episode(prompt).step("a")


@pytest.mark.parametrize("reward", [1.5, -0.1, float("nan"), "1", None])
def test_a_reward_outside_0_1_fails_the_episode_naming_the_env_and_value(tmp_path, reward):
    env = SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", [scripted_row([0.5, reward])]))
    episode = env.episode(env.sample(1, seed=0)[0])
    episode.step("a")
    with pytest.raises(ValueError) as caught:
        episode.step("b")
    assert str(caught.value) == f"skyrl-gym env {SCRIPTED!r} returned reward {reward!r}, not a number in [0, 1]"


class SpeakingEngine(_loop.StandInEngine):
    """The stand-in engine, its k-th request answered with `texts[k]` (4 tokens)."""

    def __init__(self, texts):
        super().__init__([4] * len(texts))
        self.texts = texts

    def _finish(self, k):
        sample = super()._finish(k)
        return dataclasses.replace(sample, output=dataclasses.replace(sample.output, text=self.texts[k]))


class Counted(Episode):
    """An episode as the loop's driver checks it (`closed`)."""

    def __init__(self, episode):
        self.episode, self.closed = episode, 0

    def step(self, text):
        return self.episode.step(text)

    def close(self):
        self.closed += 1
        self.episode.close()


def test_the_episode_loop_runs_skyrl_gyms_env(closes, tmp_path):
    env = SkyRLGym(data=ROWS, max_turns=3)
    prompt = env.sample(1, seed=5)[0]
    wrong = str(int(prompt.answer) + 1)
    engine = SpeakingEngine(["Let me think.", f"#### {wrong}", f"#### {prompt.answer}"])
    out = _loop.run(engine, Counted(env.episode(prompt)), max_turns=env.max_turns, max_response_tokens=60)
    assert (out.end_reason, out.reward, out.turns) == ("done", 1.0, 3) and len(closes) == 2
    feedback = [len(_loop.render([{"content": text}])) for text in FEEDBACK]
    assert out.rollout.policy_mask.tolist() == ([True] * 4 + [False] * feedback[0] + [True] * 4
                                                + [False] * feedback[1] + [True] * 4)
    assert "final numeric answer" in out.rollout.text
    # A reward outside [0, 1] is the environment's failure: the episode scores 0 and keeps the line.
    env = SkyRLGym(data=write_rows(tmp_path / "rows.jsonl", [scripted_row([0.5, 2.0])]))
    out = _loop.run(SpeakingEngine(["a", "b"]), Counted(env.episode(env.sample(1, seed=0)[0])))
    assert (out.end_reason, out.reward, out.turns) == ("env_error", 0.0, 2)
    assert out.error == f"ValueError: skyrl-gym env {SCRIPTED!r} returned reward 2.0, not a number in [0, 1]"


class LeetCode(LCBEnv):
    """A user's env built on one that runs the policy's code."""


class WithPythonTool(BaseTextEnv):
    """A user's env with skyrl-gym's Python tool (it runs `python -c` on the policy's code)."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.init_tool_groups([PythonCodeExecutorToolGroup()])


def untyped_rows(tmp_path) -> str:
    """One row without an env class (the option names it)."""
    return write_rows(tmp_path / "rows.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                                 "reward_spec": {"ground_truth": "[]"}}])


@pytest.mark.parametrize("env_class, runs", [
    ("lcb", "the policy's Python program"), ("searchcode", "the policy's Python tool calls"),
    ("text2sql", "the policy's SQL"), ("skyrl_gym.envs.rlm.env:BaseRLMEnv", "the policy's REPL code"),
    (f"{__name__}:LeetCode", "the policy's Python program")])
def test_an_env_that_runs_the_policys_code_outside_the_sandbox_is_refused_unless_allowed(
        env_class, runs, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(skyrl_gym_env, "_WARNED", set())
    with pytest.raises(ValueError, match=f"^allow_unsandboxed_code: skyrl-gym env '{env_class}' runs {runs}"):
        SkyRLGym(data=untyped_rows(tmp_path), env_class=env_class)
    with caplog.at_level(logging.WARNING, logger="zrl"):
        for _ in range(2):
            SkyRLGym(data=untyped_rows(tmp_path), env_class=env_class, allow_unsandboxed_code=True)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "zrl"]  # once per process
    assert warning.startswith(f"skyrl-gym env '{env_class}' runs {runs}") and "outside zrl's sandbox" in warning


def test_an_env_with_skyrl_gyms_python_tool_is_refused_when_it_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(skyrl_gym_env, "_WARNED", set())
    env = SkyRLGym(data=untyped_rows(tmp_path), env_class=f"{__name__}:WithPythonTool")
    with pytest.raises(ValueError, match="^allow_unsandboxed_code: .* runs the policy's Python tool calls"):
        env.sample(1, seed=0)
    allowed = SkyRLGym(data=untyped_rows(tmp_path), env_class=f"{__name__}:WithPythonTool", allow_unsandboxed_code=True)
    assert len(allowed.sample(1, seed=0)) == 1
    with pytest.raises(ValueError, match="^allow_unsandboxed_code: must be true or false, got 'yes'"):
        SkyRLGym(data=ROWS, allow_unsandboxed_code="yes")
