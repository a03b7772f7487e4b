"""Held-out evaluation of a policy checkpoint: accuracy on an environment's `eval` split.

The prompts are the environment's `split="eval"` problems for a fixed seed, so two checkpoints are
always compared on the same problems with the same sampling settings; only the weights differ. The
engine is the same vLLM rollout engine the pipeline uses (in this process), so what is measured is
what the pipeline would generate.

Per prompt with k samples (k = `samples_per_prompt`), as reports quote them: avg@k is the mean reward
of its samples, pass@k the chance that k samples hold a correct one, pass@1 that one does, both by the
unbiased estimator of the Codex paper (`pass_at_k`; with k samples pass@k is 1 when any is correct, and
pass@1 the fraction correct); each is averaged over the prompts. A response is correct when its reward
is at least CORRECT_REWARD (a binary verifier's 1; a partial reward counts in avg@k only).

Progress goes to the log (stderr under the CLI): the engine's start, and each entry's generation and
result, so a long evaluation is never silent.

`save_rollouts` writes every prompt with its sampled responses, their rewards and their errors (what a
verifier or an episode's environment raised, else null) as JSONL, the rollouts file of the
`aggregation` environment (environments/aggregation.py: self-aggregation prompts from a checkpoint's
own samples; draw those from `split="train"`).
"""

import dataclasses
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zrl.config.schema import EnvironmentSpec, RewardModelSpec
from zrl.env import safe_verify, safe_verify_group, verifies_groups
from zrl.env.episode import EpisodicEnvironment
from zrl.env.episodes import episode_verification, run_episodes
from zrl.env.errors import EnvErrorLog
from zrl.prompts import build_environment
from zrl.types import Split

log = logging.getLogger("zrl")

CORRECT_REWARD = 1.0  # a response counts as correct for pass@k at this reward or above


@dataclass(frozen=True)
class EvalResult:
    checkpoint: str
    environment: str
    num_prompts: int         # prompts evaluated
    accuracy: float          # mean reward over prompts x samples (nan when no prompt was evaluated)
    verifier_errors: int
    mean_response_tokens: float
    reasons: dict[str, float]         # fraction of responses per verification `reason` (metadata)
    metadata_means: dict[str, float]  # mean of each numeric metadata value over the responses that carry it
    skipped_long_prompts: int = 0     # prompts longer than the request's max_prompt_tokens (not evaluated)
    # k samples per prompt; avg@k, pass@1 and pass@k averaged over the prompts (module docstring; nan: no
    # prompt evaluated, or a result recorded before they were)
    samples_per_prompt: int = 1
    avg_at_k: float = math.nan
    pass_at_1: float = math.nan
    pass_at_k: float = math.nan


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples, drawn without replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k: needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalRequest:
    """One environment's problems for `evaluate_requests`; `save_rollouts` writes them with their samples."""

    environment: EnvironmentSpec
    num_prompts: int = 200
    samples_per_prompt: int = 1
    temperature: float = 0.0
    max_response_tokens: int = 64
    split: Split = "eval"
    save_rollouts: str | None = None
    max_prompt_tokens: int | None = None  # longer prompts are skipped and counted, as in a stage


def evaluate_requests(checkpoint: str | Path, requests: list[EvalRequest], seed: int = 0, dtype: str = "float32",
                      reward_model: RewardModelSpec | None = None) -> list[EvalResult]:
    """Every request through one engine (started once for all of them), in order."""
    return evaluate_checkpoints([checkpoint], requests, seed, dtype, reward_model)[0]


