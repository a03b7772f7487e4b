"""A rollout worker draws prompts on a background thread: a slow generator never stops the engine from
decoding what is in flight, drawn prompts join at the next engine step, a draw still running at the end
of a round carries over (counted in flight, not in the reported stream position), and a failing
generator stops the stage as before. The engine is a stand-in that finishes a sample every few steps;
the prompt source, tokenizer and round loop are the worker's own."""

import threading

import numpy as np
import pytest

import serving.engine
from environments.strings import StringTask
from serving.engine import FinishedSample, SampleOutput, VersionSegment
from zrl.assets import build_tiny_model
from zrl.config import parse_recipe
from zrl.env.base import EnvironmentFault
from zrl.pipeline.rollout_worker import RolloutWorker
from zrl.types import stream_place

GROUP_SIZE = 2
STEPS_PER_SAMPLE = 3


class SteppingEngine:
    """Submitted samples finish after STEPS_PER_SAMPLE engine steps; records which groups each step ran."""

    def __init__(self, model_path, max_model_len=4096, **_):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.max_model_len = max_model_len
        self.version = 0
        self.seeds: list[int] = []  # of every submitted group
        self.pending: dict[tuple[int, int], list] = {}  # (group, sample) -> [steps left, prompt ids]
        self.groups = 0
        self.steps_per_sample = STEPS_PER_SAMPLE
        self.steps: list[set[int]] = []

    def submit(self, ids, num_samples, sampling, seed=None) -> int:
        group, self.groups = self.groups, self.groups + 1
        self.seeds.append(seed)
        for i in range(num_samples):
            self.pending[(group, i)] = [self.steps_per_sample, np.asarray(ids, dtype=np.int64)]
        return group

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def in_flight(self) -> dict:
        return {key: 0 for key in self.pending}

    def step(self) -> list[FinishedSample]:
        self.steps.append({group for group, _ in self.pending})
        finished = []
        for key, entry in list(self.pending.items()):
            entry[0] -= 1
            if entry[0] == 0:
                del self.pending[key]
                prompt, tokens = entry[1], np.array([5, 6, 7], dtype=np.int64)
                finished.append(FinishedSample(key[0], key[1], SampleOutput(
                    prompt, tokens, np.zeros(3, np.float32), np.zeros((len(prompt) + 3, 1), np.uint8), "stop",
                    (VersionSegment(0, self.version),), "x")))
        return finished

    def abort_all(self) -> None:
        self.pending.clear()

    def close(self) -> None:
        pass


class Gate:
    """Holds StringTask.sample until opened (a generator that takes as long as the test wants)."""

    def __init__(self):
        self.opened, self.entered = threading.Event(), threading.Event()
        self.closed = False

    def hold(self, sample):
        def held(env, *args, **kwargs):
            if self.closed:
                self.entered.set()
                assert self.opened.wait(30), "the test never opened the gate"
            return sample(env, *args, **kwargs)
        return held


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("draws") / "model")


@pytest.fixture
def gate(monkeypatch):
    gate = Gate()
    monkeypatch.setattr(StringTask, "sample", gate.hold(StringTask.sample))
    return gate


def two_stages(model_path):
    """Two RL stages of other environments and lengths."""
    return parse_recipe({
        "name": "draws", "model": {"path": str(model_path)}, "output_dir": "/nonexistent/draws",
        "stages": [{"name": "rl", "kind": "rl", "steps": 1, "environments": [{"name": "strings"}],
                    "sampling": {"group_size": GROUP_SIZE, "prompts_per_batch": 2}},
                   {"name": "rl2", "kind": "rl", "steps": 1,
                    "environments": [{"name": "strings", "options": {"tasks": "reverse"}}],
                    "sampling": {"group_size": GROUP_SIZE + 1, "prompts_per_batch": 2, "max_prompt_tokens": 64,
                                 "max_response_tokens": 16, "seed": 5}}]}).stages


@pytest.fixture
def worker(model_path, monkeypatch):
    monkeypatch.setattr(serving.engine, "RolloutEngine", SteppingEngine)
    worker = RolloutWorker(0, model_path, two_stages(model_path)[0], seed=3, dtype="float32", round_seconds=0.3)
    yield worker
    worker.close()


