"""ZAYA1-8B at production scale on the planner: 128 prompts x G=16 per step, the report's warm-up
lengths (median 17.6K, p90 30K, at most 81,920 tokens), staleness <= 2, sync every 2 steps, 16
trainer GPUs and rollout pools of 1-5x, async vs sync. The workload is WorkloadSpec's defaults
(zrl/plan/report.py; every assumption is written out in bench/results/plan_zaya1.md).

Each ratio is simulated async and sync; then one 1,000-step plan is timed on one CPU core.

    .venv/bin/python bench/plan_zaya1.py [--steps 200] [--plot bench/results/plan_zaya1.png]
"""

import argparse
import time

from zrl.config.schema import RLStage
from zrl.plan import simulate
from zrl.plan.report import WorkloadSpec, format_sweep, knee, plan_point, plot_sweep

TRAINER_GPUS = 16
RATIOS = (1, 2, 3, 4, 5)


def zaya1_stage(steps: int) -> RLStage:
    # The schema's defaults are the ZAYA1-8B production values (128 x 16, staleness 2, sync every 2 steps,
    # 2 ready batches, capacity 4, responses up to 81,920 tokens).
    return RLStage(name="zaya1_rl", steps=steps, environments=[{"name": "math"}])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timed-steps", type=int, default=1000)
    parser.add_argument("--plot", default="bench/results/plan_zaya1.png")
    args = parser.parse_args()
    stage, spec = zaya1_stage(args.steps), WorkloadSpec()
    w = spec.build(stage, TRAINER_GPUS)
    print(f"trainer: {w.trainer.tokens_per_s:.3g} tokens/s (dense part) over {TRAINER_GPUS} GPUs; "
          f"engine at 128 sequences x 10K context: {w.engine.tokens_per_s(128, 128 * 10_000):.0f} tokens/s")
    points = [plan_point(stage, spec, rollout_gpus=r * TRAINER_GPUS, trainer_gpus=TRAINER_GPUS,
                         gpus_per_rollout_worker=1, steps=args.steps) for r in RATIOS]
    print(f"\n== {args.steps} steps ==\n{format_sweep(points)}")
    for p in points:
        a = p.async_result
        print(f"  ratio {p.ratio:g}: staleness of trained tokens "
              f"{ {k: round(v, 3) for k, v in a.staleness_tokens.items()} }, evicted {a.evicted}, "
              f"peak KV tokens/worker {a.peak_kv_tokens_per_worker:.3g}, sync mode: "
              f"{p.sync_result.steps_per_hour:.2f} steps/h")
    print(f"plot: {plot_sweep(points, args.plot, 'ZAYA1-8B, 16 trainer H100s')}")
    best = knee(points)
    for mfu in (0.15, 0.40):
        p = plan_point(stage, spec.model_copy(update={"trainer_mfu": mfu}), rollout_gpus=int(best.ratio * TRAINER_GPUS),
                       trainer_gpus=TRAINER_GPUS, gpus_per_rollout_worker=1, steps=args.steps)
        print(f"MFU {mfu:.0%} at ratio {best.ratio:g}: async {p.async_result.steps_per_hour:.2f} steps/h, sync "
              f"{p.sync_result.steps_per_hour:.2f}, speedup {p.speedup:.2f}x, trainer idle "
              f"{100 * p.async_result.trainer_idle_frac:.0f}%")
    timed = zaya1_stage(args.timed_steps)
    start, cpu = time.perf_counter(), time.process_time()
    r = simulate(timed, spec.build(timed, TRAINER_GPUS), 3 * TRAINER_GPUS)
    print(f"{args.timed_steps}-step async plan, 48 rollout workers: {time.perf_counter() - start:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU ({r.buffer_counts['received']} groups through the buffer; "
          f"{r.simulated_s / 3600:.0f} simulated hours)")

if __name__ == "__main__":
    main()
