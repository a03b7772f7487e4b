"""The cascade report: one HTML page per run (`<output_dir>/cascade_report.html`) that shows every stage
at a glance, written when the cascade finishes. It reads only the run directory, so
`write_cascade_report(run_dir, title)` rebuilds it for any run, a stopped one included.

Per stage, from the stage record (`stages/<name>/stage.json`) and the stage's rows of metrics.jsonl:
trainer steps and wall time, mean reward over the stage (RL) or final loss (SFT), held-out accuracy of
the stage's export on each entry (the stage's `evaluation`) beside the stage's start (marked ▼ when the
export is worse), the stage's learning-health alarms and rollbacks (alarms.jsonl, zrl/pipeline/health.py;
the row is shaded), the LZ77 canary, the engine/trainer mismatch, staleness of trained tokens, what it
took from the previous stage and what it handed on. A figure of the reward over the whole cascade (stage
boundaries dotted, alarms in red) heads the page and each stage's summary PNG follows its row; images are
embedded, so the page is one self-contained file.
"""

import base64
import html
import io
import json
import logging
import math
from pathlib import Path

from zrl.pipeline.health import read_alarms
from zrl.pipeline.held_out import POLICY_VERSION
from zrl.plots import _number, stage_rows
from zrl.run_dir import RunDir

log = logging.getLogger("zrl")



def _values(rows: list[dict], name: str) -> list[float]:
    return [v for r in rows if (v := _number(r.get(name))) is not None and math.isfinite(v)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def held_out_start(rows: list[dict], first_step: int) -> dict[str, float]:
    """Entry -> held-out accuracy of the policy the stage started from (its in-training evaluation at its
    first step's policy version; none without `evaluation.every_steps`)."""
    for row in rows:
        if _number(row.get(POLICY_VERSION)) == float(first_step):
            return {k.split("/")[1]: a for k, v in row.items()
                    if k.startswith("eval/") and k.endswith("/accuracy") and (a := _number(v)) is not None}
    return {}


def stage_summary(record: dict, rows: list[dict], alarms: list[dict] = ()) -> dict:
    """The report's numbers for one stage (also what tests read); `alarms`: the run's (alarms.jsonl)."""
    return {
        "stage": record["stage"], "steps": f"{record['first_step'] + 1}-{record['last_step']}",
        "wall_s": record.get("wall_s"),
        "reward_mean": _mean(_values(rows, "reward/mean")),
        "sft_loss_final": (_values(rows, "loss/sft") or [None])[-1],
        "held_out": {k: v["accuracy"] for k, v in (record.get("evaluation") or {}).items()},
        "held_out_start": held_out_start(rows, record["first_step"]),
        "alarms": [a for a in alarms if a["stage"] == record["stage"]],
        "lz77_flagged": _mean(_values(rows, "canary/lz77_flagged_fraction")),
        "mismatch_kl": _mean(_values(rows, "mismatch/kl_k3")),
        "staleness_mean": _mean(_values(rows, "staleness/mean")),
        "staleness_max": max(_values(rows, "staleness/max"), default=None),
    }


def _held_out_cell(entry: str, end: float, start: float | None) -> str:
    """`entry: 0.350 → 0.412`, marked ▼ (red) when the export is below the stage's start."""
    end_text = _fmt(end if math.isfinite(end) else None)
    if start is None:
        return f"{html.escape(entry)}: {end_text}"
    worse = math.isfinite(end) and end < start
    text = f"{html.escape(entry)}: {_fmt(start)} → {end_text}"
    return f"<span style='color:#b00'>{text} ▼</span>" if worse else text


def _reward_figure(metrics_path: Path, records: list[dict], alarms: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for record in records:
        rows = stage_rows(metrics_path, record["index"])
        points = [(int(r["step"]), v) for r in rows if (v := _number(r.get("reward/mean"))) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=2, linewidth=1.2, label=record["stage"])
        ax.axvline(record["last_step"] + 0.5, color="grey", linewidth=0.6, linestyle=":")
    for alarm in alarms:
        ax.axvline(alarm["step"], color="#c00", linewidth=0.8, alpha=0.6)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_title("reward over the cascade (dotted: stage ends; red: alarms)" if alarms else
                 "reward over the cascade (dotted: stage ends)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}" style="max-width:100%">'


def write_cascade_report(run_dir: str | Path, title: str) -> Path | None:
    """Write `<run_dir>/cascade_report.html` from the finished stages' records; None when none finished."""
    run_dir = Path(run_dir)
    layout = RunDir(run_dir)
    paths = layout.stage_records()
    records = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["index"])
    if not records:
        log.warning("no finished stage in %s: no cascade report", run_dir)
        return None
    metrics_path = layout.metrics
    has_metrics = metrics_path.is_file()
    head = ("stage", "steps", "wall time", "reward (mean) / SFT loss", "held-out accuracy: start → export",
            "alarms", "LZ77 flagged", "mismatch k3", "staleness mean / max", "inherited", "handed on")
    alarms = read_alarms(layout.alarms)
    parts = [f"<h1>{html.escape(title)}</h1>", f"<p>run directory: <code>{html.escape(str(run_dir))}</code></p>"]
    if has_metrics:
        parts.append(_img(_reward_figure(metrics_path, records, alarms), "reward over the cascade"))
    parts.append("<table border=1 cellpadding=4 style='border-collapse:collapse'><tr>"
                 + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    figures = []
    for record in records:
        s = stage_summary(record, stage_rows(metrics_path, record["index"]) if has_metrics else [], alarms)
        reward = (_fmt(s["reward_mean"]) if s["reward_mean"] is not None else f"loss {_fmt(s['sft_loss_final'])}")
        held_out = "<br>".join(_held_out_cell(k, v, s["held_out_start"].get(k)) for k, v in s["held_out"].items()) or "–"
        marks = "<br>".join(f"step {a['step']} {html.escape(a['signal'])}: {html.escape(a['message'])}"
                            for a in s["alarms"][:5]) + (f"<br>+{len(s['alarms']) - 5} more" if len(s["alarms"]) > 5 else "")
        inherited = record.get("inherited") or {}
        sources = inherited.get("length_reward_frontier")
        took = [f"p* of {len(sources)} data source(s)"] if sources else []
        took += [f"curriculum of {', '.join(inherited['curriculum'])}"] if inherited.get("curriculum") else []
        handed = [f"self-rollouts {k}" for k in record.get("self_rollouts") or {}]
        wall = "–" if s["wall_s"] is None else f"{s['wall_s']:.0f} s"
        cells = (s["stage"], s["steps"], wall, reward, held_out, marks or "–", _fmt(s["lz77_flagged"]),
                 _fmt(s["mismatch_kl"], 5), f"{_fmt(s['staleness_mean'], 2)} / {_fmt(s['staleness_max'], 0)}",
                 html.escape("; ".join(took)) or "–", html.escape("; ".join(handed)) or "–")
        style = " style='background:#fdd'" if s["alarms"] else ""
        parts.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        png = record.get("summary_png")
        if png and Path(png).is_file():
            figures.append(f"<h2>{html.escape(record['stage'])}</h2>"
                           + _img(base64.b64encode(Path(png).read_bytes()).decode(), record["stage"]))
    parts.append("</table>")
    out = layout.cascade_report
    out.write_text("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(title)
                   + "</title></head><body style='font-family:sans-serif'>" + "\n".join(parts + figures)
                   + "</body></html>\n")
    return out
