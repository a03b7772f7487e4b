"""Held-out evaluation of a policy checkpoint: accuracy on an environment's `eval` split.

The prompts are the environment's `split="eval"` problems for a fixed seed, so two checkpoints are
always compared on the same problems with the same sampling settings; only the weights differ. The
engine is the same vLLM rollout engine the pipeline uses (in this process), so what is measured is
what the pipeline would generate.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from zrl.config.schema import EnvironmentSpec
from zrl.env import safe_verify
from zrl.prompts import build_environment

log = logging.getLogger("zrl")


@dataclass(frozen=True)
class EvalResult:
    checkpoint: str
    environment: str
    num_prompts: int
    accuracy: float          # mean reward over prompts x samples
    verifier_errors: int
    mean_response_tokens: float


def evaluate(checkpoint: str | Path, environment: EnvironmentSpec, num_prompts: int = 200, seed: int = 0,
             samples_per_prompt: int = 1, temperature: float = 0.0, max_response_tokens: int = 64,
             dtype: str = "float32") -> EvalResult:
    from transformers import AutoTokenizer

    from serving.engine import RolloutEngine, SamplingConfig

    env = build_environment(environment)
    prompts = env.sample(num_prompts, seed=seed, split="eval")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = [tokenizer(tokenizer.apply_chat_template(p.chat(), add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"] for p in prompts]
    engine = RolloutEngine(checkpoint, dtype=dtype, max_model_len=max(map(len, ids)) + max_response_tokens, seed=seed)
    try:
        sampling = SamplingConfig(max_tokens=max_response_tokens, temperature=temperature, seed=seed)
        outputs = engine.generate(ids, samples_per_prompt, sampling)
    finally:
        engine.close()
    rewards, errors, lengths = [], 0, []
    for prompt, samples in zip(prompts, outputs):
        for sample in samples:
            verification = safe_verify(env, prompt, sample.text)
            rewards.append(verification.reward)
            errors += verification.error is not None
            lengths.append(len(sample.token_ids))
    return EvalResult(checkpoint=str(checkpoint), environment=environment.name, num_prompts=num_prompts,
                      accuracy=sum(rewards) / len(rewards), verifier_errors=errors,
                      mean_response_tokens=sum(lengths) / len(lengths))
