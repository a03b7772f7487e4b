"""Verifier: scores finished groups off the generation path (a Ray actor pool hosts it).

A plain class so it runs in-process in tests (docs/design.md, style rule 1).

Environments are built once per verifier from the stage's specs, one instance per entry, and a prompt
is verified by the instance that made it: the entry whose key the prompt source stamped on it
(`Prompt.env`, zrl/prompts.py). A verifier that raises costs the rollout its reward (`safe_verify`:
reward 0, error recorded); one that hangs is handled by the controller, which gives up on the call
after `verifier_timeout_s`, scores the group 0 with a timeout error, and restarts the verifier actor.
"""

from zrl.config.schema import EnvironmentSpec
from zrl.env import safe_verify
from zrl.prompts import stage_environments
from zrl.types import Prompt, Verification


class Verifier:
    def __init__(self, environments: list[EnvironmentSpec]):
        self.envs = stage_environments(environments)

    def verify(self, prompt: Prompt, texts: list[str]) -> tuple[Verification, ...]:
        env = self.envs[prompt.env]
        return tuple(safe_verify(env, prompt, text) for text in texts)

    def verify_text(self, group) -> tuple[Verification, ...]:
        """Verify a group's `GroupText` (the stage loop passes an object reference, which Ray resolves
        here: the responses go from the object store to this process, never through the driver)."""
        return self.verify(group.prompt, list(group.texts))
