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
