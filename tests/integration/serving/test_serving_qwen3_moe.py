"""Qwen3-MoE on the rollout engine (vLLM's built-in model) against the trainer's zrl.qwen3_moe.

On the tiny top-2 checkpoint (3 layers, the middle one dense), fp32, with the serving tests' engine shape
(chunked prefill, continuous batching) and fewer KV blocks (preemption and recomputation): the routing
the engine records is [Tp + Tr, L * k] and every computed row holds exactly the trainer's own top-k set
per sparse layer, with prefix caching too; the trainer, replaying that record over the same packed
rollouts, gives the engine's logprobs to fp32 noise (requirement 1e-4); the engine/trainer mismatch with
and without replay is measured on the same rollouts, fp32 and bf16 engine; and an in-place weight update
from HF-named tensors (zrl.qwen3_moe.hf_state_dict) moves the engine to the new weights.
"""

import json
import logging

import numpy as np
import pytest
import torch
from serving_testlib import ENGINE_KWARGS, k3_kl, make_prompts

from serving.engine import SamplingConfig
from zrl.types import NO_ROUTE

log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO
pytestmark = pytest.mark.integration

NUM_SAMPLES = 2
SAMPLING = SamplingConfig(max_tokens=24, temperature=1.0, seed=17)


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory):
    from zrl.models import get_family

    return get_family("qwen3_moe").build_tiny(tmp_path_factory.mktemp("qwen3_moe") / "ckpt")


def _engine(path, dtype, **overrides):
    from serving.engine import RolloutEngine

    torch.set_num_threads(1)  # as conftest._engine: before the session's first engine
    return RolloutEngine(path, dtype=dtype, seed=0, **{**ENGINE_KWARGS, **overrides})


# Session-scoped engines: closing an in-process vLLM engine tears down state the other engines still use.
@pytest.fixture(scope="session")
def qwen_engine(qwen_checkpoint):
    """6 KV blocks of 32 for up to 6 sequences of up to 85 tokens: the engine preempts and recomputes."""
    engine = _engine(qwen_checkpoint, "float32", num_gpu_blocks_override=6)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def qwen_bf16_engine(qwen_checkpoint):
    engine = _engine(qwen_checkpoint, "bfloat16")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def qwen_cached_engine(qwen_checkpoint):
    engine = _engine(qwen_checkpoint, "float32", prefix_caching=True, num_gpu_blocks_override=64)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def qwen_reference(qwen_checkpoint):
    from zrl.qwen3_moe import load_hf_checkpoint

    return load_hf_checkpoint(qwen_checkpoint, dtype=torch.float32).eval()


def _samples(engine, seed: int) -> list:
    groups = engine.generate(make_prompts(seed=seed), NUM_SAMPLES, SAMPLING)
    samples = [s for g in groups for s in g if len(s.token_ids) > 0]
    assert sum(len(s.token_ids) for s in samples) >= 100
    return samples


@torch.no_grad()
def _trainer_pass(model, samples, replay: bool):
    """The samples packed into one stream, as the trainer packs rollouts: (logprob of each generated token
    [sum Tr], native top-k [sum (Tp + Tr), L * k], the RoutingInfo), replaying the engine's records or not."""
    ids = [np.concatenate([s.prompt_ids, s.token_ids]) for s in samples]
    targets = [np.concatenate([i[1:], [-1]]) for i in ids]
    cu = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).tolist()
    record = torch.from_numpy(np.concatenate([s.routing for s in samples])) if replay else None
    out = model.token_logprobs(torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(targets)),
                               cu_seqlens=cu, routing_replay=record)
    generated = np.concatenate([np.arange(start + len(s.prompt_ids) - 1, end - 1)
                                for s, start, end in zip(samples, cu[:-1], cu[1:])])
    return out.logprobs.numpy()[generated], out.routing.native_ids.numpy(), out.routing


def test_recorded_routing_is_the_trainers_top_k(qwen_engine, qwen_reference):
    config = qwen_reference.config
    k = config.num_experts_per_tok
    assert qwen_engine.routing_width == config.routing_width == config.num_hidden_layers * k
    before = qwen_engine._rpc("routing_capture_stats")["recomputed_rows"]
    samples = _samples(qwen_engine, seed=3)
    assert qwen_engine._rpc("routing_capture_stats")["recomputed_rows"] > before  # preempted and recomputed
    sets_seen = _assert_trainers_top_k(qwen_reference, samples)
    assert len(sets_seen) >= 5  # the routing is not trivially the same experts everywhere
    assert qwen_engine._rpc("routing_capture_stats")["open_requests"] == 0


def test_prefix_cached_positions_carry_the_routing_they_were_computed_with(qwen_cached_engine, qwen_reference):
    prompt = make_prompts((40,), seed=5)[0]  # one whole KV block of 32 and 8 more tokens
    before = qwen_cached_engine._rpc("routing_capture_stats")["cached_rows"]
    samples = qwen_cached_engine.generate([prompt], 6, SamplingConfig(max_tokens=60, seed=11))[0]
    cached = qwen_cached_engine._rpc("routing_capture_stats")["cached_rows"] - before
    assert cached == 5 * 32  # the samples after the first reuse the prompt's whole block
    _assert_trainers_top_k(qwen_reference, samples)
    replayed, _, _ = _trainer_pass(qwen_reference, samples, replay=True)
    assert float(np.abs(replayed - np.concatenate([s.logprobs for s in samples])).max()) <= 1e-4


