"""Verifier: scores finished groups off the generation path (a Ray actor pool hosts it; style rule 1).

Environments are built once per verifier from the stage's specs and found by the name they stamp on
their prompts. A verifier that raises costs the rollout its reward (`safe_verify`: reward 0, error
recorded); one that hangs is handled by the controller, which gives up on the call after
`verifier_timeout_s`, scores the group 0 with a timeout error, and restarts the verifier actor.
"""

from zrl.config.schema import EnvironmentSpec
from zrl.env import safe_verify
from zrl.prompts import build_environment
from zrl.types import Prompt, Verification


class Verifier:
    def __init__(self, environments: list[EnvironmentSpec]):
        self.envs = {}
        for spec in environments:
            env = build_environment(spec)
            self.envs.setdefault(env.name, env)

    def verify(self, prompt: Prompt, texts: list[str]) -> tuple[Verification, ...]:
        env = self.envs[prompt.env]
        return tuple(safe_verify(env, prompt, text) for text in texts)
