"""Does a recipe learn on every seed? Runs `zrl run RECIPE --set seed=S` for each seed and tabulates the
held-out accuracy of each stage's export from the stage records (the recipe's `evaluation` blocks: the
SFT stage's export is the policy RL starts from, the RL stage's export what it ends with).

    python bench/recipe_seeds.py recipes/tiny-tools-cpu.yaml --seeds 0 1 2 --out /tmp/seeds

prints one row per seed (before RL, after RL, the difference, alarms, wall time) and the mean and range,
and appends the table to `--markdown` when given. A run that fails or does not learn is a row like any
other. Runs one after another (one engine and trainer pool at a time on a small machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stage_accuracies(run_dir: Path) -> list[tuple[str, str, float]]:
    """(stage, entry, held-out accuracy of the stage's export) in stage order."""
    records = sorted((json.loads(p.read_text()) for p in run_dir.glob("stages/*/stage.json")),
                     key=lambda r: r["index"])
    return [(r["stage"], entry, v["accuracy"]) for r in records for entry, v in (r.get("evaluation") or {}).items()]


def run_seed(recipe: Path, seed: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{recipe.stem}-seed{seed}"
    start = time.perf_counter()
    cmd = [str(ROOT / ".venv/bin/zrl"), "run", str(recipe), "--set", f"seed={seed}", "--set",
           f"output_dir={run_dir}", *extra]
    with (out / f"{recipe.stem}-seed{seed}.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    accuracies = stage_accuracies(run_dir)
    alarms = (run_dir / "alarms.jsonl").read_text().count("\n") if (run_dir / "alarms.jsonl").is_file() else 0
    return {"seed": seed, "code": code, "wall_s": time.perf_counter() - start, "stages": accuracies,
            "alarms": alarms}


def table(recipe: Path, rows: list[dict]) -> str:
    lines = [f"### {recipe.name}", "", "| seed | exit | " + " | ".join(
        f"{stage} ({entry})" for stage, entry, _ in rows[0]["stages"]) + " | RL - SFT | alarms | wall |",
        "|---" * (len(rows[0]["stages"]) + 5) + "|"]
    gains = []
    for row in rows:
        values = [a for _, _, a in row["stages"]]
        gain = values[-1] - values[-2] if len(values) >= 2 else float("nan")
        gains.append(gain)
        lines.append(f"| {row['seed']} | {row['code']} | " + " | ".join(f"{v:.3f}" for v in values)
                     + f" | {gain:+.3f} | {row['alarms']} | {row['wall_s'] / 60:.1f} min |")
    columns = list(zip(*[[a for _, _, a in row["stages"]] for row in rows if len(row["stages"]) == len(rows[0]["stages"])]))
    summary = [f"{sum(c) / len(c):.3f} [{min(c):.3f}, {max(c):.3f}]" for c in columns]
    if summary:
        lines.append("| mean [range] | | " + " | ".join(summary) + f" | {sum(gains) / len(gains):+.3f} | | |")
    lines.append(f"\nRL export above its SFT export on {sum(g > 0 for g in gains)} of {len(gains)} seeds.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True, help="where the run directories and logs go")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument("--set", action="append", default=[], help="extra recipe overrides (as zrl run)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = [x for s in args.set for x in ("--set", s)]
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(args.recipe, seed, args.out, extra))
        print(json.dumps(rows[-1]), flush=True)
    text = table(args.recipe, rows)
    print(text)
    if args.markdown is not None:
        with args.markdown.open("a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
