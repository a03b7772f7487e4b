"""Verifier in-process: a hung verify call costs its own rollout a timeout and nothing more; the calls
behind it run on a fresh thread, and abandoned threads are counted until they end."""

import subprocess
import sys
import threading
import time

from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment
from zrl.pipeline.rollout_worker import GroupText
from zrl.pipeline.verifier import Verifier
from zrl.types import Message, Prompt, Verification

RELEASE = threading.Event()  # set by the test to let hung verify calls return


class Hangs(Environment):
    """Reward 1 for "a", 0 otherwise; "hang" blocks until the test releases it. The metadata records
    which thread ran the call."""

    name = "hangs"

    def sample(self, n, seed, split="train", difficulty=None):
        return []

    def verify(self, prompt, response):
        if response == "hang":
            RELEASE.wait(timeout=60)  # bounded so a broken test cannot leave a thread behind forever
        return Verification(reward=float(response == "a"), metadata={"thread": threading.get_ident()})


class Raises(Hangs):
    def verify(self, prompt, response):
        raise KeyError(response)


def group(key: str, *texts: str) -> GroupText:
    prompt = Prompt(env=key, prompt_id="p", messages=(Message("user", "q"),), answer="", data_source=key)
    return GroupText(prompt, texts)


def verifier(cls=Hangs) -> Verifier:
    return Verifier([EnvironmentSpec(name=f"{__name__}:{cls.__name__}", key="k")], timeout_s=0.5)


def rewards(verified) -> list:
    return [(v.reward, v.error) for v in verified.verifications]


def threads(verified) -> list:
    return [v.metadata.get("thread") for v in verified.verifications]


def test_a_hung_call_costs_its_rollout_only_and_is_counted_until_it_ends():
    RELEASE.clear()
    v = verifier()
    timeout = (0.0, "timeout after 0.5 s")
    first = v.verify_text(group("k", "a", "hang", "a", "b"))
    assert rewards(first) == [(1.0, None), timeout, (1.0, None), (0.0, None)]
    assert first.hung_threads == 1
    before, _, after, after2 = threads(first)
    assert before != after == after2  # the calls behind the hang ran on a new thread, all on the same one

    second = v.verify_text(group("k", "b", "a", "a"))
    assert rewards(second) == [(0.0, None), (1.0, None), (1.0, None)] and second.hung_threads == 1
    assert set(threads(second)) == {after}  # no thread per call while nothing hangs

    third = v.verify_text(group("k", "hang", "a"))
    assert rewards(third) == [timeout, (1.0, None)] and third.hung_threads == 2

    RELEASE.set()  # the hung calls return; their threads end and are no longer counted
    deadline = time.monotonic() + 30
    while v.hung_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert v.hung_threads == 0
    assert rewards(v.verify_text(group("k", "a"))) == [(1.0, None)]


def test_verify_applies_the_same_timeout():
    RELEASE.clear()
    v = verifier()
    try:
        assert [(r.reward, r.error) for r in v.verify(group("k").prompt, ["hang", "a"])] == \
            [(0.0, "timeout after 0.5 s"), (1.0, None)]
        assert v.hung_threads == 1
    finally:
        RELEASE.set()


def test_a_verifier_that_always_raises_scores_every_rollout_zero_with_its_error():
    out = verifier(Raises).verify_text(group("k", "a", "b"))
    assert rewards(out) == [(0.0, "KeyError: 'a'"), (0.0, "KeyError: 'b'")]
    assert out.hung_threads == 0 and out.seconds >= 0.0


class Groups(Hangs):
    """Scores a whole group in one call (as a batching reward model does); "hang" in the group blocks it."""

    name = "groups"
    calls: list = []

    def verify_group(self, prompt, responses):
        type(self).calls.append(list(responses))
        if "hang" in responses:
            RELEASE.wait(timeout=60)
        return [float(r == "a") for r in responses]


def test_a_group_verifying_environment_gets_one_call_per_group_timed_per_response():
    RELEASE.clear()
    Groups.calls.clear()
    v = verifier(Groups)
    try:
        assert rewards(v.verify_text(group("k", "a", "b", "a"))) == [(1.0, None), (0.0, None), (1.0, None)]
        assert Groups.calls == [["a", "b", "a"]]
        started = time.monotonic()
        hung = v.verify_text(group("k", "a", "hang"))
        # The group's call had 2 x 0.5 s; its timeout costs both rewards and counts both responses.
        assert rewards(hung) == [(0.0, "timeout after 1 s")] * 2 and hung.timeouts == 2
        assert time.monotonic() - started >= 1.0
        assert rewards(v.verify_text(group("k", "a"))) == [(1.0, None)]  # a fresh thread serves the next group
    finally:
        RELEASE.set()


def test_a_multi_turn_group_keeps_the_rewards_its_episodes_earned():
    """Hangs would score "a" 1.0 and "b" 0.0; the episodes' own verifications are returned instead."""
    episodes = (Verification(0.0, metadata={"reason": "max_turns"}), Verification(1.0, metadata={"reason": "done"}))
    text = group("k", "a", "b")
    verified = verifier().verify_text(GroupText(text.prompt, text.texts, episodes))
    assert verified.verifications == episodes and verified.timeouts == 0


def test_the_verifier_and_the_buffer_load_what_they_are_sent_without_torch():
    """The verifiers and the buffer unpickle groups of zrl.pipeline.rollout_worker and score with
    zrl.algorithms and zrl.canaries; none of these imports torch (~1.2 CPU-s per actor start)."""
    code = ("import sys, zrl.pipeline.verifier, zrl.buffer, zrl.pipeline.rollout_worker; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
