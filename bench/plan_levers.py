"""The scheduling levers tried on the ZAYA1-8B plan (bench/plan_zaya1.py's stage and workload) at one
rollout:trainer ratio: each row changes one thing against the report's policy (staleness <= 2, sync
every 2 steps, 2 ready batches) and prints async steps/hour, the speedup over the synchronous baseline
(unchanged: `synchronous_variant`, sync every step), idle fractions, evictions and the staleness of
trained tokens (by their rollout's oldest token, the bound; and by each token's own version).

Rows that are not a zrl setting are marked: "no sync cost" (sync_s 0) bounds what syncing only idle
workers, or never stopping the engines for a sync, could gain; "one batch over pacing" raises the
buffer's queue limit by a batch (BatchQueue.queue_limit patched in this process only), as systems that
keep more groups in flight than the staleness bound lets them train do.

    .venv/bin/python bench/plan_levers.py [--steps 200] [--ratio 3]
"""

import argparse
import contextlib

from plan_zaya1 import TRAINER_GPUS, zaya1_stage

from zrl.buffer import BatchQueue
from zrl.config.schema import RLStage
from zrl.plan import simulate
from zrl.plan.report import WorkloadSpec
from zrl.plan.simulator import synchronous_variant


@contextlib.contextmanager
def over_pacing(batches: int):
    """The buffer lets `batches` more batches be queued or in flight than its pacing rule (this process)."""
    limit = BatchQueue.queue_limit

    def patched(self, generating_version):
        return min(limit(self, generating_version) + batches * self.batch_groups, self.capacity_groups)

    BatchQueue.queue_limit = patched
    try:
        yield
    finally:
        BatchQueue.queue_limit = limit


def with_asynchrony(stage: RLStage, **fields) -> RLStage:
    data = stage.model_dump()
    data["asynchrony"].update(fields)
    return RLStage.model_validate(data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ratio", type=int, default=3)
    args = parser.parse_args()
    report = zaya1_stage(args.steps, sync_every_steps=2)
    every_step = with_asynchrony(report, sync_every_steps=1)
    spec = WorkloadSpec()
    workers = args.ratio * TRAINER_GPUS
    rows = [("report's policy: sync every 2 steps", report, spec, 0),
            ("no sync cost (bound for subset/non-stopping syncs)", report, spec.model_copy(update={"sync_s": 0.0}), 0),
            ("round 0.1 s (a sync interrupts groups sooner)", report, spec.model_copy(update={"round_s": 0.1}), 0),
            ("one batch over pacing (not a setting)", report, spec, 1),
            ("sync every step (zrl's default)", every_step, spec, 0),
            ("sync every step, no sync cost", every_step, spec.model_copy(update={"sync_s": 0.0}), 0),
            ("sync every step, one batch over pacing", every_step, spec, 1),
            ("sync every step, min_ready_batches 1", with_asynchrony(every_step, min_ready_batches=1), spec, 0)]
    sync = simulate(synchronous_variant(report), spec.build(report, TRAINER_GPUS), workers)
    print(f"ZAYA1-8B plan, {workers} rollout : {TRAINER_GPUS} trainer GPUs, {args.steps} steps; synchronous baseline "
          f"{sync.steps_per_hour:.2f} steps/h")
    print(f"{'lever':52s}{'steps/h':>8s}{'vs sync':>8s}{'roll idle':>10s}{'evicted':>13s}  staleness: rollout | token")
    for label, stage, workload_spec, extra in rows:
        with over_pacing(extra):
            r = simulate(stage, workload_spec.build(stage, TRAINER_GPUS), workers)
        histogram = lambda h: " ".join(f"{k}:{100 * v:.0f}%" for k, v in h.items())  # noqa: E731
        print(f"{label:52s}{r.steps_per_hour:8.2f}{r.steps_per_hour / sync.steps_per_hour:7.2f}x"
              f"{100 * r.rollout_idle_frac:9.0f}%{r.evicted:6d} ({100 * r.evicted / r.buffer_counts['admitted']:3.0f}%)"
              f"  {histogram(r.staleness_tokens)} | {histogram(r.token_staleness)}")


if __name__ == "__main__":
    main()