def _assert_trainers_top_k(model, samples) -> set[tuple[int, ...]]:
    """Every computed row of every sample holds the trainer's own top-k set in each sparse layer and
    NO_ROUTE in dense layers; the last row is NO_ROUTE. Returns the expert sets seen."""
    config = model.config
    k = config.num_experts_per_tok
    _, native, _ = _trainer_pass(model, samples, replay=False)
    offset, sets_seen = 0, set()
    for s in samples:
        rows = len(s.prompt_ids) + len(s.token_ids)
        assert s.routing.shape == (rows, config.routing_width) and s.routing.dtype == np.uint8
        assert (s.routing[-1] == NO_ROUTE).all()  # the last sampled token is never computed
        engine = s.routing[:-1].reshape(rows - 1, config.num_hidden_layers, k)
        trainer = native[offset: offset + rows - 1].reshape(rows - 1, config.num_hidden_layers, k)
        for layer_idx in range(config.num_hidden_layers):
            if layer_idx not in config.moe_layers:
                assert (engine[:, layer_idx] == NO_ROUTE).all()
                continue
            np.testing.assert_array_equal(np.sort(engine[:, layer_idx], -1), np.sort(trainer[:, layer_idx], -1),
                                          err_msg=f"layer {layer_idx}")
            sets_seen |= {tuple(sorted(row)) for row in engine[:, layer_idx].tolist()}
        offset += rows
    return sets_seen


def test_onpolicy_logprobs_with_and_without_replay(qwen_engine, qwen_reference):
    worst, disagree, stats = _mismatch(qwen_engine, qwen_reference, "fp32")
    assert disagree == 0.0  # the recorded experts are the trainer's own top-k
    # Measured (fp32 engine on vLLM's CPU kernels vs zrl.qwen3_moe, 336 tokens, 2026-11-27): 9.5e-7; mean
    # |dlogprob| 1.9e-7 and k3 KL 4.8e-14 with and without replay alike (same routing either way).
    assert worst <= 1e-4


def test_bf16_engine_mismatch_with_and_without_replay(qwen_bf16_engine, qwen_reference):
    """A bf16 engine against the fp32 trainer: some bf16 routes differ from the trainer's own, and replaying
    the engine's record lowers the mismatch on the same rollouts."""
    _, disagree, stats = _mismatch(qwen_bf16_engine, qwen_reference, "bf16")
    # Measured (336 tokens, 2026-11-27): 0.34% of the recorded experts differ; mean |dlogprob| 8.9e-4 with
    # replay, 9.6e-4 without; k3 KL 6.4e-7 with, 8.4e-7 without.
    assert disagree > 0.0
    assert stats["replay"][1] < stats["no replay"][1]


def _mismatch(engine, model, label: str):
    """On one set of rollouts: max |engine - trainer (replay)|, the fraction of recorded experts outside
    the trainer's own top-k, and per trainer pass ("replay", "no replay") mean |dlogprob| and k3 KL."""
    samples = _samples(engine, seed=4)
    behaviour = np.concatenate([s.logprobs for s in samples])
    replayed, _, routing = _trainer_pass(model, samples, replay=True)
    native, _, _ = _trainer_pass(model, samples, replay=False)
    worst = float(np.abs(replayed - behaviour).max())
    disagree = float(routing.replay_mismatch_fraction)
    stats = {name: (float(np.abs(lp - behaviour).mean()), k3_kl(behaviour, lp))
             for name, lp in (("replay", replayed), ("no replay", native))}
    log.info(f"{label} engine, {len(behaviour)} tokens: max |engine - trainer (replay)| {worst:.2e}; recorded "
             f"experts outside the trainer's top-k {disagree:.2%}; mean |dlogprob|, k3 KL: "
             + "; ".join(f"{n} {m:.2e}, {kl:.2e}" for n, (m, kl) in stats.items()))
    return worst, disagree, stats


def test_weight_update_in_place_follows_the_trainer(qwen_engine, qwen_reference, qwen_checkpoint):
    from zrl.qwen3_moe import hf_state_dict, load_hf_checkpoint

    updated = load_hf_checkpoint(qwen_checkpoint, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3 * p.float().std().clamp_min(1e-3))
    before = _samples(qwen_engine, seed=6)
    version = qwen_engine.version
    try:
        stats = qwen_engine.update_weights(hf_state_dict(updated.state_dict()))
        assert stats.version == version + 1
        after = _samples(qwen_engine, seed=6)
    finally:
        qwen_engine.update_weights(qwen_checkpoint)  # the path form; back to the checkpoint for other tests
    engine = np.concatenate([s.logprobs for s in after])
    new, _, _ = _trainer_pass(updated, after, replay=True)
    old, _, _ = _trainer_pass(qwen_reference, after, replay=True)
    log.info(f"after the update: max |engine - updated trainer| {np.abs(new - engine).max():.2e}, "
             f"- old trainer {np.abs(old - engine).max():.2e}")
    assert float(np.abs(new - engine).max()) <= 1e-4
    assert float(np.abs(old - engine).max()) > 1e-2  # the comparison tells the two weight sets apart
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(before, after))
    restored = _samples(qwen_engine, seed=6)  # the checkpoint again: the first run's samples exactly
    for a, b in zip(before, restored, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.routing, b.routing)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_incomplete_weight_update_is_refused(qwen_engine, qwen_reference):
    from zrl.qwen3_moe import hf_state_dict

    tensors = hf_state_dict(qwen_reference.state_dict())
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    with pytest.raises(KeyError, match="experts.7.up_proj"):
        qwen_engine.update_weights(tensors)


def test_unserved_model_type_is_refused_before_vllm_starts(tmp_path):
    from serving.engine import RolloutEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' is not served.*qwen3_moe"):
        RolloutEngine(tmp_path)
