"""Plan a cluster before renting it: the RL stage's own scheduling on a simulated clock.

`simulate` (simulator.py) drives the real `StageSchedule` and the buffer's `BatchQueue` with simulated
rollout workers, trainer and weight syncs whose timings come from workload models (workload.py: response
lengths, continuous-batching decode, trainer FLOPs or measured rates, sync seconds); report.py sweeps
rollout:trainer ratios, compares asynchronous with synchronous mode, prints tables and draws the plot
behind `zrl plan`.

Invariants: nothing here re-implements a scheduling decision (admission credit, round launching, the
training trigger, sync cadence, eviction and staleness are the loop's own objects); no Ray, vLLM or
torch call is made (importing zrl.buffer still imports torch today, through zrl.algorithms and
zrl.canaries, which load their torch parts eagerly); a plan is deterministic given its seed.
"""

from zrl.plan.simulator import PlanResult, simulate, synchronous_variant
from zrl.plan.workload import DecodeModel, ResponseLengths, TrainerModel, Workload

__all__ = ["DecodeModel", "PlanResult", "ResponseLengths", "TrainerModel", "Workload", "simulate",
           "synchronous_variant"]
