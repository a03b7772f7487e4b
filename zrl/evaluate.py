"""Held-out evaluation of a policy checkpoint: accuracy on an environment's `eval` split.

The prompts are the environment's `split="eval"` problems for a fixed seed, so two checkpoints are
always compared on the same problems with the same sampling settings; only the weights differ. The
engine is the same vLLM rollout engine the pipeline uses (in this process), so what is measured is
what the pipeline would generate.

`save_rollouts` writes every prompt with its sampled responses and their rewards as JSONL, the
rollouts file of the `aggregation` environment (environments/aggregation.py: self-aggregation
prompts from a checkpoint's own samples; draw those from `split="train"`).
"""

import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from zrl.config.schema import EnvironmentSpec, RewardModelSpec
from zrl.env import safe_verify, safe_verify_group, verifies_groups
from zrl.prompts import build_environment
from zrl.types import Split

log = logging.getLogger("zrl")


@dataclass(frozen=True)
class EvalResult:
    checkpoint: str
    environment: str
    num_prompts: int
    accuracy: float          # mean reward over prompts x samples
    verifier_errors: int
    mean_response_tokens: float
    reasons: dict[str, float]         # fraction of responses per verification `reason` (metadata)
    metadata_means: dict[str, float]  # mean of each numeric metadata value over the responses that carry it


def evaluate(checkpoint: str | Path, environment: EnvironmentSpec, num_prompts: int = 200, seed: int = 0,
             samples_per_prompt: int = 1, temperature: float = 0.0, max_response_tokens: int = 64,
             dtype: str = "float32", reward_model: RewardModelSpec | None = None, split: Split = "eval",
             save_rollouts: str | Path | None = None) -> EvalResult:
    """`reward_model`: the scorer of reward-model environments (run in this process)."""
    from transformers import AutoTokenizer

    from serving.engine import RolloutEngine, SamplingConfig

    env = build_environment(environment)
    if getattr(env, "uses_reward_model", False):
        if reward_model is None:
            raise ValueError(f"{environment.name!r} scores with a reward model: give one (--reward-model)")
        from zrl.reward_model import RewardModelClient

        env.use_reward_model(RewardModelClient.local(reward_model))
    prompts = env.sample(num_prompts, seed=seed, split=split)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = [tokenizer(tokenizer.apply_chat_template(p.chat(), add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"] for p in prompts]
    engine = RolloutEngine(checkpoint, dtype=dtype, max_model_len=max(map(len, ids)) + max_response_tokens, seed=seed)
    try:
        sampling = SamplingConfig(max_tokens=max_response_tokens, temperature=temperature, seed=seed)
        outputs = engine.generate(ids, samples_per_prompt, sampling)
    finally:
        engine.close()
    verifications, lengths, rows = [], [], []
    for prompt, samples in zip(prompts, outputs):
        texts = [sample.text for sample in samples]
        group = safe_verify_group(env, prompt, texts) if verifies_groups(env) else [safe_verify(env, prompt, text)
                                                                                   for text in texts]
        verifications += group
        lengths += [len(sample.token_ids) for sample in samples]
        rows.append({"prompt": dataclasses.asdict(prompt), "responses": texts, "rewards": [v.reward for v in group]})
    if save_rollouts is not None:
        Path(save_rollouts).write_text("".join(json.dumps(row) + "\n" for row in rows))
    reasons = Counter(str(v.metadata["reason"]) for v in verifications if "reason" in v.metadata)
    numbers: dict[str, list[float]] = {}
    for v in verifications:
        for key, value in v.metadata.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.setdefault(key, []).append(float(value))
    n = len(verifications)
    return EvalResult(checkpoint=str(checkpoint), environment=environment.name, num_prompts=num_prompts,
                      accuracy=sum(v.reward for v in verifications) / n,
                      verifier_errors=sum(v.error is not None for v in verifications),
                      mean_response_tokens=sum(lengths) / len(lengths),
                      reasons={k: c / n for k, c in sorted(reasons.items())},
                      metadata_means={k: sum(vs) / len(vs) for k, vs in sorted(numbers.items())})
