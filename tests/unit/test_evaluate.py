"""Held-out evaluation of several entries through one engine (`evaluate_requests`): prompts longer than
a request's limit are skipped and counted, rollouts files are written, and an entry with nothing left
to evaluate has no accuracy. Several checkpoints of one model share the engine too (`evaluate_checkpoints`),
and checkpoints of different models are refused. The engine is a stand-in that answers every prompt with a demonstration
(or nothing), so every number below is known. pass@k (the Codex paper's estimator) and avg@k by hand."""

import json
import math

import numpy as np
import pytest

import serving.engine
from environments.strings import StringTask
from zrl.assets import build_tiny_model
from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment
from zrl.evaluate import EvalRequest, evaluate_checkpoints, evaluate_requests, pass_at_k, score
from zrl.types import Message, Prompt


class AnsweringEngine:
    """Answers prompt i's samples with the right demonstration for even i, an empty answer for odd i."""

    started: list[dict] = []
    loaded: list[tuple[str, int]] = []  # update_weights calls

    def __init__(self, checkpoint, dtype, max_model_len, seed):
        AnsweringEngine.started.append({"max_model_len": max_model_len})
        self.answers: list[str] = []

    def generate(self, prompts, num_samples, sampling):
        out = []
        for i, ids in enumerate(prompts):
            text = self.answers.pop(0)
            sample = serving.engine.SampleOutput(np.asarray(ids), np.arange(3), np.zeros(3, np.float32),
                                                 np.zeros((len(ids) + 3, 1), np.uint8), "stop", (), text)
            out.append([sample] * num_samples)
        return out

    def update_weights(self, path, version):
        AnsweringEngine.loaded.append((str(path), version))
        return serving.engine.WeightUpdateStats(version=version, seconds=0.0, num_bytes=0)

    def close(self):
        pass


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("evaluate") / "model")


def test_entries_share_one_engine_long_prompts_are_skipped_and_rollouts_written(model_path, tmp_path, monkeypatch):
    env, spec = StringTask(), EnvironmentSpec(name="strings")
    answers = [env.demonstration(p) if i % 2 == 0 else "" for i, p in enumerate(env.sample(4, seed=0, split="eval"))]
    answers += [env.demonstration(p) for p in env.sample(3, seed=0, split="train")]

    def engine(*args, **kwargs):
        e = AnsweringEngine(*args, **kwargs)
        e.answers = list(answers)
        return e
    AnsweringEngine.started.clear()
    monkeypatch.setattr(serving.engine, "RolloutEngine", engine)
    rollouts = tmp_path / "r" / "self.jsonl"
    held_out, train, too_long = evaluate_requests(model_path, [
        EvalRequest(spec, num_prompts=4, samples_per_prompt=2, max_response_tokens=16),
        EvalRequest(spec, num_prompts=3, samples_per_prompt=2, max_response_tokens=8, split="train",
                    save_rollouts=str(rollouts)),
        EvalRequest(spec, num_prompts=2, max_prompt_tokens=4)])
    assert len(AnsweringEngine.started) == 1
    assert (held_out.accuracy, held_out.num_prompts, held_out.skipped_long_prompts) == (0.5, 4, 0)
    assert (train.accuracy, train.num_prompts) == (1.0, 3)
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert [r["rewards"] for r in rows] == [[1.0, 1.0]] * 3 and rows[0]["prompt"]["data_source"] == "strings:copy"
    assert too_long.num_prompts == 0 and too_long.skipped_long_prompts == 2 and math.isnan(too_long.accuracy)


