"""Environment errors on the console: each distinct error of an environment entry is shown once.

A verifier that raises (or times out, or returns something that is not a reward) and an episode whose
environment raises cost that rollout its reward, never the run: the error travels with the rollout as
`Verification.error` (into `zrl eval --save-rollouts` files too) and is counted (`env/verifier_errors`,
`env/<entry>/verifier_errors`; an episode's also as `verify/<entry>/env_error`). `EnvErrorLog` is what
a person watching the run sees of it: the first occurrence of each distinct (entry, message) pair as a
warning line, the repeats only counted, so a verifier that fails on every rollout writes one line, not
thousands. An entry whose messages keep changing (a message quoting the response) shows its first
`MAX_SHOWN_PER_ENTRY` and then says that the rest are counted only.

An RL stage's log is its admission's (zrl/pipeline/stage_admission.py): on the driver, it sees every
verified group, single-turn and multi-turn, so a message is shown once for the whole stage. An
evaluation's is its scoring's (zrl/evaluate.py `score`): `zrl eval` shows each message once per entry, a
rollout worker's held-out evaluations once in the worker's life (a Ray actor: its lines carry Ray's prefix).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from zrl.types import Verification

log = logging.getLogger("zrl")

MAX_SHOWN_PER_ENTRY = 10  # distinct messages of one entry shown; later distinct ones are counted only
MAX_SHOWN_CHARS = 500     # a shown message is cut to this many characters (the record keeps it whole)


class EnvErrorLog:
    def __init__(self) -> None:
        self.shown: dict[str, set[str]] = {}  # entry -> the messages shown (at most MAX_SHOWN_PER_ENTRY)
        self.capped: set[str] = set()         # entries past the limit (said once)

    def record(self, entry: str, verifications: Iterable[Verification]) -> None:
        """Show each error of `verifications` (of entry `entry`) not shown before."""
        for verification in verifications:
            if verification.error is not None:
                self._show(entry, verification.error)

    def _show(self, entry: str, message: str) -> None:
        shown = self.shown.setdefault(entry, set())
        if message in shown or entry in self.capped:
            return
        if len(shown) == MAX_SHOWN_PER_ENTRY:
            self.capped.add(entry)
            log.warning("environment %r: more than %d distinct errors; further ones are counted, not shown",
                        entry, MAX_SHOWN_PER_ENTRY)
            return
        shown.add(message)
        line = " ".join(message.split())  # one line
        if len(line) > MAX_SHOWN_CHARS:
            line = line[:MAX_SHOWN_CHARS] + "..."
        log.warning("environment %r: %s (the rollout's reward is 0; each distinct error is shown once)", entry, line)


__all__ = ["EnvErrorLog", "MAX_SHOWN_PER_ENTRY"]
