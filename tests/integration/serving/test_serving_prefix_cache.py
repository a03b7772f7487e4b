"""Prefix caching in the ZAYA engine: a group's samples reuse the prompt's KV blocks and CCA state.

The cached engine must give what the uncached one gives (token ids, logprobs, routing rows of every prompt
and generated position), while the samples after the first prefill only the prompt's last partial block.
The uncached engine preempts and recomputes in this run, which also holds its seeded sampling to the
preemption-free result."""

import logging

import numpy as np
import pytest

from serving.engine import SamplingConfig
from serving_testlib import ENGINE_KWARGS, make_prompts

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO

GROUP = 6  # the engines' max_num_seqs: the whole group runs at once
PROMPT = 40  # one whole KV block of 32 and 8 more tokens
BLOCK = ENGINE_KWARGS["block_size"]
REUSED = PROMPT // BLOCK * BLOCK  # prompt positions a sample can reuse
SAMPLING = SamplingConfig(max_tokens=60, temperature=1.0, seed=11)  # long enough to make the uncached engine preempt


def _group(engine, prompt, sampling=SAMPLING):
    before = engine._rpc("routing_capture_stats")
    samples = engine.generate([prompt], GROUP, sampling)[0]
    after = engine._rpc("routing_capture_stats")
    return samples, {k: after[k] - before[k] for k in ("recomputed_rows", "cached_rows")}


def test_prefix_cache_is_exact_and_prefills_the_prompt_once(fp32_engine, cached_fp32_engine):
    prompt = make_prompts((PROMPT,), seed=5)[0]
    plain, plain_stats = _group(fp32_engine, prompt)
    cached, cached_stats = _group(cached_fp32_engine, prompt)
    assert plain_stats["recomputed_rows"] > 0, "the uncached engine's settings should force preemption"
    assert cached_stats["recomputed_rows"] == 0

    for a, b in zip(plain, cached):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        # fp32 rounding of different chunkings: measured 1.43e-6 at a logprob of -5.8 (3 ulp), as between two
        # uncached engines that chunk the prompt differently.
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(a.routing, b.routing)  # reused positions carry their recorded rows
    worst = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(plain, cached))

    reused = (GROUP - 1) * REUSED  # every sample after the first reuses the whole blocks
    assert cached_stats["cached_rows"] == reused
    computed = GROUP * PROMPT - reused
    log.info(f"prefix cache: prompt tokens prefilled {GROUP * PROMPT} -> {computed} "
             f"({GROUP * PROMPT / computed:.1f}x fewer); max |logprob diff| {worst:.1e}")


def test_prefix_cache_is_kept_per_policy_version(cached_fp32_engine, serving_checkpoint):
    """A prompt computed under one policy version is not reused under the next (the request's cache salt)."""
    prompt, short = make_prompts((PROMPT,), seed=6)[0], SamplingConfig(max_tokens=2, seed=3)
    _, first = _group(cached_fp32_engine, prompt, short)
    assert first["cached_rows"] == (GROUP - 1) * REUSED
    _, same_version = _group(cached_fp32_engine, prompt, short)
    assert same_version["cached_rows"] == GROUP * REUSED  # even the first sample reuses the blocks
    cached_fp32_engine.update_weights(serving_checkpoint)  # same tensors, next version
    _, next_version = _group(cached_fp32_engine, prompt, short)
    assert next_version["cached_rows"] == (GROUP - 1) * REUSED