def test_checkpoints_of_one_model_share_one_engine_and_other_models_are_refused(model_path, tmp_path, monkeypatch):
    """The engine starts on the first checkpoint; each next one is loaded in place under the next version
    and gets the same prompts; each result names its checkpoint. A checkpoint of another configuration is
    refused before any engine starts, naming the first field that differs."""
    env, spec = StringTask(), EnvironmentSpec(name="strings")
    prompts = env.sample(2, seed=0, split="eval")
    answers = [env.demonstration(p) for p in prompts] + ["", env.demonstration(prompts[1])]

    def engine(*args, **kwargs):
        e = AnsweringEngine(*args, **kwargs)
        e.answers = answers
        return e
    AnsweringEngine.started.clear()
    AnsweringEngine.loaded.clear()
    monkeypatch.setattr(serving.engine, "RolloutEngine", engine)
    second = tmp_path / "second"
    second.mkdir()
    config = json.loads((model_path / "config.json").read_text())
    (second / "config.json").write_text(json.dumps(dict(config, _name_or_path="elsewhere")))  # written differently
    [[first_result], [second_result]] = evaluate_checkpoints([model_path, second], [EvalRequest(spec, num_prompts=2)])
    assert len(AnsweringEngine.started) == 1 and AnsweringEngine.loaded == [(str(second), 1)]
    assert (first_result.checkpoint, first_result.accuracy) == (str(model_path), 1.0)
    assert (second_result.checkpoint, second_result.accuracy) == (str(second), 0.5)

    (second / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 64)))
    AnsweringEngine.started.clear()
    with pytest.raises(ValueError, match=r"checkpoints: .*second is not the model of .* \(vocab_size: "
                                         r"\d+ vs \d+\); evaluate them in separate commands"):
        evaluate_checkpoints([model_path, second], [EvalRequest(spec, num_prompts=2)])
    assert AnsweringEngine.started == []


def test_pass_at_k_is_the_unbiased_estimator_of_the_codex_paper():
    assert (pass_at_k(1, 1, 1), pass_at_k(1, 0, 1)) == (1.0, 0.0)  # k = 1: the one sample's correctness
    assert (pass_at_k(4, 4, 1), pass_at_k(4, 4, 4)) == (1.0, 1.0)  # all correct
    assert (pass_at_k(4, 0, 1), pass_at_k(4, 0, 4)) == (0.0, 0.0)  # none correct
    assert (pass_at_k(4, 1, 1), pass_at_k(4, 1, 4)) == (0.25, 1.0)  # pass@1 the fraction, pass@n whether any
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    for n, c, k in ((2, 1, 3), (2, 3, 1), (2, 1, 0)):
        with pytest.raises(ValueError, match=f"pass@k: needs .* got n={n}, c={c}, k={k}"):
            pass_at_k(n, c, k)


class TextReward(Environment):
    """A continuous environment whose reward is the response itself ("0.5" scores 0.5)."""

    name, reward_type = "text_reward", "continuous"

    def sample(self, n, seed, split="train", difficulty=None):
        return [Prompt(env=self.name, prompt_id=str(i), messages=(Message("user", "?"),), answer="",
                       data_source=self.name) for i in range(n)]

    def verify(self, prompt, response):
        return float(response)


def outputs(*groups):
    return [[serving.engine.SampleOutput(np.arange(2), np.arange(3), np.zeros(3, np.float32),
                                         np.zeros((5, 1), np.uint8), "stop", (), text) for text in group]
            for group in groups]


def test_avg_at_k_counts_partial_rewards_and_pass_at_k_only_full_ones():
    env = TextReward()
    request = EvalRequest(EnvironmentSpec(name="text_reward"), num_prompts=3, samples_per_prompt=4)
    result = score("c", env, request, env.sample(3, seed=0), outputs(("1", "0", "0.5", "0"),  # one correct
                                                                     ("0.5", "0.5", "0.5", "0.5"),  # partial only
                                                                     ("1", "1", "1", "1")), skipped=0)
    assert result.samples_per_prompt == 4
    assert result.avg_at_k == pytest.approx((0.375 + 0.5 + 1.0) / 3) == pytest.approx(result.accuracy)
    assert result.pass_at_1 == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert result.pass_at_k == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    one = score("c", env, EvalRequest(request.environment, samples_per_prompt=1), env.sample(2, seed=0),
                outputs(("1",), ("0.5",)), skipped=0)
    assert (one.avg_at_k, one.pass_at_1, one.pass_at_k) == (0.75, 0.5, 0.5)  # k = 1: pass@1 = pass@k
    none = score("c", env, request, [], [], skipped=2)
    assert all(math.isnan(v) for v in (none.avg_at_k, none.pass_at_1, none.pass_at_k))
