"""ZAYA1-8B at production scale on the planner: 128 prompts x G=16 per step, the report's warm-up
lengths (median 17.6K, p90 30K, at most 81,920 tokens), staleness <= 2, 16 trainer GPUs and rollout
pools of 1-5x, async vs sync, for both weight-sync cadences (SYNC_CADENCES: every step, zrl's
default, and every 2 steps, the report's). The workload is WorkloadSpec's defaults
(zrl/plan/report.py; every assumption is written out in bench/results/plan_zaya1.md).

Each ratio is simulated async and sync; then one 1,000-step plan is timed on one CPU core.
`--time` only times one async plan of `--steps` steps on the recipe's 48 rollout workers; with
`--baseline DIR` the same plan is also timed with the zrl package found in DIR (e.g. an earlier commit
unpacked by `git archive`), in a subprocess, and the ratio and whether both plans agree are printed
(a digest of every field of the result, per-step rows included).

    .venv/bin/python bench/plan_zaya1.py [--steps 200] [--plot bench/results/plan_zaya1.png]
    .venv/bin/python bench/plan_zaya1.py --time --steps 1000 [--baseline DIR]
"""

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

from zrl.config.schema import RLStage
from zrl.plan import simulate
from zrl.plan.report import WorkloadSpec, format_sweep, knee, plan_point, plot_sweep

TRAINER_GPUS = 16
PLAN_COUNTERS = ("received", "dropped_zero_signal", "admitted", "released", "released_batches",
                 "evicted_capacity", "evicted_stale", "buffered")
RATIOS = (1, 2, 3, 4, 5)
SYNC_CADENCES = (1, 2)   # asynchrony.sync_every_steps: zrl's default, the ZAYA1-8B report's


def zaya1_stage(steps: int, sync_every_steps: int = 1) -> RLStage:
    # The schema's defaults are the ZAYA1-8B production values (128 x 16, staleness 2, 2 ready batches,
    # capacity 4, responses up to 81,920 tokens) but the sync cadence (the report's is every 2 steps).
    return RLStage(name="zaya1_rl", steps=steps, environments=[{"name": "math"}],
                   asynchrony={"sync_every_steps": sync_every_steps})


def timed_plan(steps: int) -> dict:
    """Wall and CPU seconds of one async plan on 48 rollout workers, and a digest of its whole result."""
    stage = zaya1_stage(steps)
    workload = WorkloadSpec().build(stage, TRAINER_GPUS)
    start, cpu = time.perf_counter(), time.process_time()
    r = simulate(stage, workload, 3 * TRAINER_GPUS)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall_s, "cpu_s": cpu_s, "groups": r.buffer_counts["received"],
            "simulated_h": r.simulated_s / 3600,
            "digest": result_digest(r)}


