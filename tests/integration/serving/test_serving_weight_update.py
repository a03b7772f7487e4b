"""In-place weight updates between engine steps: per-token versions, equality with a fresh engine
(catches the CPU MoE repack bug: without the repack the updated engine's logprobs are off by up to ~2
nats), the checkpoint-path fallback and a Ray object reference."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from serving_testlib import make_prompts

from serving.engine import SamplingConfig, VersionSegment

pytestmark = pytest.mark.integration

PROMPTS = make_prompts((4, 19, 37), seed=8)


def _flatten(groups):
    return [s for g in groups for s in g]


def _assert_same_samples(got, expected, atol=0.0):
    for a, b in zip(_flatten(got), _flatten(expected), strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.routing, b.routing)
        assert np.abs(a.logprobs - b.logprobs).max(initial=0.0) <= atol


def test_versions_when_an_update_lands_mid_generation(fp32_engine, serving_checkpoint, updated_weights):
    original = load_file(serving_checkpoint / "model.safetensors")
    prompts = make_prompts(seed=9)
    cfg = SamplingConfig(max_tokens=20, seed=31)
    only_old = fp32_engine.generate(prompts, 1, cfg)  # every token under the checkpoint's weights
    v0 = fp32_engine.version
    # The same per-sample seeds as generate() used (seed + prompt index): the same random stream.
    groups = [fp32_engine.submit(p, 1, cfg, seed=cfg.seed + j) for j, p in enumerate(prompts)]
    finished, before_update, steps = {}, None, 0
    while fp32_engine.has_unfinished():
        for sample in fp32_engine.step():
            finished[sample.group_id] = sample.output
        steps += 1
        if steps == 6:
            before_update = fp32_engine.in_flight()  # tokens each sample had when the update landed
            stats = fp32_engine.update_weights(updated_weights)
            assert stats.version == fp32_engine.version == v0 + 1
    fp32_engine.update_weights(original)  # leave the session engine on the checkpoint's weights
    assert before_update, "the update should land while samples are in flight"
    crossed = 0
    for group, reference in zip(groups, only_old):
        output, old = finished[group], reference[0]
        if (group, 0) not in before_update:  # finished before the update
            assert output.version_segments == (VersionSegment(0, v0),)
            np.testing.assert_array_equal(output.token_ids, old.token_ids)
            continue
        n = before_update[(group, 0)]
        expected = ((VersionSegment(0, v0 + 1),) if n == 0 else
                    (VersionSegment(0, v0), VersionSegment(n, v0 + 1)))
        assert output.version_segments == expected
        assert output.token_versions().tolist() == [v0] * n + [v0 + 1] * (len(output.token_ids) - n)
        # Independent check of the boundary, from the same seeded random stream: tokens before it are
        # the old weights' tokens with their logprobs, the token at it is scored by the new weights.
        np.testing.assert_array_equal(output.token_ids[:n], old.token_ids[:n])
        np.testing.assert_allclose(output.logprobs[:n], old.logprobs[:n], rtol=0, atol=1e-5)
        if n < len(output.token_ids):
            assert abs(float(output.logprobs[n]) - float(old.logprobs[n])) > 1e-3
            crossed += 1
    assert crossed > 0


def test_update_in_place_equals_a_fresh_engine(bf16_engine, fresh_bf16_engine, serving_checkpoint,
                                               updated_weights):
    cfg = SamplingConfig(max_tokens=16, seed=5)
    before = bf16_engine.generate(PROMPTS, 2, cfg)
    stats = bf16_engine.update_weights(updated_weights, version=bf16_engine.version + 5)
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in updated_weights.values())
    assert stats.seconds > 0 and bf16_engine.version == stats.version
    updated = bf16_engine.generate(PROMPTS, 2, cfg)
    from_scratch = fresh_bf16_engine.generate(PROMPTS, 2, cfg)
    # Measured: bit-identical tokens, routing and logprobs (same kernels, same weights).
    _assert_same_samples(updated, from_scratch, atol=0.0)
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(_flatten(before), _flatten(updated)))

    # Path fallback: reload the original checkpoint directory; outputs return to the first run's.
    bf16_engine.update_weights(serving_checkpoint)
    _assert_same_samples(bf16_engine.generate(PROMPTS, 2, cfg), before, atol=0.0)


def test_update_from_a_ray_object_reference(bf16_engine, serving_checkpoint):
    ray = pytest.importorskip("ray")
    from serving.testing_assets import perturbed_state_dict

    cfg = SamplingConfig(max_tokens=12, seed=6)
    new_weights = perturbed_state_dict(serving_checkpoint, seed=3, scale=0.3)
    bf16_engine.update_weights(new_weights)
    expected = bf16_engine.generate(PROMPTS, 1, cfg)
    bf16_engine.update_weights(serving_checkpoint)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        stats = bf16_engine.update_weights(ray.put(new_weights))
        got = bf16_engine.generate(PROMPTS, 1, cfg)
    finally:
        ray.shutdown()
        bf16_engine.update_weights(serving_checkpoint)
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in new_weights.values())
    _assert_same_samples(got, expected, atol=0.0)


def test_incomplete_update_is_rejected_before_touching_the_engine(bf16_engine, serving_checkpoint, tmp_path):
    weights = load_file(serving_checkpoint / "model.safetensors")
    version = bf16_engine.version
    partial = {k: v for k, v in weights.items() if "balancing_biases" not in k}
    with pytest.raises(KeyError, match="balancing_biases"):
        bf16_engine.update_weights(partial)
    extra = dict(weights, **{"model.unknown.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="unknown"):
        bf16_engine.update_weights(extra)
    partial_dir = tmp_path / "partial"
    partial_dir.mkdir()
    save_file(partial, partial_dir / "model.safetensors")
    with pytest.raises(KeyError, match="balancing_biases"):
        bf16_engine.update_weights(partial_dir)
    assert bf16_engine.version == version
