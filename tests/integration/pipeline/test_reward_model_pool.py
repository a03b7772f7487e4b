"""The reward-model service as a run uses it: named scoring actors on Ray (RewardModelPool), reached by
RewardModelClient the way an environment inside a verifier actor reaches them.

- The client's scores equal the in-process RewardModel's, from every actor of the pool.
- A call over the client's timeout, and a call whose actor is killed while it runs, raise
  RewardModelUnavailable (one line naming the actor); Ray restarts the actor and a later call succeeds.
- vLLM's pooling runner (backend `vllm`, in an actor: an in-process engine in the test process would
  pin its thread count for the tests after it) scores like the transformers backend.
"""

import json
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from zrl.config.schema import Resources, RewardModelSpec
from zrl.reward_model import RewardModel, RewardModelClient, RewardModelUnavailable, preference_pair, reward

pytestmark = [pytest.mark.integration]
log = logging.getLogger(__name__)
# fp32 scores (|s| <= 5) of one actor (1 thread) against the test process's RewardModel on the same
# batches: measured max abs diff 0.0 (2026-11-24, 2-core x86_64); 1e-5 as in tests/unit/test_reward_model.py.
FP32_ATOL = 1e-5
# vLLM's pooling runner against the transformers backend, fp32: measured max abs diff 9.5e-7 over 32
# conversations (its own attention kernels and matmul order); 1e-5 leaves about 10x room.
VLLM_ATOL = 1e-5


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from zrl.runtime_env import apply_defaults

    apply_defaults()
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_session, tmp_path_factory):
    from zrl.reward_model import RewardModelPool

    spec = RewardModelSpec(path=str(tmp_path_factory.mktemp("rm") / "tiny-rm"), build_tiny_if_missing=True,
                           dtype="float32", batch_size=8, score_center=-0.5)
    pool = RewardModelPool(spec, Resources(reward_model_workers=2, cpus_per_reward_model_worker=0.5))
    pool.start()  # builds the tiny RM first
    yield pool
    pool.stop()


def conversations(n: int, seed: str = "pool") -> list:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        messages, chosen, rejected = preference_pair(rng, "eval")
        out += [(messages, chosen), (messages, rejected)]
    return out[:n]


def max_abs_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_an_actor_that_cannot_load_the_model_fails_the_start_in_one_line(ray_session, tmp_path):
    import ray

    from zrl.reward_model import RewardModelPool

    # Enough of a checkpoint to pass the driver's check; the actor finds two labels and refuses it.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "id2label": {"0": "a", "1": "b"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    pool = RewardModelPool(RewardModelSpec(path=str(tmp_path)), Resources(cpus_per_reward_model_worker=0.5))
    with pytest.raises(RuntimeError) as exc_info:
        pool.start(timeout_s=120)
    message = str(exc_info.value)
    assert "\n" not in message and message.endswith("has 2 labels; a reward model has one"), message
    assert pool.actors == []
    with pytest.raises(ValueError):  # stopped: the name is free again
        ray.get_actor("zrl-reward-model-0")


def test_client_scores_equal_the_in_process_model_on_every_actor(pool):
    import ray

    batch = conversations(16)
    expected = RewardModel(pool.spec).scores(batch)
    assert max(expected) - min(expected) > 1.0  # distinct scores: the comparisons can fail
    for actor in pool.actors:
        outcomes = ray.get(actor.score.remote(batch))
        diff = max_abs_diff([s for s, _ in outcomes], expected)
        log.info("actor vs in-process fp32 max abs diff %.3g", diff)
        assert diff <= FP32_ATOL
    client = RewardModelClient()
    for _ in range(len(pool.actors)):  # round robin: every actor once
        outcomes = client.score(batch)
        assert max_abs_diff([s for s, _ in outcomes], expected) <= FP32_ATOL
        assert [r for _, r in outcomes] == [reward(s, pool.spec) for s, _ in outcomes]


def test_a_call_over_the_timeout_raises(pool):
    client = RewardModelClient(timeout_s=0.2)
    with pytest.raises(RewardModelUnavailable) as exc_info:
        client.score(conversations(800))  # seconds of work
    message = str(exc_info.value)
    assert "\n" not in message and "did not answer 800 conversations within" in message, message


def test_a_killed_actor_fails_its_call_and_ray_restarts_it(pool):
    import ray

    client = RewardModelClient()
    small = conversations(4, seed="small")
    expected = RewardModel(pool.spec).scores(small)
    client.score(small)  # the actors are found and idle
    with ThreadPoolExecutor(1) as executor:
        running = executor.submit(client.score, conversations(20_000))  # a minute of work or more
        time.sleep(3)  # long enough for the call to reach its actor, far shorter than the call
        for actor in pool.actors:  # whichever actor has the call
            ray.kill(actor, no_restart=False)
        with pytest.raises(RewardModelUnavailable) as exc_info:
            running.result(timeout=300)
    message = str(exc_info.value)
    log.info("the killed call raised: %s", message)
    assert "\n" not in message and "reward-model actor zrl-reward-model-" in message and "failed" in message, message

    # Ray restarts the actors (each loads the model again); until then calls to them raise
    # (ActorUnavailableError: restarting). Wait for one good call per actor in a row (round robin).
    deadline, good = time.monotonic() + 300, 0
    while good < len(pool.actors):
        try:
            outcomes = client.score(small)
        except RewardModelUnavailable as exc:
            assert time.monotonic() < deadline, f"the reward-model actors did not come back: {exc}"
            good = 0
            time.sleep(1)
            continue
        assert max_abs_diff([s for s, _ in outcomes], expected) <= FP32_ATOL
        good += 1


def test_vllm_pooling_runner_scores_like_transformers(pool):
    import ray

    from zrl.runtime_env import light_actor
    from zrl.reward_model import RewardModelWorker

    batch = conversations(32, seed="vllm")
    vllm_spec = pool.spec.model_copy(update={"backend": "vllm", "max_tokens": 1024})
    worker = light_actor(RewardModelWorker, vllm_spec.model_dump())
    try:
        outcomes = ray.get(worker.score.remote(batch), timeout=600)
    finally:
        ray.kill(worker)
    expected = RewardModel(pool.spec).scores(batch)
    diff = max_abs_diff([s for s, _ in outcomes], expected)
    log.info("vLLM vs transformers fp32 max abs diff %.3g", diff)
    assert diff <= VLLM_ATOL
    assert [r for _, r in outcomes] == [reward(s, vllm_spec) for s, _ in outcomes]
