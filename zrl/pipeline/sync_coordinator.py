"""An RL stage's weight syncs: carries out the schedule's `StartSync` over one of two transports.

`SyncCoordinator` starts a sync (trainer ranks and every rollout worker), reads the trainer side's
result, counts what a sync cost (`StageCounters`: time, bytes, peak extra memory) and stops the stage
after MAX_FAILED_SYNCS failures in a row. What differs between transports is one class each:
- `CollectiveSync`: trainer rank 0 streams the weights to every worker over a collective group
  (zrl.pipeline.weight_sync) of trainer rank 0 + every rollout worker (loopback on one machine), formed
  at the first sync and again after a fault (a worker that Ray is restarting joins once it is back:
  `await_joins`); when it cannot be formed, the coordinator falls back to
- `ObjectStoreSync`: rank 0's state dict goes from its process to the workers' through Ray's object
  store (recipe `sync_transport: object_store`, or the fallback, logged once with the reason).
What travels is the run's `weight_sync` choice (serving/lora_sync.py): the full weights (merged, in a LoRA run
that cannot be synced adapter-only) or, adapter-only, the adapters alone (`sync_adapters` /
`export_adapter_state` on the trainer side), over either transport.
The schedule decides when; the coordinator's answers (`TrainerSynced`, `WorkerSynced`) go back to it
through the stage loop (zrl.pipeline.rl_stage), which also handles a worker that died mid-sync.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError

from zrl.config.schema import Asynchrony
from zrl.pipeline.faults import RANK_FAILURE_GRACE_S, StageStopped, reason_of, trainer_results
from zrl.pipeline.schedule import StartSync, TrainerSynced
from zrl.pipeline.stage_calls import TrainerSyncCall, WorkerSyncCall, call_errors
from zrl.pipeline.stage_report import StageCounters
from zrl.pipeline.worker_restarts import RESTART_POLL_S

log = logging.getLogger("zrl")

MAX_FAILED_SYNCS = 6  # failed sync calls in a row (each member's failure counts) before the stage stops


class CollectiveSync:
    name = "collective"

    def __init__(self, adapters: bool = False):
        self.group_ready = False
        self.adapters = adapters  # an adapter-only sync: the trainer sends the adapters alone

    def prepare(self, ranks: list, workers: list, pool, timeout_s: float) -> bool:
        """Form the group unless it is formed (blocking: stage start and after faults only); False when
        it cannot be formed."""
        if self.group_ready:
            return True
        host = "127.0.0.1" if pool.one_machine else None  # None: trainer rank 0's node address
        backend = "nccl" if pool.gpus > 0 else "gloo"
        joins = []
        try:
            address = ray.get(ranks[0].listen_for_sync.remote(host, len(workers), backend, timeout_s))
            joins = [ranks[0].join_sync.remote(address)]
            joins += [w.join_sync.remote(address, i + 1) for i, w in enumerate(workers)]
            await_joins(joins, workers, address, time.monotonic() + timeout_s)
        except (RayError, GetTimeoutError) as exc:
            log.warning("weight sync: the collective group could not be formed (%s); syncing through Ray's "
                        "object store for the rest of the stage", reason_of(exc))
            ray.wait(joins[:1], timeout=timeout_s)  # rank 0 leaves its join (it times out) first
            return False
        self.group_ready = True
        log.info("weight sync: %s group of trainer rank 0 and %d rollout worker(s) at %s:%d", backend,
                 len(workers), address.host, address.port)
        return True

    def broken(self) -> None:
        """A member died or a sync failed: the group is formed again before the next sync."""
        self.group_ready = False

    def submit(self, ranks: list, workers: list, policy_version: int, engine_dtype: str, bucket_bytes: int):
        sent = tuple(r.sync_adapters.remote(bucket_bytes) if self.adapters else
                     r.sync_weights.remote(engine_dtype, bucket_bytes) for r in ranks)
        return sent, [w.receive_weights.remote() for w in workers]

    def fetchable(self, refs: tuple) -> tuple:
        """The trainer ranks' results the driver fetches: every rank's report."""
        return refs

    def sent(self, counters: StageCounters, results: list) -> None:
        counters.sync_bytes = results[0].num_bytes
        counters.sync_peak_extra_bytes["sender"] = results[0].peak_extra_bytes

    def received(self, counters: StageCounters, result) -> None:
        pass


def await_joins(joins: list, workers: list, address, deadline: float) -> None:
    """Wait for every member's join (`joins`: trainer rank 0's, then worker i's at i + 1) until `deadline`.

    A worker that died after its last answer to the stage loop (the loop has not handled its death yet)
    refuses its join while Ray restarts it, and trainer rank 0, already waiting in its own join for that
    member, would wait out sync_timeout_s (measured: 600 s, then the stage fell back to the object store).
    So a refused join is sent again until the restarted worker takes it and the group forms with it, in
    the time a restart takes; the loop still handles the death when the worker's failed call comes back.
    """
    pending = dict(zip(joins, range(len(joins))))
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise GetTimeoutError(f"{len(pending)} member(s) did not join the weight-sync group in time")
        member = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except ActorUnavailableError:
            if member == 0 or time.monotonic() > deadline:
                raise
            time.sleep(RESTART_POLL_S)
            pending[workers[member - 1].join_sync.remote(address, member)] = member


class ObjectStoreSync:
    name = "object_store"

    def __init__(self, adapters: bool = False):
        self.adapters = adapters

    def prepare(self, ranks: list, workers: list, pool, timeout_s: float) -> bool:
        return True

    def broken(self) -> None:
        pass

    def submit(self, ranks: list, workers: list, policy_version: int, engine_dtype: str, bucket_bytes: int):
        refs = tuple(r.export_adapter_state.remote() if self.adapters else r.export_state.remote(engine_dtype)
                     for r in ranks)
        return refs, [w.update_weights.remote(refs[0], policy_version) for w in workers]

    def fetchable(self, refs: tuple) -> tuple:
        """Rank 0's result is the whole state dict: never fetched by the driver."""
        return refs[1:]

    def sent(self, counters: StageCounters, results: list) -> None:
        pass

    def received(self, counters: StageCounters, result) -> None:
        counters.sync_bytes = result.num_bytes


