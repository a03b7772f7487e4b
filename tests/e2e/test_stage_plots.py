"""The stage-end summary figure (zrl/plots.py): which rows and series it draws, and that it writes a PNG."""

import json

import pytest

from zrl.plots import PANELS, panel_series, plot_stage_summary, stage_rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _panel(title):
    return next(p for p in PANELS if p.title.startswith(title))


@pytest.fixture
def metrics(tmp_path):
    sft = [{"step": s, "stage/index": 0.0, "loss/sft": 2.0 / s, "perf/tokens_per_s": 100.0} for s in (1, 2)]
    rl = []
    for s in (3, 4, 5):
        row = {"step": s, "stage/index": 1.0, "loss/policy": 0.1 * s, "staleness/max": float(s - 3),
               "staleness/mean": (s - 3) / 2, "mismatch/kl_k3": 1e-4 * s, "canary/lz77_flagged": 2.0,
               "canary/lz77_flagged_fraction": 0.25, "canary/rare_token_frac_top1%": 0.01 * s,
               "lengths/response_mean": 7.0 + s, "throughput/rollout_tokens_per_s": "nan"}
        if s != 4:  # no group arrived in step 4's window: no reward value
            row["reward/mean"] = 0.5
        rl.append(row)
    return _write(tmp_path / "metrics.jsonl", sft + rl)


def test_rows_are_those_of_the_stage(metrics):
    assert [r["step"] for r in stage_rows(metrics, 0)] == [1, 2]
    assert [r["step"] for r in stage_rows(metrics, 1)] == [3, 4, 5]
    assert stage_rows(metrics, 2) == []


def test_series_present_in_the_rows_only(metrics):
    rl = stage_rows(metrics, 1)
    assert panel_series(_panel("reward"), rl) == {"reward/mean": ([3, 5], [0.5, 0.5])}
    # Fractions under canary/ are drawn (prefix match), the cumulative count is not.
    assert list(panel_series(_panel("canaries"), rl)) == ["canary/lz77_flagged_fraction",
                                                          "canary/rare_token_frac_top1%"]
    assert panel_series(_panel("staleness"), rl)["staleness/mean"] == ([3, 4, 5], [0.0, 0.5, 1.0])
    # A series with only non-finite values is left out; the trainer's throughput is absent in these rows.
    assert panel_series(_panel("throughput"), rl) == {}
    assert panel_series(_panel("reward"), stage_rows(metrics, 0)) == {}
    assert panel_series(_panel("loss"), stage_rows(metrics, 0))["loss/sft"] == ([1, 2], [2.0, 1.0])


def test_plot_writes_a_png_per_stage(metrics, tmp_path):
    import matplotlib.image

    out = plot_stage_summary(metrics, 1, tmp_path / "stages" / "rl" / "summary.png", title="t / stage rl")
    image = matplotlib.image.imread(out)
    # 6 panels (reward, loss, canaries, staleness, mismatch, lengths) in 2 rows of 3, 100 dpi.
    assert image.shape[:2] == (720, 1560)
    sft = plot_stage_summary(metrics, 0, tmp_path / "sft.png")
    assert matplotlib.image.imread(sft).shape[:2] == (360, 1040)  # loss and throughput side by side
    assert plot_stage_summary(metrics, 7, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
