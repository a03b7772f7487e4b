"""Adaptive-difficulty scheduler: decisions per second for 400 environments, and accuracy on simulated learners.

Throughput: a `Curriculum` of --envs environments (levels 0..120, default SchedulerConfig) is driven for
--rounds x --envs groups; every environment has a simulated learner that solves level d with probability
sigmoid(-(d - mu*) / s*) (mu* uniform in 0..100, s* log-uniform in 0.5..10) and a group of G = 16 returns
k ~ Binomial(G, p). One decision = `next()` (pick an environment, propose its difficulty) + `report()`
(update its scheduler). Only those two calls are timed; the baseline in the same run is a fixed-difficulty
sampler (uniform environment, constant level, report just counts) behind the same calls. The first half of
the rounds warms the pools and histories up; decisions/s is printed for the second half too (steady state:
full histories, so every resample re-weights against them).

Accuracy (--accuracy): over seeds 0..9, |posterior-mean mu - mu*| after N groups for mu* in {0, 20, 50, 100}
and s* in {0.5, 3, 10}; the tracking lag when mu* jumps 20 -> 50 (or regresses 50 -> 20) after 60 groups
(groups until the estimate is within max(2, s*/2) of the new mu* and stays there for the remaining groups
of 100); and the lag behind a learner that improves steadily (mu* = 20 + 0.3 (t - 30) from group 30 to
group 130): the mean of mu*(t) - crossing(t) over the last 50 groups (in levels; / 0.3 = in groups).

Usage: .venv/bin/python bench/curriculum_scheduler.py [--envs 400] [--rounds 40] [--seed 0] [--accuracy]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import time

import numpy as np

from zrl.curriculum import Curriculum, DifficultyScheduler, Proposal, SchedulerConfig

G = 16
LEVELS = SchedulerConfig(min_level=0, max_level=120)


class FixedUniformSampler:
    """The baseline: a uniformly drawn environment at one fixed level; reports are only counted."""

    def __init__(self, names: list[str], level: int, seed: int):
        self.names, self.level = names, level
        self._rng = np.random.default_rng(seed)
        self.solved = dict.fromkeys(names, 0)

    def next(self) -> Proposal:
        return Proposal(self.names[self._rng.integers(len(self.names))], self.level)

    def report(self, environment: str, difficulty: int, successes: int, group_size: int) -> bool:
        self.solved[environment] += successes
        return True


def pass_rate(level: float, mu_star: float, s_star: float) -> float:
    return 1.0 / (1.0 + math.exp((level - mu_star) / s_star))


def drive(sampler, learners: dict[str, tuple[float, float]], decisions: int, seed: int) -> list[float]:
    """Seconds spent in next() + report() for each decision."""
    rng = np.random.default_rng(seed)
    spent = []
    for _ in range(decisions):
        start = time.perf_counter()
        proposal = sampler.next()
        chosen = time.perf_counter()
        k = int(rng.binomial(G, pass_rate(proposal.difficulty, *learners[proposal.environment])))
        resumed = time.perf_counter()
        sampler.report(proposal.environment, proposal.difficulty, k, G)
        spent.append(chosen - start + time.perf_counter() - resumed)
    return spent


def throughput(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    names = [f"env{i:03d}" for i in range(args.envs)]
    learners = {name: (float(rng.uniform(0, 100)), float(np.exp(rng.uniform(math.log(0.5), math.log(10)))))
                for name in names}
    decisions = args.rounds * args.envs
    curriculum = Curriculum(dict.fromkeys(names, LEVELS), seed=args.seed)
    baseline = FixedUniformSampler(names, level=50, seed=args.seed)
    rows = [("curriculum", drive(curriculum, learners, decisions, args.seed)),
            ("fixed_uniform", drive(baseline, learners, decisions, args.seed))]

    print(f"device: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}; {datetime.date.today()}")
    print(f"{args.envs} environments x {args.rounds} groups each = {decisions} decisions (next + report), "
          f"pool {LEVELS.pool_size}, history <= {LEVELS.history_size}")
    print(f"{'sampler':<15}{'decisions/s':>14}{'2nd half /s':>14}{'median us':>11}{'p99 us':>9}")
    rates = {}
    for name, spent in rows:
        rates[name] = len(spent) / sum(spent)
        late = spent[len(spent) // 2:]
        print(f"{name:<15}{rates[name]:>14,.0f}{len(late) / sum(late):>14,.0f}"
              f"{statistics.median(spent) * 1e6:>11.1f}{np.percentile(spent, 99) * 1e6:>9.1f}")
    print(f"fixed_uniform / curriculum decisions per second: {rates['fixed_uniform'] / rates['curriculum']:.1f}x")
    calibrated = len(names) - len(curriculum.uncalibrated())
    errors = [abs(curriculum.schedulers[n].crossing - learners[n][0]) for n in names]
    summaries = [curriculum.schedulers[n].summary() for n in names]
    resample_share = sum(s["resamples"] for s in summaries) / sum(s["groups"] for s in summaries)
    print(f"after the run: {calibrated}/{len(names)} environments calibrated; |crossing - mu*| median "
          f"{statistics.median(errors):.2f}, p90 {np.percentile(errors, 90):.2f} levels; "
          f"{resample_share:.0%} of updates resampled the pool")


def simulate(mu_star: float, s_star: float, groups: int, seed: int, shift=None) -> list[float]:
    scheduler = DifficultyScheduler(LEVELS, seed)
    rng = np.random.default_rng(10_000 + seed)
    crossings = []
    for t in range(groups):
        mu = mu_star if shift is None or t < shift[0] else shift[1]
        level = scheduler.level()
        scheduler.update(level, int(rng.binomial(G, pass_rate(level, mu, s_star))), G)
        crossings.append(scheduler.crossing)
    return crossings


def simulate_drift(s_star: float, seed: int, groups: int = 130) -> list[float]:
    scheduler = DifficultyScheduler(LEVELS, seed)
    rng = np.random.default_rng(10_000 + seed)
    crossings = []
    for t in range(groups):
        level = scheduler.level()
        mu = 20 + 0.3 * max(t - 30, 0)
        scheduler.update(level, int(rng.binomial(G, pass_rate(level, mu, s_star))), G)
        crossings.append(scheduler.crossing)
    return crossings


def accuracy() -> None:
    seeds = range(10)
    print("|posterior-mean mu - mu*| over seeds 0..9, median / max, per mu* in (0, 20, 50, 100):")
    for s_star in (0.5, 3.0, 10.0):
        for groups in (30, 60):
            cells = []
            for mu_star in (0.0, 20.0, 50.0, 100.0):
                errors = [abs(simulate(mu_star, s_star, groups, seed)[-1] - mu_star) for seed in seeds]
                cells.append(f"{statistics.median(errors):.2f} / {max(errors):.2f}")
            print(f"  s* {s_star:>4}  N {groups:>3}:  " + "   ".join(cells))
    for before, after in ((20.0, 50.0), (50.0, 20.0)):
        print(f"tracking lag (groups) after mu* jumps {before:.0f} -> {after:.0f} at group 60, seeds 0..9:")
        for s_star in (0.5, 3.0, 10.0):
            tolerance = max(2.0, s_star / 2)
            lags = []
            for seed in seeds:
                crossings = simulate(before, s_star, 160, seed, shift=(60, after))
                settled = next((t for t in range(60, 160)
                                if all(abs(c - after) <= tolerance for c in crossings[t:])), 160)
                lags.append(settled - 60 + 1)
            print(f"  s* {s_star:>4}  tolerance {tolerance:.1f}:  median {statistics.median(lags):.1f}, "
                  f"max {max(lags)}  ({', '.join(map(str, lags))})")
    print("steady improvement mu* = 20 + 0.3 (t - 30) from group 30: mean mu* - crossing over groups 80..129:")
    for s_star in (0.5, 3.0, 10.0):
        behind = [statistics.mean(20 + 0.3 * (t - 30) - c for t, c in enumerate(simulate_drift(s_star, seed))
                                  if t >= 80) for seed in seeds]
        print(f"  s* {s_star:>4}:  median {statistics.median(behind):.2f}, max {max(behind):.2f} levels")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=40, help="groups per environment")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--accuracy", action="store_true", help="also print the simulated-learner accuracy table")
    args = ap.parse_args()
    throughput(args)
    if args.accuracy:
        accuracy()


if __name__ == "__main__":
    main()
