"""Held-out evaluation of several entries through one engine (`evaluate_requests`): prompts longer than
a request's limit are skipped and counted, rollouts files are written, and an entry with nothing left
to evaluate has no accuracy. The engine is a stand-in that answers every prompt with a demonstration
(or nothing), so every number below is known."""

import json
import math

import numpy as np
import pytest

import serving.engine
from environments.strings import StringTask
from zrl.assets import build_tiny_model
from zrl.config.schema import EnvironmentSpec
from zrl.evaluate import EvalRequest, evaluate_requests


class AnsweringEngine:
    """Answers prompt i's samples with the right demonstration for even i, an empty answer for odd i."""

    started: list[dict] = []

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
