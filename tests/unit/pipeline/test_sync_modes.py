"""The run's weight-sync mode (serving/lora_sync.py) reaches the sync transports and the stage's counters: an
adapter-only run asks the trainer ranks for the adapters alone, a merged or full run for the full weights."""

from types import SimpleNamespace

import pytest

from serving.lora_sync import SyncChoice
from zrl.config.schema import Asynchrony
from zrl.pipeline.stage_report import StageCounters
from zrl.pipeline.sync_coordinator import CollectiveSync, ObjectStoreSync, SyncCoordinator


class _Actor:
    """A Ray actor handle whose `method.remote(*args)` returns ("method", args)."""

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *args: (method, args))


@pytest.mark.parametrize("adapters, trainer_call", [(False, "sync_weights"), (True, "sync_adapters")])
def test_collective_sync_sends_what_the_mode_says(adapters, trainer_call):
    sent, received = CollectiveSync(adapters).submit([_Actor(), _Actor()], [_Actor()], 3, "float32", 1024)
    assert [call for call, _ in sent] == [trainer_call] * 2
    assert received == [("receive_weights", ())]


@pytest.mark.parametrize("adapters, trainer_call", [(False, "export_state"), (True, "export_adapter_state")])
def test_object_store_sync_sends_what_the_mode_says(adapters, trainer_call):
    refs, calls = ObjectStoreSync(adapters).submit([_Actor()], [_Actor()], 3, "float32", 1024)
    assert refs[0][0] == trainer_call
    assert calls == [("update_weights", (refs[0], 3))]


@pytest.mark.parametrize("choice, mode", [(None, "full"), (SyncChoice("merged", "why"), "merged"),
                                          (SyncChoice("adapter", "why"), "adapter")])
def test_the_stage_counts_the_runs_mode(choice, mode):
    counters = StageCounters()
    ctx = SimpleNamespace(weight_sync=choice)
    coordinator = SyncCoordinator("rl", Asynchrony(), ctx, [], counters, {}, None, None)
    assert counters.sync_mode == mode
    assert coordinator.transport.adapters == (mode == "adapter")


def test_the_metric_row_says_what_the_syncs_sent():
    from zrl.pipeline.schedule import StageSchedule
    from zrl.pipeline.stage_report import step_metrics

    schedule = StageSchedule(num_workers=1, trainer_step=3, end_step=6, prompts_per_batch=2, sync_every_steps=2,
                             synchronous=False)
    for mode, adapter_only, merged in (("full", 0.0, 0.0), ("merged", 0.0, 1.0), ("adapter", 1.0, 0.0)):
        row = step_metrics(StageCounters(sync_mode=mode), schedule, {}, {}, {}, window_s=1.0)
        assert (row["sync/adapter_only"], row["sync/merged"]) == (adapter_only, merged)
