"""The `rlve_gym` environment: reference answers score 1 and wrong or hostile output 0 without raising,
sampling is deterministic, bad options fail with one line, and a generation past its time limit is
skipped and counted (the child process is killed, the caller gets another problem)."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from environments import rlve_gym
from environments.rlve_gym import EXCLUDED, HELD_OUT, UNSAFE, RlveGym, controllers

_PATH = Path(__file__).resolve().parents[3] / "bench" / "rlve_gym_generation.py"
_spec = importlib.util.spec_from_file_location("bench_rlve_gym_generation", _PATH)
sweep = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sweep
_spec.loader.exec_module(sweep)

SAMPLE = ("Multiplication", "Sorting", "Division", "KnightsAndKnaves", "SubmatrixSumDivisibleCounting")


@pytest.fixture(scope="module")
def env():
    environment = RlveGym(environments=list(SAMPLE))
    yield environment
    environment.close()


@pytest.mark.parametrize("name", sorted(set(EXCLUDED) | HELD_OUT))
def test_named_lists_hold_only_existing_environments(name):
    assert name in controllers()


def test_all_skips_held_out_and_excluded():
    names = set(RlveGym().environments)
    skipped = HELD_OUT | set(EXCLUDED) | set(UNSAFE)
    assert len(names) == len(controllers()) - len(skipped)
    assert not names & skipped


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("name", SAMPLE)
def test_reference_answer_scores_one_and_wrong_answers_zero(env, name, level):
    reason, _ = sweep.check(env, name, level, seed=7)
    assert reason is None


def test_hostile_output_scores_zero_without_raising(env):
    prompt = env.sample(1, seed=3)[0]
    for response in ("", "</think>", "</think>   ", "no think tag at all", "</think>\n<answer>9**9**9</answer>",
                     "</think>" + "9" * 200_000, "x" * 1_000_000, "</think>\\boxed{", "</think>\x00\uffff"):
        verification = env.verify(prompt, response)
        assert verification.reward == 0.0


def _slow_score(name, config, output):
    if "slow" in output:
        time.sleep(60)  # a scorer stuck on hostile output (e.g. arithmetic on a tower of powers)
    return _real_score(name, config, output)


_real_score = rlve_gym._score


def test_scorer_timeout_scores_zero_and_is_counted(monkeypatch):
    # fork (not forkserver) so the child runs this module's patched scorer
    monkeypatch.setattr(rlve_gym, "_START_METHOD", "fork")
    monkeypatch.setattr(rlve_gym, "_score", _slow_score)
    env = RlveGym(environments=["Multiplication"], verify_time_limit_s=0.5)
    try:
        prompt = env.sample(1, seed=0)[0]
        verification = env.verify(prompt, "</think>slow")
        assert verification.reward == 0.0
        assert verification.metadata["reason"] == "scorer timeout"
        assert env.metrics()["scorer_timeouts"] == 1
        assert env.verify(prompt, f"</think>{prompt.answer}").reward == 1.0  # a fresh child scores
    finally:
        env.close()


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_scorers_that_execute_the_answer_are_refused(name):
    assert name in controllers() and name not in RlveGym().environments
    with pytest.raises(ValueError, match="sympify") as info:
        RlveGym(environments=[name])
    assert "\n" not in str(info.value)


def test_plain_format_accepts_boxed_and_rlve_markers(env):
    prompt = next(p for p in env.sample(8, seed=2) if p.data_source == "rlve_gym:Multiplication")
    for response in (f"</think>The product is \\boxed{{{prompt.answer}}}.", f"</think><answer>{prompt.answer}</answer>",
                     f"reasoning</think>\n{prompt.answer}\n"):
        assert env.verify(prompt, response).reward == 1.0
    assert env.verify(prompt, f"{prompt.answer}</think>").reward == 0.0  # an answer inside the reasoning is not one


def test_sampling_is_deterministic(env):
    first, second = env.sample(4, seed=11), env.sample(4, seed=11)
    assert [p.messages for p in first] == [p.messages for p in second]
    assert [p.messages for p in first] != [p.messages for p in env.sample(4, seed=12)]


def test_difficulty_is_the_level(env):
    prompts = env.sample(3, seed=5, difficulty=2)
    assert {p.difficulty for p in prompts} == {2}
    with pytest.raises(ValueError, match="difficulty"):
        env.sample(1, seed=5, difficulty=1.5)


def test_starting_levels_apply_without_difficulty():
    env = RlveGym(environments=["Multiplication"], levels={"Multiplication": 3})
    try:
        assert {p.difficulty for p in env.sample(2, seed=0)} == {3}
    finally:
        env.close()


def test_eval_split_is_disjoint_from_train(env):
    train = {p.messages[0].content for p in env.sample(6, seed=1)}
    held = {p.messages[0].content for p in env.sample(6, seed=1, split="eval")}
    assert not train & held


@pytest.mark.parametrize("options, field", [
    ({"environments": ["Multiplicaton"]}, "close matches: Multiplication"),
    ({"environments": []}, "environments"),
    ({"answer_format": "xml"}, "answer_format"),
    ({"levels": {"Sortin": 1}}, "levels: unknown RLVE environment 'Sortin'; close matches: Sorting"),
    ({"levels": {"Sorting": -1}}, "levels"),
    ({"generation_time_limit_s": 0}, "generation_time_limit_s"),
])
def test_bad_options_fail_with_one_line(options, field):
    with pytest.raises(ValueError, match=field) as info:
        RlveGym(**options)
    assert "\n" not in str(info.value)


def _slow_generate(name, parameter, seed):
    if name == "Sorting":
        time.sleep(60)
    return _real_generate(name, parameter, seed)


_real_generate = rlve_gym._generate


def test_generation_timeout_is_skipped_and_counted(monkeypatch):
    # fork (not forkserver) so the child runs this module's patched generator
    monkeypatch.setattr(rlve_gym, "_START_METHOD", "fork")
    monkeypatch.setattr(rlve_gym, "_generate", _slow_generate)
    env = RlveGym(environments=["Multiplication", "Sorting"], generation_time_limit_s=0.5)
    try:
        prompts = env.sample(4, seed=0)
        assert [p.data_source for p in prompts] == ["rlve_gym:Multiplication"] * 4
        assert env.metrics()["generation_timeouts"] >= 1
    finally:
        env.close()


def test_generation_failures_in_a_row_raise_one_line(monkeypatch):
    monkeypatch.setattr(rlve_gym, "_START_METHOD", "fork")
    monkeypatch.setattr(rlve_gym, "_generate", lambda name, parameter, seed: None)
    env = RlveGym(environments=["Multiplication"])
    try:
        with pytest.raises(RuntimeError, match="in a row failed"):
            env.sample(1, seed=0)
        assert env.metrics()["generation_failures"] == rlve_gym._MAX_CONSECUTIVE_FAILURES
    finally:
        env.close()


def test_wrong_answers_differ_from_the_reference():
    for reference in ("12", "0 3 1", "1.41421", "a/b"):
        assert reference not in sweep.wrong_answers(reference)


def test_a_level_mapping_restricts_the_draw_to_its_environments():
    env = RlveGym(environments=["Multiplication", "Sorting"])
    try:
        prompts = env.sample(4, seed=1, difficulty={"Sorting": 1})
        assert {(p.payload["environment"], p.difficulty) for p in prompts} == {("Sorting", 1)}
        with pytest.raises(ValueError, match=r"^difficulty: names \['Multiply'\] are not among"):
            env.sample(1, seed=1, difficulty={"Multiply": 0})
    finally:
        env.close()