class SyncCoordinator:
    def __init__(self, stage_name: str, asynchrony: Asynchrony, ctx, workers: list, counters: StageCounters,
                 pending: dict, fetch, next_seq):
        """`ctx`: the stage's StageContext (ranks, rollout pool, engine dtype); `workers`: the rollout
        worker handles; `pending`: the stage loop's calls in flight, where the sync's calls go; `fetch`:
        the loop's counting ray.get; `next_seq`: the loop's call sequence numbers."""
        self.stage_name, self.asynchrony, self.ctx, self.workers = stage_name, asynchrony, ctx, workers
        self.counters, self.pending, self.fetch, self.next_seq = counters, pending, fetch, next_seq
        self.adapters = ctx.weight_sync is not None and ctx.weight_sync.mode == "adapter"
        self.transport = (CollectiveSync(self.adapters) if asynchrony.sync_transport == "collective"
                          else ObjectStoreSync(self.adapters))
        counters.sync_transport = self.transport.name
        counters.sync_mode = "full" if ctx.weight_sync is None else ctx.weight_sync.mode
        self.failed_syncs = 0
        self._started = 0.0

    def start(self, request: StartSync) -> None:
        a, ctx = self.asynchrony, self.ctx
        if not self.transport.prepare(ctx.ranks, self.workers, ctx.rollout_pool, a.sync_timeout_s):
            self.transport = ObjectStoreSync(self.adapters)
            self.counters.sync_transport = self.transport.name
        self._started = time.perf_counter()
        refs, calls = self.transport.submit(ctx.ranks, self.workers, request.policy_version, ctx.engine_dtype,
                                            int(a.sync_bucket_mib * 2**20))
        self.pending[refs[0]] = TrainerSyncCall(refs, self.transport)
        for index, ref in enumerate(calls):
            self.pending[ref] = WorkerSyncCall(index, self.next_seq())

    def trainer_synced(self, call: TrainerSyncCall) -> TrainerSynced:
        """The trainer side of a sync returned; raises TrainerFailed when a rank died."""
        try:
            sent = [self.fetch(r) for r in call.transport.fetchable(call.refs)]
        except RayError as exc:
            if any(isinstance(e, RayActorError) for e in call_errors(call.refs)):  # a rank died: TrainerFailed
                trainer_results(call.refs, "a weight sync", self.fetch, timeout_s=RANK_FAILURE_GRACE_S)
            self.failed("the trainer side", exc)
            return TrainerSynced(ok=False)
        self.failed_syncs = 0
        c = self.counters
        c.sync_s += time.perf_counter() - self._started
        c.sync_count += 1
        call.transport.sent(c, sent)
        return TrainerSynced()

    def worker_synced(self, received) -> None:
        """A worker's part returned what it received (rollout_worker.SyncReport)."""
        c = self.counters
        c.sync_engine_s = received.seconds
        c.sync_peak_extra_bytes["receiver"] = received.peak_extra_bytes
        self.transport.received(c, received)

    def failed(self, where: str, exc: RayError) -> None:
        """Log a failed sync; after MAX_FAILED_SYNCS in a row (a cause that will not go away), stop."""
        self.transport.broken()
        self.failed_syncs += 1
        reason = reason_of(exc)
        if self.failed_syncs >= MAX_FAILED_SYNCS:
            raise StageStopped(f"stage {self.stage_name!r} stopped: weight sync failed {self.failed_syncs} times in "
                               f"a row, last on {where}: {reason}") from None
        log.warning("weight sync failed on %s (%s); syncing every worker again", where, reason)

    def worker_restarted(self) -> None:
        self.transport.broken()

    def close(self) -> None:
        ray.get(self.ctx.ranks[0].close_sync.remote())
