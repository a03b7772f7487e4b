"""The sandbox pool as the RL stage runs it: the verifier actors (Ray, restarted by Ray when they die)
score `code` responses by running them in bubblewrap sandboxes. Hostile programs submitted as responses
earn 0 and leave nothing behind; the pool keeps giving correct verdicts afterwards.

The tiny model of the end-to-end test never writes a code block, so this is where sandboxes run inside
Ray actors (tests/unit/sandbox covers the executor itself).
"""

from pathlib import Path

import pytest
from processes_testlib import sandbox_processes

from environments.code_env import Code, fenced_program
from zrl.config.schema import EnvironmentSpec

pytestmark = [pytest.mark.integration]
HOSTILE = Path(__file__).resolve().parents[2] / "unit" / "sandbox" / "hostile"
ATTACKS = ["10_fork_bomb.py", "13_memory_creep.py", "15_sleep_past_timeout.py", "16_stdout_flood.py",
           "18_daemon.py", "20_kill_parent.py", "22_ptrace_parent.py", "25_fill_disk.py"]


@pytest.fixture(scope="module")
def pool():
    import ray

    from zrl.pipeline.verifier_pool import VerifierPool
    from zrl.runtime_env import apply_defaults

    apply_defaults()
    ray.init(num_cpus=2, include_dashboard=False)
    limits = {"wall_s": 3.0, "cpu_s": 2.0, "memory_mb": 256}
    yield VerifierPool([EnvironmentSpec(name="code", options={"limits": limits})], timeout_s=60, size=2)
    ray.shutdown()


def test_hostile_responses_earn_0_and_the_pool_keeps_judging_correctly(pool):
    import ray

    env = Code()
    prompt = env.prompt("HumanEval/0")
    correct, wrong = env.demonstration(prompt), fenced_program(env.problems["HumanEval/0"][0].rejected[0])
    # Each attack runs when the response's module is imported; the function after it makes it a
    # candidate that the sandbox runs (a response without the function is refused before any run).
    stub = "\n\ndef has_close_elements(numbers, threshold):\n    return False\n"
    attacks = [fenced_program((HOSTILE / name).read_text() + stub) for name in ATTACKS]
    for actor in pool.actors:
        before = ray.get(actor.verify.remote(prompt, [correct, wrong]))
        hostile = ray.get(actor.verify.remote(prompt, attacks))
        after = ray.get(actor.verify.remote(prompt, [correct, wrong, correct]))
        assert [v.reward for v in before] == [1.0, 0.0] and [v.reward for v in after] == [1.0, 0.0, 1.0]
        assert [v.reward for v in hostile] == [0.0] * len(ATTACKS), [v.metadata for v in hostile]
        reasons = [v.metadata["reason"] for v in hostile]
        assert all(v.error is None for v in hostile) and "missing function" not in reasons, reasons
        assert sandbox_processes() == []
