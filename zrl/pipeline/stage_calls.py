"""The records of an RL stage's calls in flight, and what the stage loop asks of a finished Ray call.

The loop (rl_stage.py) keeps every call it started in `pending`, keyed by its object reference, as one
of the records below; the record says what to do when the call finishes.

Data plane (the driver sees ids, counts, versions and metrics only):
- a rollout worker `ray.put`s every finished group, and its text apart; its round report carries
  `GroupTicket`s (ids, counts, the two references);
- a verifier gets the text by reference (Ray resolves it in the verifier) and returns rewards;
- the buffer gets the same reference with the verifications (`admit_verified`, not waited on: Ray
  runs one caller's calls to an actor in order, so the next credit question sees the admission);
- the buffer's `release` returns one object per trainer rank, each rank's `RankShare`, and the driver
  passes rank r the reference of share r only.
Every value the driver does fetch goes through the loop's `_fetch`, which counts rollout-array bytes in it
(`driver/rollout_array_bytes`, expected to stay 0; `rollout_bytes_in`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ray
from ray.exceptions import ObjectLostError, RayError, RayTaskError

from zrl.pipeline.rollout_worker import GroupTicket
from zrl.types import Rollout, rollout_array_bytes


@dataclass(frozen=True)
class RoundCall:
    worker: int
    seq: int                    # submission order: tells a failure of the current incarnation from older ones


@dataclass(frozen=True)
class VerifyCall:
    ticket: GroupTicket
    verifier: int
    submitted: float
    retried: bool


@dataclass(frozen=True)
class AdmitCall:
    ticket: GroupTicket


@dataclass(frozen=True)
class CreditCall:
    pass


@dataclass(frozen=True)
class ReleaseCall:
    shares: tuple               # one object reference per trainer rank


@dataclass(frozen=True)
class TrainCall:
    refs: tuple                 # every rank's train_step (each is a key of the same record)
    started: float
    batch_metrics: dict         # the released batch's values (zrl.metrics.batch_metrics)


@dataclass(frozen=True)
class TrainerSyncCall:
    refs: tuple                 # every rank's sync_weights / export_state (keyed by rank 0's)
    transport: object           # the sync's transport (zrl.pipeline.sync_coordinator): which results to fetch


@dataclass(frozen=True)
class WorkerSyncCall:
    worker: int
    seq: int


@dataclass(frozen=True)
class EvalCall:
    worker: int
    seq: int                    # as RoundCall's


@dataclass(frozen=True)
class CheckedCall:
    what: str                   # a call whose only result is "it did not raise"


def call_errors(refs) -> list[RayError]:
    """The errors of finished calls among `refs` (unfinished ones are not waited for)."""
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0, fetch_local=False)
    errors = []
    for ref in done:
        try:
            ray.get(ref)
        except RayError as exc:
            errors.append(exc)
    return errors


def group_was_lost(exc: RayError) -> bool:
    """Whether a call failed because a group's object was lost (its owner, the rollout worker, died)."""
    return isinstance(exc, ObjectLostError) or (isinstance(exc, RayTaskError)
                                                and isinstance(getattr(exc, "cause", None), ObjectLostError))


def rollout_bytes_in(value) -> int:
    """Rollout-array bytes held by a value the driver fetched: rollouts anywhere inside it (dataclass
    fields, containers), so a report that smuggled a group in would be counted."""
    if isinstance(value, Rollout):
        return rollout_array_bytes(value)
    if isinstance(value, (list, tuple)):
        return sum(rollout_bytes_in(v) for v in value)
    if isinstance(value, dict):
        return sum(rollout_bytes_in(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(rollout_bytes_in(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0
