"""One environment's adaptive difficulty: a Thompson-sampling scheduler over a logistic pass-rate model.

The model. The policy's pass rate at level d is the logistic item-response curve
p(d) = sigmoid(-(d - mu) / s): mu is the level it solves half the time (its 0.5 crossing), s > 0 how
gradually the pass rate falls. The belief over (mu, s) is a pool of M weighted candidates
{(mu_m, s_m, w_m)} drawn from one prior: mu ~ Normal over the level range, log s ~ Normal (so s is
log-normal), s clipped to [s_min, s_max]; weights start uniform.
- propose(): draw a candidate j ~ Categorical(w) (Thompson sampling) and a target pass rate p
  (the target, or with probability `explore_prob` uniform in target +- explore_halfwidth); the level
  d = mu_j + s_j * log((1 - p) / p), rounded and clamped to [min_level, max_level], becomes the
  environment's current difficulty.
- update(d, k, G): a group of G problems at level d came back with k solved. Only when d is the
  current difficulty: w_m <- w_m * Binomial(k; G, p_m(d)) for every candidate, renormalised in log
  space, and (d, k, G) appended to the history. A group generated at an older difficulty (the pipeline
  is asynchronous) is still trained on by the caller but changes nothing here. After
  `groups_per_level` accepted groups at the current difficulty, the next one is proposed. The default,
  1, moves after every group; when many groups of one environment are in flight at once (a small
  stage with few environments), all but the first to return would come back stale, and a larger value
  lets a whole round of them count before the level moves.
- When the effective sample size 1 / sum(w^2) falls below `ess_fraction * M`, the pool is resampled
  with replacement by weight, jittered (a Gaussian kernel scaled to the pool's spread, with a floor) so
  it does not collapse, a `fresh_fraction` of it redrawn from the prior so that a policy that moved far
  from every candidate is still found, and re-weighted from the whole history with recency weights
  0.5 ** (age / history_half_life) (age counted in accepted groups): recent groups dominate, so a
  policy that improves, or regresses, is tracked.
- Calibration: `calibrated` becomes true (and stays true) once at least `calibration_groups` groups
  updated the scheduler and the last `calibration_groups` groups are evidence of the crossing: their
  pooled solve rate lies within target +- `calibration_band`, and their levels lie within
  max(`calibration_span`, posterior-mean s) of each other (so the early bisection, which alternates
  between far-apart levels solved always and never, does not count). The rate is pooled, not
  required of one level: with a sharp policy (small s) the crossing falls between two integer levels,
  neither of which is solved near half the time, and the scheduler alternates between them. An
  environment whose crossing lies outside the levels never calibrates: it stays at the bound (its
  `summary()` shows it there).

Invariants:
- Weights are finite, non-negative and sum to 1 after every operation: the log-weights are kept
  normalised, so no product of likelihoods under- or overflows.
- Decisions depend only on the seed and the sequence of calls; `state_dict()` -> JSON ->
  `load_state_dict()` continues exactly as the uninterrupted scheduler would (generator state
  included; floats survive JSON exactly).
- A stale report (a level that is not the current difficulty) leaves the state untouched.
- Resampling replaces the pool, never the history.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

STATE_VERSION = 1


@dataclass(frozen=True)
class SchedulerConfig:
    """One environment's scheduler settings; levels and s are in difficulty-level units."""

    min_level: int = 0
    max_level: int = 100
    pool_size: int = 256                     # M, candidates (mu, s) in the pool
    prior_mu_mean: float | None = None       # None: the middle of [min_level, max_level]
    prior_mu_std: float | None = None        # None: half the level range (at least 1)
    prior_s_median: float = 2.0              # exp of the mean of log s
    prior_log_s_std: float = 1.0
    s_min: float = 0.1                       # candidates' s is clipped to [s_min, s_max]
    s_max: float = 100.0
    target_pass_rate: float = 0.5
    explore_prob: float = 0.1                # epsilon of the epsilon-greedy target
    explore_halfwidth: float = 0.25          # exploring targets are uniform in target +- this
    ess_fraction: float = 0.5                # resample when ESS < ess_fraction * pool_size
    jitter_scale: float = 0.2                # resampling kernel std, as a fraction of the pool's std
    jitter_mu_floor: float = 0.25            # ... but at least this (levels) for mu
    jitter_log_s_floor: float = 0.02         # ... and this for log s
    fresh_fraction: float = 0.1              # share of a resampled pool redrawn from the prior
    history_half_life: float = 8.0           # groups; recency weight of the re-weighting after a resample
    history_size: int = 256                  # most recent accepted groups kept
    calibration_groups: int = 4
    calibration_span: float = 2.0            # levels; the recent groups' levels lie within max(this, mean s)
    calibration_band: float = 0.25           # pooled solve rate of the recent groups within target +- this
    calibration_max_groups: int = 32         # a stage's calibration waits at most this many groups for it
    groups_per_level: int = 1                # accepted groups at the current difficulty before the next proposal

    def __post_init__(self):
        def fail(field: str, reason: str):
            raise ValueError(f"SchedulerConfig.{field}: {reason}")

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                fail(field.name, f"must be an integer (got {value!r})")
            if isinstance(value, float) and not math.isfinite(value):
                fail(field.name, f"must be finite (got {value})")
        if self.min_level > self.max_level:
            fail("min_level", f"must be <= max_level (got {self.min_level} > {self.max_level})")
        for name in ("pool_size", "history_size", "calibration_groups", "calibration_max_groups",
                     "groups_per_level"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1 (got {getattr(self, name)})")
        if self.calibration_max_groups < self.calibration_groups:
            fail("calibration_max_groups", f"must be >= calibration_groups (got {self.calibration_max_groups} < "
                                           f"{self.calibration_groups})")
        for name in ("prior_s_median", "s_min", "history_half_life", "calibration_span"):
            if getattr(self, name) <= 0:
                fail(name, f"must be > 0 (got {getattr(self, name)})")
        for name in ("prior_log_s_std", "explore_halfwidth", "jitter_scale", "jitter_mu_floor", "jitter_log_s_floor"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0 (got {getattr(self, name)})")
        if self.prior_mu_std is not None and self.prior_mu_std <= 0:
            fail("prior_mu_std", f"must be > 0 (got {self.prior_mu_std})")
        if self.s_max < self.s_min:
            fail("s_max", f"must be >= s_min (got {self.s_max} < {self.s_min})")
        for name in ("explore_prob", "ess_fraction", "fresh_fraction", "calibration_band"):
            if not 0 <= getattr(self, name) <= 1:
                fail(name, f"must be in [0, 1] (got {getattr(self, name)})")
        if not 0 < self.target_pass_rate < 1:
            fail("target_pass_rate", f"must be in (0, 1) (got {self.target_pass_rate})")
        if not 0 < self.target_pass_rate - self.explore_halfwidth < self.target_pass_rate + self.explore_halfwidth < 1:
            fail("explore_halfwidth", f"target_pass_rate +- explore_halfwidth must stay inside (0, 1) "
                                      f"(got {self.target_pass_rate} +- {self.explore_halfwidth})")

    @property
    def mu_prior(self) -> tuple[float, float]:
        mean = (self.min_level + self.max_level) / 2 if self.prior_mu_mean is None else self.prior_mu_mean
        std = max((self.max_level - self.min_level) / 2, 1.0) if self.prior_mu_std is None else self.prior_mu_std
        return mean, std


def _log_normalise(log_w: np.ndarray) -> np.ndarray:
    top = log_w.max()
    return log_w - (top + math.log(np.exp(log_w - top).sum()))


def _log_likelihood(mu: np.ndarray, s: np.ndarray, level, successes, group_size) -> np.ndarray:
    """log Binomial(k; G, p(d)) per candidate, up to the binomial coefficient (the same for every candidate).

    Broadcasts: scalars give [M]; history columns of shape [H, 1] give [H, M].

    log p = -log(1 + e^z) and log(1 - p) = -log(1 + e^-z) with z = (d - mu) / s, via logaddexp so that
    neither saturates to log 0.
    """
    z = (level - mu) / s
    return -successes * np.logaddexp(0.0, z) - (group_size - successes) * np.logaddexp(0.0, -z)


def _weighted_std(x: np.ndarray, w: np.ndarray) -> float:
    return float(np.sqrt(w @ (x - w @ x) ** 2))


class DifficultyScheduler:
    """The Thompson-sampling scheduler of one environment (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, seed: int | np.random.SeedSequence):
        self.config = config
        self._rng = np.random.default_rng(seed)
        self._mu, self._s = self._draw_prior(config.pool_size)
        self._log_w = np.full(config.pool_size, -math.log(config.pool_size))
        self._difficulty: int | None = None
        self._history: list[tuple[int, int, int]] = []    # accepted (d, k, G), oldest first
        self._n_updates = 0
        self._n_resamples = 0
        self._calibrated = False
        self._at_level = 0                                 # accepted groups at the current difficulty

    # --- decisions ---------------------------------------------------------------------------------

    def level(self) -> int:
        """The current difficulty, every new group's level (proposed on first use, and again after
        `groups_per_level` accepted updates): groups in flight keep the level they were generated at."""
        return self._difficulty if self._difficulty is not None else self.propose()

    def propose(self) -> int:
        """Thompson-sample a candidate and return the level it predicts the target pass rate at."""
        cfg = self.config
        j = self._rng.choice(cfg.pool_size, p=self.weights)
        target = cfg.target_pass_rate
        if self._rng.random() < cfg.explore_prob:
            target = self._rng.uniform(target - cfg.explore_halfwidth, target + cfg.explore_halfwidth)
        level = self._mu[j] + self._s[j] * math.log((1 - target) / target)
        self._difficulty = int(np.clip(np.rint(level), cfg.min_level, cfg.max_level))
        self._at_level = 0
        return self._difficulty

    def update(self, difficulty: int, successes: int, group_size: int) -> bool:
        """Account for a group of `group_size` at `difficulty` with `successes` solved; False when stale."""
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1 (got {group_size})")
        if not 0 <= successes <= group_size:
            raise ValueError(f"successes: must be in [0, group_size={group_size}] (got {successes})")
        if difficulty != self._difficulty:
            return False
        cfg = self.config
        self._log_w = _log_normalise(self._log_w + _log_likelihood(self._mu, self._s, difficulty, successes,
                                                                   group_size))
        self._history.append((int(difficulty), int(successes), int(group_size)))
        del self._history[:-cfg.history_size]
        self._n_updates += 1
        if self.ess < cfg.ess_fraction * cfg.pool_size:
            self._resample()
        if not self._calibrated:
            self._calibrated = self._calibration_evidence()
        self._at_level += 1
        if self._at_level >= cfg.groups_per_level:
            self.propose()
        return True

    # --- the pool ----------------------------------------------------------------------------------

    def _draw_prior(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        mu_mean, mu_std = cfg.mu_prior
        mu = self._rng.normal(mu_mean, mu_std, n)
        s = np.clip(np.exp(self._rng.normal(math.log(cfg.prior_s_median), cfg.prior_log_s_std, n)),
                    cfg.s_min, cfg.s_max)
        return mu, s

    def _resample(self) -> None:
        cfg = self.config
        w = self.weights
        log_s = np.log(self._s)
        # the kernel follows the pool's spread (wide early, narrow once it has converged), with a floor
        mu_std = max(cfg.jitter_scale * _weighted_std(self._mu, w), cfg.jitter_mu_floor)
        log_s_std = max(cfg.jitter_scale * _weighted_std(log_s, w), cfg.jitter_log_s_floor)
        picks = self._rng.choice(cfg.pool_size, size=cfg.pool_size, p=w)
        mu = self._mu[picks] + self._rng.normal(0.0, mu_std, cfg.pool_size)
        s = np.clip(np.exp(log_s[picks] + self._rng.normal(0.0, log_s_std, cfg.pool_size)), cfg.s_min, cfg.s_max)
        n_fresh = int(round(cfg.fresh_fraction * cfg.pool_size))
        if n_fresh:
            mu[:n_fresh], s[:n_fresh] = self._draw_prior(n_fresh)
        self._mu, self._s = mu, s
        levels, k, g = (np.array(column, dtype=np.float64)[:, None] for column in zip(*self._history))  # [H, 1]
        recency = 0.5 ** (np.arange(len(self._history))[::-1] / cfg.history_half_life)                # [H]
        self._log_w = _log_normalise(recency @ _log_likelihood(mu, s, levels, k, g))                  # [M]
        self._n_resamples += 1

    def _calibration_evidence(self) -> bool:
        cfg = self.config
        if self._n_updates < cfg.calibration_groups:
            return False
        levels, k, g = zip(*self._history[-cfg.calibration_groups:])
        return (abs(sum(k) / sum(g) - cfg.target_pass_rate) <= cfg.calibration_band
                and max(levels) - min(levels) <= max(cfg.calibration_span, float(self.weights @ self._s)))

    # --- read-only views ---------------------------------------------------------------------------

    @property
    def difficulty(self) -> int | None:
        """The current difficulty (None before the first proposal)."""
        return self._difficulty

    @property
    def weights(self) -> np.ndarray:
        return np.exp(self._log_w)            # the log-weights are kept normalised

    @property
    def mu(self) -> np.ndarray:
        return self._mu.copy()

    @property
    def s(self) -> np.ndarray:
        return self._s.copy()

    @property
    def history(self) -> list[tuple[int, int, int]]:
        return list(self._history)

    @property
    def ess(self) -> float:
        return float(1.0 / np.sum(self.weights ** 2))

    @property
    def crossing(self) -> float:
        """Posterior mean of mu: the estimated level solved half the time."""
        return float(self.weights @ self._mu)

    @property
    def mu_std(self) -> float:
        """Posterior std of mu: how well the crossing is localised."""
        return _weighted_std(self._mu, self.weights)

    @property
    def calibrated(self) -> bool:
        return self._calibrated

    @property
    def n_updates(self) -> int:
        return self._n_updates

    def pass_rate(self, level: float) -> float:
        """Posterior-mean predicted pass rate at `level`."""
        return float(self.weights @ np.exp(-np.logaddexp(0.0, (level - self._mu) / self._s)))

    def summary(self) -> dict[str, float | int | bool | None]:
        """Scalars for a dashboard."""
        return {"difficulty": self._difficulty, "mu_mean": self.crossing, "mu_std": self.mu_std,
                "s_mean": float(self.weights @ self._s),
                "ess": self.ess, "groups": self._n_updates, "resamples": self._n_resamples,
                "calibrated": self._calibrated,
                "pass_rate_at_difficulty": None if self._difficulty is None else self.pass_rate(self._difficulty)}

    # --- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable state: config, pool, log-weights, history, counters and the generator state."""
        return {"version": STATE_VERSION, "config": dataclasses.asdict(self.config),
                "rng": self._rng.bit_generator.state, "mu": self._mu.tolist(), "s": self._s.tolist(),
                "log_weights": self._log_w.tolist(), "difficulty": self._difficulty,
                "history": [list(h) for h in self._history], "n_updates": self._n_updates,
                "n_resamples": self._n_resamples, "calibrated": self._calibrated,
                "at_level": self._at_level}

    def load_state_dict(self, state: Mapping) -> None:
        check_version(state)
        saved = SchedulerConfig(**state["config"])
        if saved != self.config:
            field = next(f.name for f in dataclasses.fields(saved)
                         if getattr(saved, f.name) != getattr(self.config, f.name))
            raise ValueError(f"state.config.{field}: saved {getattr(saved, field)!r}, "
                             f"this scheduler has {getattr(self.config, field)!r}")
        arrays = [np.asarray(state[key], dtype=np.float64) for key in ("mu", "s", "log_weights")]
        if any(a.shape != (self.config.pool_size,) for a in arrays):
            raise ValueError(f"state: mu, s and log_weights must each hold pool_size={self.config.pool_size} values")
        self._mu, self._s, self._log_w = arrays
        self._rng.bit_generator.state = state["rng"]
        self._difficulty = state["difficulty"]
        self._history = [tuple(h) for h in state["history"]]
        self._n_updates = state["n_updates"]
        self._n_resamples = state["n_resamples"]
        self._calibrated = state["calibrated"]
        self._at_level = state["at_level"]


def check_version(state: Mapping) -> None:
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"state.version: expected {STATE_VERSION} (got {state.get('version')!r})")
