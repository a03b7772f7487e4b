"""Sampling controls of RolloutEngine on the fp32 engine, checked against zrl.moepp's logits.

The returned logprob is vLLM's "processed" one: the log-probability under the distribution actually
sampled from. `processed_logprobs` below restates vLLM's documented order — temperature, min-p,
top-k, top-p (ascending-sorted cumulative mass <= 1 - p removed, the top token always kept) — and
every sampled token must be allowed by it and carry its logprob.
"""

import numpy as np
import pytest
import torch
from serving_testlib import generated_logits, make_prompts, reference_pass

from serving.engine import SamplingConfig

pytestmark = pytest.mark.integration

PROMPTS = make_prompts((5, 12, 30), seed=3)


def processed_logprobs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[T, V] reference logits -> [T, V] logprobs of the sampling distribution (-inf = excluded)."""
    z = logits.double() / cfg.temperature
    if cfg.min_p > 0:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < cfg.min_p * probs.max(-1, keepdim=True).values, -torch.inf)
    if cfg.top_k > 0:
        kth = z.topk(cfg.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    if cfg.top_p < 1:
        ascending, order = z.sort(dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - cfg.top_p
        drop[:, -1] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    return torch.log_softmax(z, dim=-1)


def _check_against_reference(engine, reference, cfg: SamplingConfig) -> tuple[float, int, int]:
    """Worst |logprob diff|, tokens whose support was restricted, tokens sampled with probability < 1."""
    worst, restricted, uncertain = 0.0, 0, 0
    for group in engine.generate(PROMPTS, 2, cfg):
        for sample in group:
            assert 1 <= len(sample.token_ids) <= cfg.max_tokens
            lp = processed_logprobs(generated_logits(reference_pass(reference, sample), sample), cfg)
            chosen = lp[torch.arange(len(sample.token_ids)), torch.from_numpy(sample.token_ids)]
            assert torch.isfinite(chosen).all(), "a sampled token lies outside the allowed set"
            worst = max(worst, float((chosen - torch.from_numpy(sample.logprobs).double()).abs().max()))
            restricted += int(torch.isinf(lp).any(-1).sum())
            uncertain += int((chosen < -1e-3).sum())
    return worst, restricted, uncertain


@pytest.mark.parametrize("cfg", [
    SamplingConfig(max_tokens=10, temperature=0.7, seed=1),
    SamplingConfig(max_tokens=10, temperature=1.3, top_k=4, seed=2),
    SamplingConfig(max_tokens=10, top_p=0.5, seed=3),
    SamplingConfig(max_tokens=10, min_p=0.05, seed=4),
    SamplingConfig(max_tokens=10, top_k=20, top_p=0.8, min_p=0.02, seed=5),
], ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_processed_logprobs_follow_the_sampling_controls(fp32_engine, fp32_reference, cfg):
    worst, restricted, uncertain = _check_against_reference(fp32_engine, fp32_reference, cfg)
    # fp32 engine vs reference: measured 1.3e-6 (temperature), 8.2e-7 (top-k), 1.1e-6 (top-p),
    # 5.5e-7 (min-p), 3.2e-6 (combined); the requirement is 1e-4.
    assert worst <= 1e-4
    assert uncertain > 0, "every sampled token had probability 1: the logprob check is vacuous"
    if (cfg.top_k, cfg.top_p, cfg.min_p) != (0, 1.0, 0.0):
        assert restricted > 0, "the control never removed a token: the check above could not fail"


def test_same_seed_same_samples_and_distinct_seeds_differ(fp32_engine):
    cfg = SamplingConfig(max_tokens=12, seed=77)
    first = fp32_engine.generate(PROMPTS, 2, cfg)
    again = fp32_engine.generate(PROMPTS, 2, cfg)
    for g1, g2 in zip(first, again):
        for s1, s2 in zip(g1, g2):
            np.testing.assert_array_equal(s1.token_ids, s2.token_ids)
            np.testing.assert_array_equal(s1.logprobs, s2.logprobs)
    # Within a group the samples get seeds 77, 78: they should not all coincide.
    assert any(not np.array_equal(g[0].token_ids, g[1].token_ids) for g in first)


def test_max_tokens_and_finish_reasons(fp32_engine):
    eos = set(fp32_engine.tokenizer.eos_token_id if isinstance(fp32_engine.tokenizer.eos_token_id, list)
              else [fp32_engine.tokenizer.eos_token_id])
    samples = [s for g in fp32_engine.generate(PROMPTS, 4, SamplingConfig(max_tokens=3, seed=9)) for s in g]
    for s in samples:
        assert len(s.token_ids) <= 3
        assert s.finish_reason in ("length", "stop")
        assert (s.finish_reason == "length") == (len(s.token_ids) == 3 and int(s.token_ids[-1]) not in eos)
    assert any(s.finish_reason == "length" for s in samples)


def test_stop_strings_end_the_sample_and_are_cut_from_the_text(fp32_engine):
    cfg = SamplingConfig(max_tokens=40, stop=(" ",), seed=21)
    samples = [s for g in fp32_engine.generate(PROMPTS, 4, cfg) for s in g]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample hit the stop string"
    tokenizer = fp32_engine.tokenizer
    for s in samples:
        assert " " not in s.text
    for s in stopped:
        full = tokenizer.decode(s.token_ids.tolist())
        if " " in full:  # stopped on the string (a sample may also stop on EOS)
            assert full.startswith(s.text)
            assert len(s.token_ids) < cfg.max_tokens
