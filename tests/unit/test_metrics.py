"""Metrics fan-out: the same series reach JSONL, TensorBoard event files and an offline wandb run."""

import json

import pytest

from zrl.config.schema import Metrics
from zrl.metrics import MetricsLogger


def read_tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_series_reach_every_sink(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = MetricsLogger(tmp_path, Metrics(), run_name="t", run_config={"lr": 1e-5})
    for step in range(3):
        logger.log(step, {"reward/mean": 0.5 + step / 10, "canary/lz77_min_ratio": 0.3, "staleness/max": step})
    logger.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["reward/mean"] == pytest.approx(0.7)

    scalars = read_tensorboard(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["staleness/max"]] == [0, 1, 2]
    assert scalars["reward/mean"][1][1] == pytest.approx(0.6)

    [offline] = list((tmp_path / "wandb").glob("offline-run-*"))
    assert list(offline.glob("run-*.wandb")), "auto mode without WANDB_API_KEY writes an offline run"


def test_non_numeric_values_are_rejected(tmp_path):
    logger = MetricsLogger(tmp_path, Metrics(tensorboard=False, wandb={"enabled": False}), run_name="t")
    with pytest.raises(TypeError, match="real numbers"):
        logger.log(0, {"reward/mean": "high"})
    logger.log(0, {"loss": float("nan")})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == "nan"
