"""An environment's errors reach the console once per distinct message (zrl/env/errors.py) and
travel with the rollout: an episode whose environment raises, through the verifier, to the stage loop's
admission (in-process, with stand-ins for the Ray parts), which shows the message once however many
groups carry it and hands every verification, error included, to the buffer; and through an evaluation's
scoring (`zrl eval`, held-out evaluation) into its `save_rollouts` file."""

import json
import logging

from test_episodes import StandInEngine, render

from serving.engine import SamplingConfig
from zrl.config.schema import EnvironmentSpec
from zrl.env.episode import Episode, EpisodicEnvironment, Turn
from zrl.evaluate import EvalRequest, score
from zrl.env.errors import MAX_SHOWN_PER_ENTRY, EnvErrorLog
from zrl.env.episodes import EpisodeRunner, episode_verification
from zrl.pipeline.faults import ProgressWatchdog
from zrl.pipeline.rollout_worker import GroupText, GroupTicket
from zrl.pipeline.stage_admission import StageAdmission
from zrl.pipeline.stage_calls import VerifyCall
from zrl.pipeline.stage_report import StageCounters
from zrl.pipeline.verifier import Verifier
from zrl.types import Message, Prompt, Verification

TURN_ERROR = "ValueError: a Turn that ends the episode needs a reward"


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zrl" and r.levelno == logging.WARNING]


def errors(*messages) -> list[Verification]:
    return [Verification(0.0, error=m) for m in messages]


def test_each_distinct_error_of_an_entry_is_shown_once(caplog):
    log = EnvErrorLog()
    with caplog.at_level(logging.WARNING, logger="zrl"):
        log.record("arith", errors("KeyError: 'x'", "KeyError: 'x'", None))
        log.record("arith", errors("KeyError: 'x'", "timeout after 10 s"))
        log.record("logic", errors("KeyError: 'x'"))  # the same message from another entry is its own
        log.record("arith", [Verification(1.0)])
    assert warnings(caplog) == [
        "environment 'arith': KeyError: 'x' (the rollout's reward is 0; each distinct error is shown once)",
        "environment 'arith': timeout after 10 s (the rollout's reward is 0; each distinct error is shown once)",
        "environment 'logic': KeyError: 'x' (the rollout's reward is 0; each distinct error is shown once)"]


def test_an_entry_whose_messages_keep_changing_shows_the_first_ones_then_says_so(caplog):
    log = EnvErrorLog()
    with caplog.at_level(logging.WARNING, logger="zrl"):
        log.record("quotes", errors(*(f"ValueError: bad response {i}" for i in range(3 * MAX_SHOWN_PER_ENTRY))))
        log.record("quotes", errors("ValueError: bad response 0", "ValueError: yet another"))
        log.record("other", errors("RuntimeError: line one\n  line two " + "x" * 1000))
    lines = warnings(caplog)
    assert len(lines) == MAX_SHOWN_PER_ENTRY + 2
    assert lines[MAX_SHOWN_PER_ENTRY] == (f"environment 'quotes': more than {MAX_SHOWN_PER_ENTRY} distinct errors; "
                                          "further ones are counted, not shown")
    assert lines[-1].startswith("environment 'other': RuntimeError: line one line two xxx") and "\n" not in lines[-1]
    assert len(lines[-1]) < 700  # cut: the rollout's record keeps the whole message


class EndsWithoutReward(Episode):
    """An environment bug: its first reply ends the episode without a reward (Turn raises)."""

    def step(self, text):
        return Turn(done=True)


class Broken(EpisodicEnvironment):
    name = "broken"

    def sample(self, n, seed, split="train", difficulty=None):
        return []

    def episode(self, prompt):
        return EndsWithoutReward()

    def verify(self, prompt, response):
        return 0.0


def episodes(samples: int) -> list:
    """`samples` episodes of Broken run to their end on a stand-in engine (EpisodeOutputs)."""
    engine = StandInEngine([2] * samples)
    runner = EpisodeRunner(engine, render)
    for i in range(samples):
        runner.start(Broken().episode(None), [1, 2, 3], SamplingConfig(max_tokens=4), max_turns=2,
                     max_response_tokens=16, key=i)
    outputs = []
    while len(runner):
        for sample in engine.step():
            runner.on_sample(sample)
        outputs += runner.poll(timeout=None)
    runner.close()
    assert [(o.end_reason, o.reward, o.error) for o in outputs] == [("env_error", 0.0, TURN_ERROR)] * samples
    return outputs


def prompt(key: str, index: int = 0) -> Prompt:
    return Prompt(env=key, prompt_id=f"p{index}", messages=(Message("user", "q"),), answer="", data_source=key)


def episode_group(key: str, samples: int) -> GroupText:
    """A multi-turn group as a rollout worker publishes it: the episodes' texts and their own verifications."""
    outputs = episodes(samples)
    return GroupText(prompt(key), tuple(o.rollout.text for o in outputs), tuple(map(episode_verification, outputs)))


class Calls:
    """Records calls to any method (and to its `.remote`), answering None."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
        call.remote = call
        return call


def test_an_episodes_error_reaches_the_console_once_and_the_buffer_with_every_rollout(caplog):
    verifier = Verifier([EnvironmentSpec(name=f"{__name__}:Broken", key="tools")], timeout_s=5.0)
    buffer = Calls()
    admission = StageAdmission(Calls(), Calls(), buffer, None, ProgressWatchdog(60.0, 10), StageCounters(), {},
                               fetch=lambda ref: ref)
    with caplog.at_level(logging.WARNING, logger="zrl"):
        for g in range(2):
            verified = verifier.verify_text(episode_group("tools", samples=3))
            assert verified.env == "tools" and [v.error for v in verified.verifications] == [TURN_ERROR] * 3
            ticket = GroupTicket(f"g{g}", 3, ref=f"arrays{g}", text_ref=None)
            admission.on_verified(VerifyCall(ticket, 0, 0.0, False), verified)
    assert warnings(caplog) == [f"environment 'tools': {TURN_ERROR} (the rollout's reward is 0; each distinct "
                                "error is shown once)"]
    admitted = [args for name, args in buffer.calls if name == "admit_verified"]
    assert [ref for ref, _ in admitted] == ["arrays0", "arrays1"]
    assert all(v.error == TURN_ERROR and v.metadata["reason"] == "env_error" for _, vs in admitted for v in vs)
    assert admission.watchdog.verifier_errors == 6


def test_an_evaluation_writes_each_responses_error_and_shows_it_once(tmp_path, caplog):
    rollouts = tmp_path / "rollouts.jsonl"
    request = EvalRequest(EnvironmentSpec(name=f"{__name__}:Broken", key="tools"), num_prompts=2, samples_per_prompt=2,
                          save_rollouts=str(rollouts))
    with caplog.at_level(logging.WARNING, logger="zrl"):
        result = score("a checkpoint", Broken(), request, [prompt("tools", 0), prompt("tools", 1)],
                       [episodes(2), episodes(2)], skipped=0)
    assert result.verifier_errors == 4 and result.accuracy == 0.0
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert [(row["errors"], row["rewards"]) for row in rows] == [([TURN_ERROR] * 2, [0.0, 0.0])] * 2
    assert warnings(caplog) == [f"environment 'tools': {TURN_ERROR} (the rollout's reward is 0; each distinct "
                                "error is shown once)"]