def test_the_engine_decodes_while_a_slow_draw_runs_and_the_drawn_prompts_join_later(worker, gate):
    first = worker.round(2)  # a fast draw: both groups generate and finish within the round
    assert [t.group_id for t in first.tickets] and first.in_flight_groups == 0
    assert first.state["prompt_source"]["draws"] == 1

    worker.engine.steps_per_sample = 10**9
    assert worker.round(1).in_flight_groups == 1  # one long group in flight ...
    worker.engine.steps_per_sample = STEPS_PER_SAMPLE
    gate.closed = True
    steps_before = len(worker.engine.steps)
    held = worker.round(2)  # ... while the next draw is held for the whole round
    assert gate.entered.is_set()
    assert len(worker.engine.steps) - steps_before > 5, "the engine did not step while the draw ran"
    assert held.in_flight_groups == 1 + 2  # the one decoding and the two being drawn
    assert held.state["prompt_source"]["draws"] == 2  # the held draw is not yet part of the stream

    gate.opened.set()
    done = worker.round(0)
    assert done.state["prompt_source"]["draws"] == 3
    assert worker.engine.groups == 2 + 1 + 2
    joined = [i for i, groups in enumerate(worker.engine.steps) if {3, 4} <= groups]
    assert joined and 2 in worker.engine.steps[joined[0]], "the drawn groups joined the running batch"


def test_group_ids_follow_the_stream_and_repeat_with_the_same_seed(worker, model_path):
    ids = [t.group_id for _ in range(3) for t in worker.round(1).tickets]
    assert [stream_place(i) for i in ids] == [(0, 0), (0, 1), (0, 2)]
    again = RolloutWorker(0, model_path, worker.stage, seed=3, dtype="float32", round_seconds=0.3)
    try:
        assert [t.group_id for _ in range(3) for t in again.round(1).tickets] == ids
    finally:
        again.close()


def test_a_generator_that_raises_stops_the_round_with_its_reason(worker, monkeypatch):
    def broken(env, *args, **kwargs):
        raise RuntimeError("generator broke")

    monkeypatch.setattr(StringTask, "sample", broken)
    with pytest.raises(EnvironmentFault, match="generator broke"):
        worker.round(1)


def test_prompts_too_long_to_pose_are_skipped_and_their_adaptive_levels_reported(model_path, monkeypatch):
    monkeypatch.setattr(serving.engine, "RolloutEngine", SteppingEngine)
    recipe = parse_recipe({
        "name": "draws", "model": {"path": str(model_path)}, "output_dir": "/nonexistent/draws",
        "stages": [{"name": "rl", "kind": "rl", "steps": 1,
                    "environments": [{"name": "strings", "difficulty": "adaptive"}],
                    "sampling": {"group_size": GROUP_SIZE, "prompts_per_batch": 2, "max_prompt_tokens": 8}}]})
    worker = RolloutWorker(0, model_path, recipe.stages[0], seed=3, dtype="float32", round_seconds=0.3)
    try:
        report = worker.round(3, {"strings": 4})
    finally:
        worker.close()
    assert report.skipped_long_prompts == 3 and not report.tickets and report.in_flight_groups == 0
    assert report.skipped_levels == (("strings", 4),) * 3


def test_a_worker_carried_into_the_next_stage_draws_and_seeds_as_a_fresh_worker_of_it(worker, model_path):
    """begin_stage drops what the old stage had in flight and then draws the new stage's stream: the same
    prompts, group ids and per-request sample seeds as a worker started for that stage (the engine's
    own seed then plays no part in sampling)."""
    _, second = two_stages(model_path)
    worker.engine.steps_per_sample = 10**9
    assert worker.round(2).in_flight_groups == 2  # the first stage's groups, still decoding
    worker.begin_stage(second, seed=11)
    worker.engine.steps_per_sample = STEPS_PER_SAMPLE
    assert not worker.engine.pending, "the old stage's samples were not dropped"
    fresh = RolloutWorker(0, model_path, second, seed=11, dtype="float32", round_seconds=0.3)
    try:
        carried_seeds = len(worker.engine.seeds)
        rounds = [[(t.group_id, t.num_rollouts) for _ in range(2) for t in w.round(1).tickets] for w in (worker, fresh)]
        assert rounds[0] == rounds[1] and len(rounds[0]) == 2
        assert all(n == GROUP_SIZE + 1 for _, n in rounds[0])
        assert worker.engine.seeds[carried_seeds:] == fresh.engine.seeds
        assert worker.state_dict() == fresh.state_dict()
    finally:
        fresh.close()


def test_a_stage_longer_than_the_engine_takes_is_refused(worker, model_path):
    _, second = two_stages(model_path)
    worker.engine.max_model_len = 64
    with pytest.raises(ValueError, match="stage 'rl2' needs sequences of 80 tokens; this rollout worker's engine takes 64"):
        worker.begin_stage(second, seed=11)
