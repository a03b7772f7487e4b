"""The curriculum over environments: one difficulty scheduler each, and which environment goes next.

`Curriculum.next()` picks environment e with weight exp(-(n_e - min n) / selection_temperature), n_e
the groups proposed for e so far, so the least-sampled environments are the most likely and the counts
stay within a few groups of each other; it then asks e's scheduler for a difficulty.

Invariants: each environment's scheduler draws from its own generator, seeded from (seed, name), so
adding an environment changes no other scheduler's draws; the same seed and calls give the same
decisions; `state_dict()` is JSON-serialisable and `load_state_dict()` of it continues identically. A
state saved with other environments or settings is refused with a one-line error.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zrl.curriculum.scheduler import STATE_VERSION, DifficultyScheduler, SchedulerConfig, check_version


@dataclass(frozen=True)
class Proposal:
    environment: str
    difficulty: int


class Curriculum:
    """One scheduler per environment, and the choice of the next environment (least-sampled most likely)."""

    def __init__(self, environments: Mapping[str, SchedulerConfig], seed: int, selection_temperature: float = 1.0):
        if not environments:
            raise ValueError("environments: must name at least one environment")
        if not (math.isfinite(selection_temperature) and selection_temperature > 0):
            raise ValueError(f"selection_temperature: must be finite and > 0 (got {selection_temperature})")
        self.names = sorted(environments)
        self.seed = seed
        self.selection_temperature = selection_temperature
        self._rng = np.random.default_rng(seed)
        # each environment's generator hangs off (seed, name): adding an environment changes no other's draws
        self.schedulers = {name: DifficultyScheduler(environments[name],
                                                     np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
                           for name in self.names}
        self._counts = np.zeros(len(self.names), dtype=np.int64)

    def next(self, among: Sequence[str] | None = None) -> Proposal:
        """Pick an environment (least-sampled most likely; from `among` only, when given) and hand out its
        current difficulty."""
        index = np.arange(len(self.names)) if among is None else np.array([self.names.index(a) for a in among])
        counts = self._counts[index]
        weights = np.exp(-(counts - counts.min()) / self.selection_temperature)
        i = index[self._rng.choice(len(index), p=weights / weights.sum())]
        self._counts[i] += 1
        name = self.names[i]
        return Proposal(name, self.schedulers[name].level())

    def report(self, environment: str, difficulty: int, successes: int, group_size: int) -> bool:
        """A verified group came back; False when its difficulty is stale (then nothing changes)."""
        if environment not in self.schedulers:
            raise KeyError(f"environment: unknown {environment!r}; known: {', '.join(self.names)}")
        return self.schedulers[environment].update(difficulty, successes, group_size)

    @property
    def calibrated(self) -> bool:
        return all(s.calibrated for s in self.schedulers.values())

    def uncalibrated(self) -> list[str]:
        return [name for name in self.names if not self.schedulers[name].calibrated]

    def groups_proposed(self) -> dict[str, int]:
        return dict(zip(self.names, self._counts.tolist()))

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "seed": self.seed, "selection_temperature": self.selection_temperature,
                "rng": self._rng.bit_generator.state, "counts": self.groups_proposed(),
                "schedulers": {name: s.state_dict() for name, s in self.schedulers.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        check_version(state)
        if sorted(state["schedulers"]) != self.names:
            missing = sorted(set(self.names) ^ set(state["schedulers"]))
            raise ValueError(f"state.schedulers: environments differ from this curriculum's: {', '.join(missing)}")
        if state["selection_temperature"] != self.selection_temperature:
            raise ValueError(f"state.selection_temperature: saved {state['selection_temperature']!r}, "
                             f"this curriculum has {self.selection_temperature!r}")
        self._rng.bit_generator.state = state["rng"]
        self._counts = np.array([state["counts"][name] for name in self.names], dtype=np.int64)
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][name])
