"""bench/engine_trainer_agreement.py's measurement on its smallest setting: the session's fp32 engine
against the trainer itself (a 1-rank TrainerWorker, fp32), with and without routing replay.

The bench's bf16 rows are measurements, not requirements; this checks the fp32 reference row, where the two
sides must agree to fp32 noise (the serving tests' requirement: 1e-4 on any token's logprob).
"""

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO
pytestmark = pytest.mark.integration

BENCH = Path(__file__).resolve().parents[3] / "bench" / "engine_trainer_agreement.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engine_trainer_agreement", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_fp32_engine_and_trainer_agree_with_and_without_replay(bench, fp32_engine, serving_checkpoint):
    worker = bench.start_trainer(serving_checkpoint, "float32")  # joins the group the session's engines made
    vocab_size = worker.shape.vocab_size
    replayed, native = bench.measure(fp32_engine, worker, bench.random_prompts(4, vocab_size, seed=0),
                                     num_samples=2, max_tokens=24, seed=0)
    for row in (replayed, native):
        log.info(bench.format_row("zaya", "float32", row))
    assert replayed.replay and not native.replay
    assert replayed.stats.num_tokens == native.stats.num_tokens >= 100
    assert replayed.replay_disagree_fraction == 0.0  # fp32: the recorded experts are the trainer's own
    # Measured (2026-11-28, 1,402 tokens of the bench's default setting): max |Δ log p| 2.2e-6, k3 KL 1.0e-13,
    # r 1.0000000, the same with and without replay. k3 KL <= 5e-9 follows from |Δ log p| <= 1e-4.
    for row in (replayed, native):
        assert row.max_abs_logprob_diff <= 1e-4
        assert row.stats.kl_k3 <= 5e-9
        assert row.stats.pearson_prob > 0.99999


def test_fp32_replay_with_lora_is_as_exact_as_without(bench, fp32_engine, serving_checkpoint):
    """The trainer with non-zero adapters (unmerged: W x + s B A x) against the engine serving what the merged
    weight sync sends (W + s B A, tensor by tensor, loaded in place): the same fp32 agreement as the base."""
    worker = bench.start_trainer(serving_checkpoint, "float32", lora=bench.lora_spec())
    bench.randomize_adapters(worker, seed=0)
    prompts = bench.random_prompts(4, worker.shape.vocab_size, seed=0)
    version = fp32_engine.version
    try:
        # The adapters matter: the base engine's samples are far from the adapted trainer's log-probs.
        base_rollouts = bench.engine_rollouts(fp32_engine, prompts, num_samples=2, max_tokens=24, seed=0)
        off = bench.trainer_agreement(worker, base_rollouts, replay=True)
        bench.load_merged(fp32_engine, worker, "float32", version=version + 1)
        replayed, native = bench.measure(fp32_engine, worker, prompts, num_samples=2, max_tokens=24, seed=0)
    finally:
        fp32_engine.update_weights(str(serving_checkpoint), version=version)  # the session engine's base again
        worker.shutdown()
    log.info("base engine vs adapted trainer: max |Δ log p| %.2e", off.max_abs_logprob_diff)
    for row in (replayed, native):
        log.info(bench.format_row("zaya+lora", "float32", row))
    assert off.max_abs_logprob_diff > 1e-2
    assert replayed.stats.num_tokens == native.stats.num_tokens >= 100
    assert replayed.replay_disagree_fraction == 0.0
    # The bound of the test above (the base model's): LoRA, merged sync, must meet it too.
    for row in (replayed, native):
        assert row.max_abs_logprob_diff <= 1e-4
        assert row.stats.kl_k3 <= 5e-9
        assert row.stats.pearson_prob > 0.99999
