"""Held-out evaluation of a stage: what is evaluated, when during an RL stage, and what is logged.

The evaluation is the stage's `evaluation` block: each entry's `eval` split problems for the recipe's
seed, sampled and scored as zrl/evaluate.py does (`held_out_requests` builds the requests for both
places). At the stage's end the controller evaluates the exported policy on a fresh engine. With
`evaluation.every_steps` an RL stage also evaluates during training (`HeldOutSchedule`), on a rollout
worker with the weights it holds (`RolloutWorker.evaluate`: the prompts join its engine between two
rounds, like a round's groups; the trainer does not wait for it):
- at the stage's first sync (the policy it starts from) and after every sync that gives the workers a
  policy version that is a multiple of `every_steps` (config: a multiple of `sync_every_steps`, so
  every such version reaches the workers); the stage's last step is the stage-end evaluation's.
- One worker (the first to hold the version) evaluates each version once.

Logged (`held_out_metrics`): `eval/<entry>/accuracy` (mean reward over prompts x samples),
`eval/<entry>/response_tokens_mean` and `eval/policy_version`, the version of the weights evaluated;
for a multi-turn entry also `eval/<entry>/turns_mean`, `.../tool_calls_mean` and `.../used_tools_frac`.
An evaluation ends while the trainer goes on, after the rows of later steps were written (dashboards
take steps in increasing order), so its values go with the next row that is logged and the stage plot
draws them at `eval/policy_version` (zrl/plots.py). The stage-end evaluation is logged at the stage's
last step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from zrl.config.schema import RLStage
from zrl.evaluate import EvalRequest, EvalResult

log = logging.getLogger("zrl")

POLICY_VERSION = "eval/policy_version"


def held_out_requests(stage) -> list[tuple[str, EvalRequest]]:
    """(entry key, request) for each entry of the stage, or none when `evaluation.prompts` is 0."""
    e = stage.evaluation
    if not e.prompts:
        return []
    limit = stage.sampling.max_prompt_tokens if isinstance(stage, RLStage) else stage.max_sequence_tokens
    return [(key, EvalRequest(spec, e.prompts, e.samples, e.temperature, e.max_response_tokens,
                              max_prompt_tokens=limit))
            for key, spec in zip(stage.entry_keys(), stage.environments)]


def in_training_requests(stage: RLStage) -> list[tuple[str, EvalRequest]]:
    """The requests the rollout workers evaluate during the stage (none without `every_steps`). Entries
    that score with a reward model are left to the stage-end evaluation: they would take the reward-model
    actors from the stage's verifiers."""
    if stage.evaluation.every_steps is None:
        return []
    from zrl.env import registry

    requests = held_out_requests(stage)
    scored = [k for k, r in requests if registry.get(r.environment.name).uses_reward_model]
    if scored:
        log.warning("stage %r: %s score with a reward model: evaluated at the stage's end only, not every %d "
                    "steps", stage.name, scored, stage.evaluation.every_steps)
    return [(k, r) for k, r in requests if k not in scored]


# episode metadata (zrl.env.episodes.episode_verification) -> its held-out metric
EPISODE_METRICS = {"turns": "turns_mean", "tool_calls": "tool_calls_mean", "used_tools": "used_tools_frac"}


def held_out_metrics(policy_version: int, results) -> dict[str, float]:
    """The metric values of one evaluation: `results` are (entry key, EvalResult) pairs."""
    values = {POLICY_VERSION: float(policy_version)}
    for key, result in results:
        values[f"eval/{key}/accuracy"] = result.accuracy
        values[f"eval/{key}/response_tokens_mean"] = result.mean_response_tokens
        for name, metric in EPISODE_METRICS.items():
            if name in result.metadata_means:  # a multi-turn environment's episodes
                values[f"eval/{key}/{metric}"] = result.metadata_means[name]
    return values


@dataclass
class HeldOutSchedule:
    """Which synced policy versions are evaluated during the stage (the module docstring)."""

    every_steps: int | None
    start_version: int            # the version the stage (or its resumption) starts from
    end_version: int              # the stage's last step: evaluated at the stage's end instead
    evaluated: set[int] = field(default_factory=set)

    def due(self, version: int) -> bool:
        """Whether workers now holding `version` should evaluate it; True once per version."""
        if self.every_steps is None or version in self.evaluated or version >= self.end_version:
            return False
        if version != self.start_version and version % self.every_steps:
            return False
        self.evaluated.add(version)
        return True


def summary(results: tuple[tuple[str, EvalResult], ...]) -> str:
    return ", ".join(f"{key} {result.accuracy:.3f}" for key, result in results)


class InTrainingEvaluations:
    """Carries out an RL stage's evaluations during training: which synced worker evaluates, and the
    stage-end wait for those still running (their reports go to the stage's reporter)."""

    def __init__(self, stage: RLStage, start_version: int, end_version: int, seed: int):
        self.versions = HeldOutSchedule(stage.evaluation.every_steps, start_version=start_version,
                                        end_version=end_version)
        self.requests = in_training_requests(stage)
        self.seed, self.stage_name, self.timeout_s = seed, stage.name, stage.asynchrony.sync_timeout_s

    def after_sync(self, worker, policy_version: int):
        """The `evaluate` call of a rollout worker (actor handle) that now holds `policy_version`, or None
        when that version is not due."""
        if self.requests and self.versions.due(policy_version):
            return worker.evaluate.remote(self.requests, self.seed)
        return None

    def ended(self, pending: dict) -> Iterator[tuple]:
        """Await the evaluations still running at the stage's end (`pending`: the stage loop's calls in
        flight; their `EvalCall`s are taken out of it); yields (record, reference) of each as it ends in time."""
        import ray

        from zrl.pipeline.stage_calls import EvalCall

        for ref in [r for r, c in pending.items() if isinstance(c, EvalCall)]:
            call = pending.pop(ref)
            ready, _ = ray.wait([ref], timeout=self.timeout_s, fetch_local=False)
            if ready:
                yield call, ref
            else:
                log.warning("stage %r: a held-out evaluation did not end within %g s of the stage's end; it is "
                            "skipped", self.stage_name, self.timeout_s)
