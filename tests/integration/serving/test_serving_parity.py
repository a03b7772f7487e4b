"""vLLM engine vs zrl.moepp on the same weights and tokens: sampled-token logprobs and routing.

The engine runs with a 32-token step budget, 6 sequences and 12 KV blocks, so one step mixes decode
tokens with prefill chunks of other requests, requests queue, and some are preempted and recomputed;
the reference runs every sequence alone in one pass.
"""

import logging

import numpy as np
import pytest
import torch
from serving_testlib import generated_logits, k3_kl, make_prompts, reference_pass, sampled_logprobs

from serving.engine import SamplingConfig
from zrl.types import NO_ROUTE

log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO
pytestmark = pytest.mark.integration

NUM_SAMPLES = 2
MAX_TOKENS = 24


def _generate(engine):
    before = engine._rpc("routing_capture_stats")["recomputed_rows"]
    groups = engine.generate(make_prompts(), NUM_SAMPLES, SamplingConfig(max_tokens=MAX_TOKENS, seed=11))
    recomputed = engine._rpc("routing_capture_stats")["recomputed_rows"] - before
    return [s for g in groups for s in g], recomputed


def test_fp32_logprobs_and_routing_equal_the_reference(fp32_engine, fp32_reference):
    samples, recomputed = _generate(fp32_engine)
    assert recomputed > 0, "the engine settings should force preemption and recomputation"
    worst = 0.0
    used = [set() for _ in range(fp32_engine.routing_width)]
    for sample in samples:
        ref = reference_pass(fp32_reference, sample)
        expected = sampled_logprobs(generated_logits(ref, sample), sample.token_ids)
        worst = max(worst, float(np.abs(expected - sample.logprobs).max()))
        computed = sample.routing[:-1]  # every prompt token and every generated token but the last
        np.testing.assert_array_equal(computed, ref.native[:-1])
        assert (sample.routing[-1] == NO_ROUTE).all()  # the last sampled token is never run
        for layer in range(fp32_engine.routing_width):
            used[layer] |= set(computed[:, layer].tolist())
    log.info(f"fp32 engine vs zrl.moepp: max |logprob diff| {worst:.2e}, {recomputed} recomputed rows")
    # Measured 1.8e-6 (vLLM CPU kernels vs PyTorch, fp32); the requirement is 1e-4.
    assert worst <= 1e-4
    skip = fp32_reference.config.num_experts
    for layer_used in used:  # non-trivial routing: the comparison above could fail
        assert skip in layer_used and len(layer_used) >= 4


def test_bf16_mismatch_is_small(bf16_engine, bf16_reference):
    samples, _ = _generate(bf16_engine)
    behaviour, target, same_routing, agree, total = [], [], [], 0, 0
    for sample in samples:
        ref = reference_pass(bf16_reference, sample)
        behaviour.append(sample.logprobs)
        target.append(sampled_logprobs(generated_logits(ref, sample), sample.token_ids))
        differs = (sample.routing[:-1] != ref.native[:-1]).any(axis=1)  # [Tp + Tr - 1]
        first_difference = int(np.argmax(differs)) if differs.any() else len(differs)
        # Generated token t is computed from positions <= P - 1 + t.
        same_routing.append(np.arange(len(sample.token_ids)) + len(sample.prompt_ids) - 1 < first_difference)
        agree += int((~differs).sum())
        total += len(differs)
    behaviour, target, same_routing = map(np.concatenate, (behaviour, target, same_routing))
    kl, pearson = k3_kl(behaviour, target), float(np.corrcoef(behaviour, target)[0, 1])
    kl_same = k3_kl(behaviour[same_routing], target[same_routing])
    log.info(f"bf16 engine vs zrl.moepp: k3 KL {kl:.3e}, Pearson r {pearson:.6f} over {len(behaviour)} tokens; "
          f"routing agreement {agree}/{total}; KL {kl_same:.2e} over the {int(same_routing.sum())} tokens "
          f"whose context was routed identically")
    # Measured on this tiny random-weight model (sharp routers, 322 tokens): KL 2.8e-4, r 0.99994,
    # routing 572/574 positions. Most of the KL comes from bf16 near-ties that flip an expert (the
    # token's logprob then moves by up to ~0.2): over the 301 tokens whose context was routed
    # identically it is 5.6e-6 (r 0.999999). For scale, zrl.moepp's own bf16 and fp32 forwards differ
    # by KL 3.6e-4 here. The ZAYA1 report's 1.3e-4 / 0.9996 are for its trained 8B model. Bounds: ~15-20x
    # the measured values (different CPU kernels round differently; a flip costs ~1e-4 of KL).
    assert kl < 5e-3
    assert pearson > 0.999
    assert kl_same < 1e-4
    assert agree / total > 0.98


def test_capture_is_released_after_generation(fp32_engine):
    assert fp32_engine._rpc("routing_capture_stats")["open_requests"] == 0


def test_greedy_is_deterministic_across_batch_compositions(fp32_engine):
    """The same prompt decoded greedily alone and inside a busy mixed batch gives the same tokens."""
    prompt = make_prompts((23,), seed=5)[0]
    greedy = SamplingConfig(max_tokens=16, temperature=0.0)
    alone = fp32_engine.generate([prompt], 1, greedy)[0][0]
    crowd = fp32_engine.generate([prompt] + make_prompts(seed=6), 1, greedy)[0][0]
    np.testing.assert_array_equal(alone.token_ids, crowd.token_ids)
    np.testing.assert_array_equal(alone.routing, crowd.routing)
    torch.testing.assert_close(torch.from_numpy(alone.logprobs), torch.from_numpy(crowd.logprobs),
                               rtol=0, atol=1e-5)


def test_abort_drops_a_group_and_its_capture(fp32_engine):
    cfg = SamplingConfig(max_tokens=12, seed=4)
    keep, drop = (fp32_engine.submit(p, 2, cfg) for p in make_prompts((9, 30), seed=7))
    finished = fp32_engine.step() + fp32_engine.step()
    fp32_engine.abort(drop)
    assert {group for group, _ in fp32_engine.in_flight()} <= {keep}
    while fp32_engine.has_unfinished():
        finished += fp32_engine.step()
    assert sorted((s.group_id, s.sample_index) for s in finished if s.group_id == keep) == [(keep, 0), (keep, 1)]
    assert all(s.output.finish_reason != "abort" for s in finished)
    assert fp32_engine._rpc("routing_capture_stats")["open_requests"] == 0
