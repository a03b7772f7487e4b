"""RolloutWorker.evaluate on a stand-in engine: the held-out prompts share the engine with a round's groups
in flight; the round's samples that finish meanwhile are kept for the next round, the evaluation is
scored per entry under the recipe's entry key (here a `module:Class` reference), with the engine's version.
A multi-turn environment's held-out prompts run as episodes on the same engine, scored by the episodes."""

import itertools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from zrl.config import parse_recipe
from zrl.env import Environment
from zrl.env.episode import Episode, EpisodicEnvironment, Turn
from zrl.env.episodes import EpisodeRunner
from zrl.env.errors import EnvErrorLog
from zrl.pipeline.held_out import held_out_requests
from zrl.pipeline.rollout_worker import RolloutWorker, _Open
from zrl.types import Message, Prompt


class Parity(Environment):
    """Prompt i asks for i; the stand-in engine answers correctly for even i."""

    name = "parity"
    reward_type = "binary"

    def sample(self, n, seed, split="train", difficulty=None):
        return [Prompt(env=self.name, prompt_id=f"{split}:{i}", messages=(Message("user", str(i)),), answer=str(i),
                       data_source=self.name) for i in range(n)]

    def verify(self, prompt, response):
        return float(response == prompt.answer)


class Tokenizer:
    def apply_chat_template(self, chat, add_generation_prompt, tokenize):
        return chat[-1]["content"]

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [int(text)]}


class Engine:
    """Finishes two queued samples per step, in submission order."""

    version = 6
    tokenizer = Tokenizer()
    max_model_len = 64

    def __init__(self):
        self.queue, self.groups = [], itertools.count(100)

    def has_unfinished(self):
        return bool(self.queue)

    def submit(self, ids, n, sampling, seed=None):
        group = next(self.groups)
        self.queue += [(group, i, str(ids[0]) if ids[0] % 2 == 0 else "?") for i in range(n)]
        return group

    def step(self):
        done, self.queue = self.queue[:2], self.queue[2:]
        return [SimpleNamespace(group_id=g, sample_index=i, output=output(text)) for g, i, text in done]


def output(text):
    tokens = np.arange(3, dtype=np.int64)
    return SimpleNamespace(prompt_ids=tokens, token_ids=tokens, logprobs=np.zeros(3, np.float32), routing=None,
                           version_segments=(SimpleNamespace(start=0, version=5),), finish_reason="stop", text=text)


def stage_of(env_class):
    return parse_recipe({"name": "r", "model": {"path": "m"}, "output_dir": "o", "stages": [{
        "name": "rl", "kind": "rl", "steps": 4, "environments": [{"name": f"{__name__}:{env_class}"}],
        "sampling": {"group_size": 2, "max_prompt_tokens": 8, "max_response_tokens": 8},
        "evaluation": {"prompts": 4, "samples": 2, "max_response_tokens": 8, "every_steps": 2}}]}).stages[0]


def stand_in_worker(stage, engine, episodes=False):
    worker = RolloutWorker.__new__(RolloutWorker)  # no vLLM: a stand-in engine
    worker.stage, worker.group_size, worker.engine = stage, 2, engine
    worker._open, worker._finished, worker._eval_envs, worker._engine_groups, worker._evaluated = {}, [], {}, {}, {}
    worker._eval_errors, worker._drawer, worker._drawing = EnvErrorLog(), None, deque()
    worker._episodes = EpisodeRunner(engine, lambda messages, last: [9]) if episodes else None
    return worker


def test_evaluation_shares_the_engine_with_a_rounds_groups():
    stage = stage_of("Parity")
    worker = stand_in_worker(stage, Engine())
    prompt = Parity().sample(1, 0)[0]
    worker._open["w0-d0.0-train:0"] = _Open("w0-d0.0-train:0", prompt, 2)  # a round's group, both samples in flight
    worker._engine_groups[7] = "w0-d0.0-train:0"
    worker.engine.queue = [(7, 0, "0"), (7, 1, "x")]

    report = worker.evaluate(held_out_requests(stage), seed=0)

    assert report.policy_version == 6
    [(key, result)] = report.results
    assert key == f"{__name__}:Parity"                               # the recipe's key, as at the stage's end
    assert (result.num_prompts, result.accuracy) == (4, 0.5)        # prompts 0 and 2 of 0..3 answered
    [(group, _)] = worker._finished                                  # finished meanwhile: reported next round
    assert group.group_id == "w0-d0.0-train:0" and [r.text for r in group.rollouts] == ["0", "x"]
    assert worker._open == {} and worker._engine_groups == {} and worker.engine.queue == []


class LoadingEngine(Engine):
    """Also drops what is in flight and loads weights from a checkpoint directory (no vLLM LoRA)."""

    serves_adapters = False

    def abort_all(self):
        self.queue = []

    def update_weights(self, weights, version=None):
        self.loaded, self.version = weights, version