def result_digest(r) -> str:
    """A digest of every field of a plan's result, per-step rows included; of the buffer's counters only
    those every version of the planner reports (earlier ones passed all of RolloutBuffer.counts)."""
    fields = dataclasses.asdict(r)
    fields.pop("token_staleness", None)  # added with the per-token histogram; earlier planners lack it
    fields["buffer_counts"] = {k: fields["buffer_counts"][k] for k in PLAN_COUNTERS}
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def time_plans(steps: int, baseline: str | None) -> None:
    def show(label: str, t: dict) -> None:
        print(f"{label}: {steps}-step async plan, 48 rollout workers: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU "
              f"({t['groups']} groups through the buffer; {t['simulated_h']:.0f} simulated hours; digest {t['digest']})")

    if baseline is not None:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(baseline)}
        out = subprocess.run([sys.executable, __file__, "--time", "--json", "--steps", str(steps)], env=env,
                             check=True, capture_output=True, text=True).stdout
        before = json.loads(out.splitlines()[-1])
        show(f"baseline ({baseline})", before)
    now = timed_plan(steps)
    show("this tree", now)
    if baseline is not None:
        print(f"speedup: {before['wall_s'] / now['wall_s']:.1f}x wall, {before['cpu_s'] / now['cpu_s']:.1f}x CPU; "
              f"results {'identical' if before['digest'] == now['digest'] else 'DIFFER'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timed-steps", type=int, default=1000)
    parser.add_argument("--plot", default="bench/results/plan_zaya1.png")
    parser.add_argument("--time", action="store_true", help="only time one async plan of --steps steps")
    parser.add_argument("--baseline", help="with --time: also time the plan with the zrl package in this folder")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the baseline subprocess's answer
    args = parser.parse_args()
    if args.json:
        print(json.dumps(timed_plan(args.steps)))
        return
    if args.time:
        time_plans(args.steps, args.baseline)
        return
    spec = WorkloadSpec()
    w = spec.build(zaya1_stage(args.steps), TRAINER_GPUS)
    print(f"trainer: {w.trainer.tokens_per_s:.3g} tokens/s (dense part) over {TRAINER_GPUS} GPUs; "
          f"engine at 128 sequences x 10K context: {w.engine.tokens_per_s(128, 128 * 10_000):.0f} tokens/s")
    for cadence in SYNC_CADENCES:
        sweep(zaya1_stage(args.steps, cadence), spec, args.steps, args.plot if cadence == SYNC_CADENCES[0] else None)
    time_plans(args.timed_steps, None)


def sweep(stage: RLStage, spec: WorkloadSpec, steps: int, plot: str | None) -> None:
    """The ratio sweep of one stage: the table, each ratio's staleness and KV peak, the trainer's MFU at the knee."""
    points = [plan_point(stage, spec, rollout_gpus=r * TRAINER_GPUS, trainer_gpus=TRAINER_GPUS,
                         gpus_per_rollout_worker=1, steps=steps) for r in RATIOS]
    cadence = stage.asynchrony.sync_every_steps
    print(f"\n== {steps} steps, weight sync every {cadence} step(s) ==\n{format_sweep(points)}")
    for p in points:
        a = p.async_result
        print(f"  ratio {p.ratio:g}: staleness of trained tokens by their rollout's oldest token "
              f"{ {k: round(v, 3) for k, v in a.staleness_tokens.items()} }, by their own version "
              f"{ {k: round(v, 3) for k, v in a.token_staleness.items()} }, evicted {a.evicted} of "
              f"{a.buffer_counts['admitted']} admitted, syncs {a.syncs}, "
              f"peak KV tokens/worker {a.peak_kv_tokens_per_worker:.3g}, sync mode: "
              f"{p.sync_result.steps_per_hour:.2f} steps/h")
    if plot:
        print(f"plot: {plot_sweep(points, plot, 'ZAYA1-8B, 16 trainer H100s')}")
    best = knee(points)
    for mfu in (0.15, 0.40):
        p = plan_point(stage, spec.model_copy(update={"trainer_mfu": mfu}), rollout_gpus=int(best.ratio * TRAINER_GPUS),
                       trainer_gpus=TRAINER_GPUS, gpus_per_rollout_worker=1, steps=steps)
        print(f"MFU {mfu:.0%} at ratio {best.ratio:g}: async {p.async_result.steps_per_hour:.2f} steps/h, sync "
              f"{p.sync_result.steps_per_hour:.2f}, speedup {p.speedup:.2f}x, trainer idle "
              f"{100 * p.async_result.trainer_idle_frac:.0f}%")
    for sync_s in (30.0, 60.0):
        p = plan_point(stage, spec.model_copy(update={"sync_s": sync_s}), rollout_gpus=3 * TRAINER_GPUS,
                       trainer_gpus=TRAINER_GPUS, gpus_per_rollout_worker=1, steps=steps)
        print(f"sync {sync_s:g} s at ratio 3: async {p.async_result.steps_per_hour:.2f} steps/h, sync "
              f"{p.sync_result.steps_per_hour:.2f}, speedup {p.speedup:.2f}x")


if __name__ == "__main__":
    main()