def same_model(checkpoints: Sequence[str | Path]) -> None:
    """Raise ValueError (one line) unless every checkpoint is the first one's model: the same family and
    model configuration as the family parses it (config.json files of one model may be written differently).
    One engine, started on the first, serves them all by loading each one's weights in place."""
    from zrl.models import family_of_checkpoint

    def config(path):
        return family_of_checkpoint(path).read_config(path)

    first = config(checkpoints[0])
    for other in checkpoints[1:]:
        theirs = config(other)
        if type(theirs) is not type(first):
            raise ValueError(f"checkpoints: {other} is a {type(theirs).__name__}, {checkpoints[0]} a "
                             f"{type(first).__name__}; evaluate them in separate commands")
        differ = [f.name for f in dataclasses.fields(first)  # compare=False: what does not change the model
                  if f.compare and getattr(first, f.name) != getattr(theirs, f.name)]
        if differ:
            k = differ[0]
            raise ValueError(f"checkpoints: {other} is not the model of {checkpoints[0]} ({k}: "
                             f"{getattr(theirs, k)!r} vs {getattr(first, k)!r}); evaluate them in separate commands")


def evaluate_checkpoints(checkpoints: Sequence[str | Path], requests: list[EvalRequest], seed: int = 0,
                         dtype: str = "float32", reward_model: RewardModelSpec | None = None) -> list[list[EvalResult]]:
    """Per checkpoint (in order), the results of every request, all through one engine: started on the
    first checkpoint, then loaded in place with each next one's weights (the pipeline's weight update; its
    prefix cache is salted by the weights' version). The checkpoints must be one model (`same_model`): the
    same prompts, tokenized once, go to each."""
    same_model(checkpoints)
    checkpoint = checkpoints[0]
    log.info("eval: %s on %s; loading vLLM and the tokenizer",
             ", ".join(f"{r.environment.name} ({r.split} split)" for r in requests), checkpoint)
    from transformers import AutoTokenizer

    from serving.engine import RolloutEngine, SamplingConfig

    scorer = None
    envs = []
    for request in requests:
        env = build_environment(request.environment)
        if getattr(env, "uses_reward_model", False):
            if reward_model is None:
                raise ValueError(f"{request.environment.name!r} scores with a reward model: give one (--reward-model)")
            if scorer is None:
                from zrl.reward_model import RewardModelClient

                scorer = RewardModelClient.local(reward_model)
            env.use_reward_model(scorer)
        envs.append(env)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [env.sample(r.num_prompts, seed=seed, split=r.split) for env, r in zip(envs, requests)]
    ids, skipped = [], []
    for i, (batch, r) in enumerate(zip(prompts, requests)):
        encoded = [tokenizer(tokenizer.apply_chat_template(p.chat(), add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)["input_ids"] for p in batch]
        kept = [j for j, e in enumerate(encoded) if r.max_prompt_tokens is None or len(e) <= r.max_prompt_tokens]
        prompts[i] = [batch[j] for j in kept]
        ids.append([encoded[j] for j in kept])
        skipped.append(len(batch) - len(kept))
    max_model_len = max(max(map(len, batch), default=0) + r.max_response_tokens for batch, r in zip(ids, requests))
    log.info("eval: starting the engine on %s (max_model_len %d)", checkpoint, max_model_len)
    started = time.perf_counter()
    engine = RolloutEngine(checkpoint, dtype=dtype, max_model_len=max_model_len, seed=seed)
    log.info("eval: engine ready in %.0f s", time.perf_counter() - started)
    per_checkpoint = []
    try:
        for version, path in enumerate(checkpoints):
            if version:
                update = engine.update_weights(path, version=version)
                log.info("eval: %s loaded in place in %.1f s", path, update.seconds)
            outputs = []
            for env, batch, ids_, r in zip(envs, prompts, ids, requests):
                log.info("eval: %s: generating %d prompt(s) x %d sample(s)", r.environment.name, len(batch),
                         r.samples_per_prompt)
                started = time.perf_counter()
                sampling = SamplingConfig(max_tokens=r.max_response_tokens, temperature=r.temperature, seed=seed)
                if isinstance(env, EpisodicEnvironment):
                    outputs.append(run_episodes(engine, env, batch, ids_, r.samples_per_prompt, sampling,
                                                r.max_response_tokens))
                else:
                    outputs.append(engine.generate(ids_, r.samples_per_prompt, sampling) if ids_ else [])
                log.info("eval: %s: generated in %.0f s", r.environment.name, time.perf_counter() - started)
            per_checkpoint.append((path, outputs))
    finally:
        engine.close()
    every = []
    for path, outputs in per_checkpoint:
        results = [score(str(path), env, r, batch, out, n_skipped)
                   for env, r, batch, out, n_skipped in zip(envs, requests, prompts, outputs, skipped)]
        for result in results:
            k = result.samples_per_prompt
            log.info("eval: %s: %s: %d prompt(s) scored (%d skipped as too long): avg@%d %.3f, pass@1 %.3f, "
                     "pass@%d %.3f", path, result.environment, result.num_prompts, result.skipped_long_prompts, k,
                     result.avg_at_k, result.pass_at_1, k, result.pass_at_k)
        every.append(results)
    return every


def score(checkpoint: str, env, request: EvalRequest, prompts, outputs, skipped: int,
          errors: EnvErrorLog | None = None) -> EvalResult:
    """The EvalResult of `outputs` (per prompt, the engine's samples, or the episodes of a multi-turn
    environment, which scored them as they ran) on `env`'s verifier; `checkpoint` names what was evaluated
    (a path, or a policy version during a stage). Each distinct error is shown once on `errors` (None: a
    log of this call's own)."""
    errors = EnvErrorLog() if errors is None else errors
    entry = request.environment.key or request.environment.name
    verifications, lengths, rows, per_prompt = [], [], [], []  # per prompt: (avg@k, pass@1, pass@k)
    for prompt, samples in zip(prompts, outputs):
        if isinstance(env, EpisodicEnvironment):
            texts = [episode.rollout.text for episode in samples]
            group = [episode_verification(episode) for episode in samples]
            lengths += [episode.rollout.num_policy_tokens for episode in samples]
        else:
            texts = [sample.text for sample in samples]
            group = safe_verify_group(env, prompt, texts) if verifies_groups(env) else [
                safe_verify(env, prompt, text) for text in texts]
            lengths += [len(sample.token_ids) for sample in samples]
        verifications += group
        errors.record(entry, group)
        rewards = [v.reward for v in group]
        correct = sum(r >= CORRECT_REWARD for r in rewards)
        per_prompt.append((sum(rewards) / len(rewards), pass_at_k(len(rewards), correct, 1),
                           pass_at_k(len(rewards), correct, request.samples_per_prompt)))
        rows.append({"prompt": dataclasses.asdict(prompt), "responses": texts,
                     "errors": [v.error for v in group], "rewards": rewards})
    if request.save_rollouts is not None:
        path = Path(request.save_rollouts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reasons = Counter(str(v.metadata["reason"]) for v in verifications if "reason" in v.metadata)
    numbers: dict[str, list[float]] = {}
    for v in verifications:
        for key, value in v.metadata.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.setdefault(key, []).append(float(value))
    n = len(verifications)
    avg, pass_1, pass_k = [sum(column) / len(column) for column in zip(*per_prompt)] or [math.nan] * 3
    return EvalResult(checkpoint=checkpoint, environment=request.environment.name, num_prompts=len(prompts),
                      accuracy=sum(v.reward for v in verifications) / n if n else math.nan,
                      verifier_errors=sum(v.error is not None for v in verifications),
                      mean_response_tokens=sum(lengths) / n if n else math.nan,
                      reasons={k: c / n for k, c in sorted(reasons.items())},
                      metadata_means={k: sum(vs) / len(vs) for k, vs in sorted(numbers.items())},
                      skipped_long_prompts=skipped, samples_per_prompt=request.samples_per_prompt, avg_at_k=avg,
                      pass_at_1=pass_1, pass_at_k=pass_k)
