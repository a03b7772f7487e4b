"""The stage-end summary figure: one PNG per stage from the run's metrics.jsonl.

`plot_stage_summary` selects the rows of one stage (the `stage/index` every row carries) and draws one
panel per group of series: reward next to the held-out accuracy measured during the stage
(`eval/<entry>/accuracy`, drawn at the policy version it evaluated, `eval/policy_version`), loss,
canaries, staleness, engine/trainer mismatch, throughput, response lengths and the adaptive-difficulty
levels and solve rates. Only series present in those rows are drawn, and a panel with none is left
out, so an SFT stage gets loss and throughput panels and an RL stage the rest. A step where a series
has no value (e.g. `mismatch/onpolicy_kl_k3` when the batch held no token of the trained version) is
simply not a point of that series; non-finite values (written as strings by the JSONL sink) are gaps.

Matplotlib runs on the Agg backend (no display); the figure is closed after saving, so a long cascade
does not accumulate figures.
"""

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("zrl")

POLICY_VERSION = "eval/policy_version"  # zrl.pipeline.held_out.POLICY_VERSION (plots import no pipeline)


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: tuple[str, ...] = ()      # exact metric names, drawn in this order
    prefix: str | None = None         # also every metric under this prefix whose name contains `contains`
    contains: str = ""
    excludes: str | None = None       # ... and not this
    log_scale: bool = False
    prefix_x: str | None = None       # the prefix's series are drawn against this metric of their row, not the step


MAX_PREFIX_SERIES = 12  # a panel draws at most this many of its prefix's series (e.g. one per RLVE task)

PANELS = (
    Panel("reward (trained batch) and held-out accuracy", "mean reward", ("reward/mean", "reward/gated_mean"),
          prefix="eval/", contains="/accuracy", prefix_x=POLICY_VERSION),
    Panel("loss", "loss", ("loss/policy", "loss/sft")),
    Panel("canaries", "fraction of rollouts / tokens", ("canary/lz77_flagged_fraction", "lengths/truncated_frac",
                                                        "env/verifier_error_fraction"),
          prefix="canary/", contains="frac"),
    Panel("staleness", "trainer steps", ("staleness/max", "staleness/mean")),
    Panel("mismatch (engine vs trainer)", "k3 KL per token", ("mismatch/kl_k3", "mismatch/onpolicy_kl_k3"),
          log_scale=True),
    Panel("throughput", "tokens / s", ("throughput/rollout_tokens_per_s", "throughput/trainer_tokens_per_s",
                                       "perf/tokens_per_s")),
    Panel("response length (trained batch)", "tokens", ("lengths/response_mean", "lengths/response_p50",
                                                        "lengths/response_p90", "lengths/response_max")),
    Panel("curriculum: level", "difficulty level", prefix="curriculum/", contains="/difficulty"),
    Panel("curriculum: solve rate at the level", "fraction of responses", prefix="curriculum/",
          contains="/solve_rate"),
    Panel("environment counters", "count since the stage started", prefix="env/", excludes="_fraction"),
)


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # the JSONL sink writes nan/inf as strings
        try:
            return float(value)
        except ValueError:
            return None
    return None


def stage_rows(metrics_path: str | Path, stage_index: int) -> list[dict]:
    """The rows of one stage, in file order (the file may hold several stages)."""
    rows = []
    for line in Path(metrics_path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if _number(row.get("stage/index")) == float(stage_index):
            rows.append(row)
    return rows


def panel_series(panel: Panel, rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) for the panel's series that have at least one finite value."""
    names = list(panel.series)
    if panel.prefix:
        extra = sorted({k for r in rows for k in r if k.startswith(panel.prefix) and panel.contains in k
                        and not (panel.excludes and panel.excludes in k) and k not in names})
        names += extra[:MAX_PREFIX_SERIES]
    out = {}
    for name in names:
        x = panel.prefix_x if panel.prefix_x and panel.prefix and name.startswith(panel.prefix) else "step"
        points = [(_number(r.get(x)), _number(r[name])) for r in rows if name in r]
        points = sorted((int(s), v) for s, v in points if s is not None and v is not None)
        if any(math.isfinite(v) for _, v in points):
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def plot_stage_summary(metrics_path: str | Path, stage_index: int, out_path: str | Path,
                       title: str = "") -> Path | None:
    """Write the summary PNG of one stage; returns its path, or None when the stage logged no rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = stage_rows(metrics_path, stage_index)
    if not rows:
        log.warning("no metrics rows for stage %d in %s: no summary plot", stage_index, metrics_path)
        return None
    drawn = [(p, s) for p in PANELS if (s := panel_series(p, rows))]
    ncols = min(3, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, drawn):
        for name, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) <= 40 else None, markersize=3, linewidth=1.2,
                    label=name)
        positive = all(v > 0 for _, vs in series.values() for v in vs if math.isfinite(v))
        if panel.log_scale and positive:
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=11)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("trainer step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    steps = [int(r["step"]) for r in rows]
    fig.suptitle(f"{title}  (trainer steps {min(steps)}-{max(steps)})".strip(), fontsize=13)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
