"""Adaptive difficulty: keep every environment near a 0.5 solve rate, and spread groups over environments.

Responsibility: for environments that take an integer difficulty level, decide which level to generate
the next group of problems at, so that the policy solves about half of them (the online difficulty
scheduler of the ZAYA1 report's second RL stage), and which environment the next group comes from.
Pure Python/numpy: no Ray, no I/O; the caller owns where the state lives, feeds back verified groups
as (environment, difficulty, successes, group size) and saves `state_dict()` with its checkpoints.

- `scheduler`: `SchedulerConfig` and `DifficultyScheduler`, one environment's Thompson-sampling
  scheduler over a logistic pass-rate model (the model and its invariants are described there).
- `selection`: `Curriculum`, one scheduler per environment name and the least-sampled-first choice of
  the next environment; `Proposal`, what it hands out.
"""

from zrl.curriculum.scheduler import DifficultyScheduler, SchedulerConfig
from zrl.curriculum.selection import Curriculum, Proposal

__all__ = ["Curriculum", "DifficultyScheduler", "Proposal", "SchedulerConfig"]
