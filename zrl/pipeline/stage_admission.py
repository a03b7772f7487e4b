"""An RL stage's groups from a round report to the buffer: verification, then admission.

Every group a rollout worker reports (a `GroupTicket`) is verified on the stage's `VerifierPool` and
handed on: to the buffer (`admit_verified`, the group's arrays by reference), or, while the stage's
difficulty schedulers calibrate, to them alone. The schedule hears each step as its answers: the group
was handed on (`GroupHandedOn`, lost when its rollout worker died with its arrays), then admitted
(`GroupAdmitted`). Verifier faults cost rewards, not groups: a verify call whose verifier was restarted
under it is tried once more elsewhere, then its responses get reward 0 ("verifier died"); a call past
the pool's backstop gets reward 0 ("timeout after ... s"). The first occurrence of each distinct error
an entry's verifications carry is a console warning (zrl/env/errors.py).
"""

from __future__ import annotations

import logging

from ray.exceptions import RayActorError, RayError

from zrl.env.errors import EnvErrorLog
from zrl.pipeline.faults import ProgressWatchdog
from zrl.pipeline.rollout_worker import GroupTicket
from zrl.pipeline.schedule import GroupAdmitted, GroupHandedOn, StageSchedule
from zrl.pipeline.stage_calls import AdmitCall, VerifyCall, group_was_lost
from zrl.pipeline.stage_report import StageCounters
from zrl.pipeline.verifier_pool import VerifierPool
from zrl.types import Verification

log = logging.getLogger("zrl")


class StageAdmission:
    def __init__(self, schedule: StageSchedule, verifiers: VerifierPool, buffer, curriculum,
                 watchdog: ProgressWatchdog, counters: StageCounters, pending: dict, fetch):
        """`curriculum`: the stage's StageCurriculum or None; `pending`: the stage loop's calls in flight;
        `fetch`: the loop's counting ray.get."""
        self.schedule, self.verifiers, self.buffer, self.curriculum = schedule, verifiers, buffer, curriculum
        self.watchdog, self.counters, self.pending, self.fetch = watchdog, counters, pending, fetch
        self.env_errors = EnvErrorLog()

    def verify(self, ticket: GroupTicket, retried: bool = False) -> None:
        ref, call = self.verifiers.submit(ticket, retried)
        self.pending[ref] = call

    def on_verified(self, call: VerifyCall, ref) -> None:
        self.verifiers.returned(call.verifier)
        try:
            result = self.fetch(ref)
            verifications = result.verifications
            self.env_errors.record(result.env, verifications)
            self.counters.verifier_timeouts += result.timeouts
            busy = {c.verifier for c in self.pending.values() if isinstance(c, VerifyCall)}
            self.verifiers.check_health(call.verifier, result.hung_threads, busy)
        except RayError as exc:
            if group_was_lost(exc):  # its rollout worker died: the group's arrays died with it
                self.schedule.take(GroupHandedOn(lost=True))
                log.warning("group %s was lost with its rollout worker", call.ticket.group_id)
                return
            if not isinstance(exc, RayActorError):
                raise
            if not call.retried:  # its verifier was restarted under it: try once more elsewhere
                self.verify(call.ticket, retried=True)
                return
            verifications = tuple(Verification(0.0, error="verifier died") for _ in range(call.ticket.num_rollouts))
        self.watchdog.group_verified([v.error for v in verifications if v.error])
        self.admit(call.ticket, verifications)

    def admit(self, ticket: GroupTicket, verifications) -> None:
        """Hand a verified group to the buffer; while the curriculum calibrates, only to the curriculum."""
        calibrating = self.curriculum is not None and self.curriculum.calibrating
        if ticket.level is not None:
            self.curriculum.report(*ticket.level, verifications)
        self.schedule.take(GroupHandedOn())
        if calibrating:
            self.schedule.take(GroupAdmitted())  # by the curriculum
            self.watchdog.step_done()  # calibration groups are the stage's progress until training starts
            return
        self.pending[self.buffer.admit_verified.remote(ticket.ref, tuple(verifications))] = AdmitCall(ticket)

    def on_admitted(self, call: AdmitCall, ref) -> None:
        try:
            self.watchdog.group_admitted(self.fetch(ref).status)
        except RayError as exc:
            if not group_was_lost(exc):
                raise
            self.schedule.take(GroupAdmitted(lost=True))
            return
        self.schedule.take(GroupAdmitted())

    def expire_verifications(self) -> None:
        """The backstop for verify calls that hang past their own timeouts (zrl/pipeline/verifier_pool.py)."""
        for ref, call, limit in self.verifiers.overdue(self.pending):
            del self.pending[ref]
            self.counters.verifier_timeouts += 1
            self.admit(call.ticket, [Verification(0.0, error=f"timeout after {limit:g} s")] * call.ticket.num_rollouts)