def test_the_export_is_evaluated_after_the_stream_stops_and_the_export_is_loaded():
    stage = stage_of("Parity")
    worker = stand_in_worker(stage, LoadingEngine())
    worker._drawer = ThreadPoolExecutor(1)
    prompt = Parity().sample(1, 0)[0]
    worker._open["w0-d0.0-train:0"] = _Open("w0-d0.0-train:0", prompt, 2)  # a round's group still in flight
    worker._engine_groups[7] = "w0-d0.0-train:0"
    worker.engine.queue = [(7, 0, "0"), (7, 1, "x")]

    report = worker.evaluate_export("/run/stages/rl/hf", held_out_requests(stage), seed=0, version=9)

    assert worker.engine.loaded == "/run/stages/rl/hf" and report.policy_version == 9
    [(_, result)] = report.results
    assert result.checkpoint == "/run/stages/rl/hf" and (result.num_prompts, result.accuracy) == (4, 0.5)
    assert worker._finished == [] and worker._open == {} and worker._engine_groups == {}  # the group was dropped


def test_an_export_whose_problems_the_engine_cannot_take_is_left_to_an_engine_of_its_own():
    """A prompt (1 token) plus the request's 8 response tokens is more than the engine's 8: nothing is
    loaded or generated, and the caller evaluates elsewhere (zrl/pipeline/controller.py)."""
    stage = stage_of("Parity")
    worker = stand_in_worker(stage, LoadingEngine())
    worker.engine.max_model_len = 8
    assert worker.evaluate_export("/run/stages/rl/hf", held_out_requests(stage), seed=0, version=9) is None
    assert not hasattr(worker.engine, "loaded") and worker.engine.queue == [] and worker._open == {}
    worker.engine.max_model_len = 9
    assert worker.evaluate_export("/run/stages/rl/hf", held_out_requests(stage), seed=0, version=9) is not None


class Guess(EpisodicEnvironment):
    """Prompt i: the episode asks again until the policy says i (a tool call per wrong guess); reward 1 then."""

    name = "guess"
    reward_type = "binary"
    max_turns = 3

    def sample(self, n, seed, split="train", difficulty=None):
        return Parity().sample(n, seed, split)

    def verify(self, prompt, response):
        return float(response == prompt.answer)

    def episode(self, prompt):
        return GuessEpisode(prompt.answer)


class GuessEpisode(Episode):
    def __init__(self, answer):
        self.answer = answer

    def step(self, text):
        if text == self.answer:
            return Turn(done=True, reward=1.0)
        return Turn(messages=({"role": "user", "content": "again"},), tool_calls=1, tool_errors=int(text == "?"))


class TurnEngine(Engine):
    """A request's first turn (prompt of one token) answers "?"; later turns answer the prompt for even
    prompts, "?" for odd ones. Outputs carry the arrays an episode records."""

    def submit(self, ids, n, sampling, seed=None):
        group = next(self.groups)
        answer = str(ids[0]) if len(ids) > 1 and ids[0] % 2 == 0 else "?"
        self.queue += [(group, i, answer, len(ids)) for i in range(n)]
        return group

    def step(self):
        done, self.queue = self.queue[:2], self.queue[2:]
        return [SimpleNamespace(group_id=g, sample_index=i, output=turn_output(text, length)) for g, i, text, length in done]


def turn_output(text, prompt_length):
    tokens = np.arange(2, dtype=np.int64)
    return SimpleNamespace(prompt_ids=np.zeros(prompt_length, np.int64), token_ids=tokens,
                           logprobs=np.full(2, -0.5, np.float32), routing=np.zeros((prompt_length + 2, 1), np.uint8),
                           version_segments=(SimpleNamespace(start=0, version=6),), finish_reason="stop", text=text)


def test_a_multi_turn_environment_is_evaluated_by_its_episodes():
    stage = stage_of("Guess")
    worker = stand_in_worker(stage, TurnEngine(), episodes=True)

    report = worker.evaluate(held_out_requests(stage), seed=0)

    [(_, result)] = report.results
    # even prompts: "?" then the answer (2 turns, done, one tool call); odd: "?" three times, each answered with
    # a tool call, the third ending the episode at max_turns
    assert (result.num_prompts, result.accuracy) == (4, 0.5)
    assert result.reasons == {"done": 0.5, "max_turns": 0.5}
    assert result.metadata_means["turns"] == 2.5 and result.metadata_means["used_tools"] == 1.0
    assert result.metadata_means["tool_calls"] == 2.0 and result.mean_response_tokens == 5.0  # policy tokens
    assert worker._open == {} and worker._evaluated == {} and len(worker._episodes) == 0
