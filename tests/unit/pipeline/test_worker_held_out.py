"""RolloutWorker.evaluate on a stand-in engine: the held-out prompts share the engine with a round's groups
in flight; the round's samples that finish meanwhile are kept for the next round, the evaluation is
scored per entry under the recipe's entry key (here a `module:Class` reference), with the engine's version."""

import itertools
from types import SimpleNamespace

import numpy as np

from zrl.config import parse_recipe
from zrl.env import Environment
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

    def __init__(self):
        self.queue, self.groups = [], itertools.count(100)

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


def test_evaluation_shares_the_engine_with_a_rounds_groups():
    stage = parse_recipe({"name": "r", "model": {"path": "m"}, "output_dir": "o", "stages": [{
        "name": "rl", "kind": "rl", "steps": 4, "environments": [{"name": f"{__name__}:Parity"}],
        "sampling": {"group_size": 2, "max_prompt_tokens": 8, "max_response_tokens": 8},
        "evaluation": {"prompts": 4, "samples": 2, "max_response_tokens": 8, "every_steps": 2}}]}).stages[0]
    worker = RolloutWorker.__new__(RolloutWorker)  # no vLLM: the stand-in engine above
    worker.stage, worker.group_size, worker.engine = stage, 2, Engine()
    worker._open, worker._finished, worker._eval_envs = {}, [], None
    prompt = Parity().sample(1, 0)[0]
    worker._open[7] = _Open("w0-d0.0-train:0", prompt, None)       # a round's group, both samples in flight
    worker.engine.queue = [(7, 0, "0"), (7, 1, "x")]

    report = worker.evaluate(held_out_requests(stage), seed=0)

    assert report.policy_version == 6
    [(key, result)] = report.results
    assert key == f"{__name__}:Parity"                               # the recipe's key, as at the stage's end
    assert (result.num_prompts, result.accuracy) == (4, 0.5)        # prompts 0 and 2 of 0..3 answered
    [(group, _)] = worker._finished                                  # finished meanwhile: reported next round
    assert group.group_id == "w0-d0.0-train:0" and [r.text for r in group.rollouts] == ["0", "x"]
    assert worker._open == {} and worker.engine.queue == []
