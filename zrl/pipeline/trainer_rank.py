"""TrainerRank: hosts one `TrainerWorker` in a Ray actor (docs/design.md, style rule 1: a plain class, no
ray import at module level).

Two-phase start: the controller first asks rank 0 where the pool's process group can meet
(`address`), then starts every rank with the same rendezvous.

Weight sync (zrl.pipeline.weight_sync): rank 0 opens a sync group with the rollout workers
(`listen_for_sync` then `join_sync`, concurrently with the workers' joins); `sync_weights` is
collective over the trainer ranks (every rank joins the per-parameter gathers) and rank 0 streams the
weights into the group (`sync_adapters`: the adapters alone, a LoRA run's adapter-only sync,
serving/lora_sync.py). `export_state` (`export_adapter_state`) is the fallback when no group can be formed:
rank 0 returns the whole state dict (the adapters), which the controller hands to the rollout workers
through the object store. Both tell
the worker its weights were synced (`weights_synced`: the next RL step keeps a host copy of them to
score their tokens later, zrl.trainer.onpolicy).
"""

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zrl.host_memory import HostPeakMemory
from zrl.pipeline.weight_sync import (AdapterState, SyncAddress, SyncGroup, SyncHeader, TensorSpec, bucket_layout,
                                     drain)
from zrl.trainer.settings import DTYPES
from zrl.types import RankShare


@dataclass(frozen=True)
class SyncSent:
    """What a trainer rank did in one weight sync."""

    version: int
    seconds: float
    num_bytes: int            # bytes broadcast (rank 0; 0 on the other ranks)
    peak_extra_bytes: int     # host memory peak above the level before the sync (CPU; -1 when unknown)


class TrainerRank:
    def __init__(self):
        self.worker = None
        self._sync_group: SyncGroup | None = None
        self._listen_socket = None

    def address(self, host: str | None = None) -> tuple[str, int]:
        """Where the trainer pool's process group meets: `host` (loopback on one machine) or this node."""
        import ray

        host = host or ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return host, port

    def start(self, rendezvous, model_path: str | Path, settings) -> int:
        from zrl.trainer import TrainerWorker

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.worker = TrainerWorker(rendezvous, model_path, settings)
        return self.worker.version

    def set_settings(self, settings, keep_optimizer_state: bool) -> None:
        self.worker.start_stage(settings, keep_optimizer_state=keep_optimizer_state)

    def rebase(self, model_path: str | Path, settings) -> int:
        """A stage that switches between full fine-tuning and adapters: the worker is rebuilt on `model_path`."""
        old, self.worker = self.worker, None
        self.worker = old.rebased(model_path, settings)
        return self.worker.version

    def train_step(self, share: RankShare) -> dict[str, float]:
        return self.worker.train_step(share)

    def sft_step(self, examples) -> dict[str, float]:
        return self.worker.sft_step(examples)

    # ------------------------------------------------------------------ weight sync

    def listen_for_sync(self, host: str | None, num_workers: int, backend: str, timeout_s: float) -> SyncAddress:
        """Rank 0: open the listening socket of a new sync group with `num_workers` rollout workers, on
        `host` (None: this node's address)."""
        import ray

        self.close_sync()
        host = host or ray.util.get_node_ip_address()
        address, self._listen_socket = SyncGroup.listen(host, 1 + num_workers, backend, timeout_s)
        return address

    def join_sync(self, address: SyncAddress) -> None:
        """Rank 0: join the group as its sender; returns when every rollout worker has joined."""
        sock, self._listen_socket = self._listen_socket, None
        self._sync_group = SyncGroup(address, 0, listen_socket=sock)

    def close_sync(self) -> None:
        if self._sync_group is not None:
            self._sync_group.close()
            self._sync_group = None
        if self._listen_socket is not None:
            self._listen_socket.close()
            self._listen_socket = None

    def sync_weights(self, dtype: str, bucket_bytes: int) -> SyncSent:
        """Collective over the trainer ranks: stream the policy to the sync group (rank 0 sends)."""
        from zrl.trainer.export import iter_full_tensors, weight_specs

        model, version = self.worker.model, self.worker.version
        self.worker.weights_synced()  # on every rank, so their copies stay alike (the scoring is collective)
        start = time.perf_counter()
        with HostPeakMemory() as memory:
            tensors = iter_full_tensors(model, DTYPES[dtype])
            if self.worker.rank == 0:
                if self._sync_group is None:
                    raise RuntimeError("sync_weights on rank 0 before join_sync")
                specs = [TensorSpec(name, shape, str(t).removeprefix("torch."))
                         for name, shape, t in weight_specs(model, DTYPES[dtype])]
                header = SyncHeader(version, bucket_layout(specs, bucket_bytes))
                try:
                    sent = self._sync_group.send(header, tensors)
                finally:  # a broken group (a receiver died) must not leave the other ranks in a gather
                    drain(tensors)
            else:
                sent = 0
                drain(tensors)  # every gather is collective: ranks > 0 take part in all of them
        return SyncSent(version, time.perf_counter() - start, sent, memory.peak_extra_bytes)

    def sync_adapters(self, bucket_bytes: int) -> SyncSent:
        """Adapter-only sync (serving/lora_sync.py), collective over the trainer ranks: the adapters gathered
        module by module, rank 0 streams them as a PEFT adapter (fp32) with its config in the header."""
        from zrl.trainer.export import adapter_tensors

        version = self.worker.version
        self.worker.weights_synced()
        start = time.perf_counter()
        with HostPeakMemory() as memory:
            tensors, config = adapter_tensors(self.worker.model)
            sent = 0
            if self.worker.rank == 0:
                if self._sync_group is None:
                    raise RuntimeError("sync_adapters on rank 0 before join_sync")
                specs = [TensorSpec(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()]
                header = SyncHeader(version, bucket_layout(specs, bucket_bytes), adapter_config=config)
                sent = self._sync_group.send(header, iter(tensors.items()))
        return SyncSent(version, time.perf_counter() - start, sent, memory.peak_extra_bytes)

    def export_adapter_state(self) -> AdapterState | None:
        """Fallback adapter-only sync: the adapters on rank 0 (None elsewhere); collective."""
        from zrl.trainer.export import adapter_tensors

        self.worker.weights_synced()
        tensors, config = adapter_tensors(self.worker.model)
        return AdapterState(tensors, config) if self.worker.rank == 0 else None

    def export_state(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """Fallback sync: the whole state dict on rank 0 (None elsewhere); collective."""
        from zrl.trainer.export import iter_full_tensors

        keep = self.worker.rank == 0
        self.worker.weights_synced()
        state = {}
        for name, tensor in iter_full_tensors(self.worker.model, DTYPES[dtype]):
            if keep:
                state[name] = tensor
        return state if keep else None

    # ------------------------------------------------------------------ state

    def version(self) -> int:
        return self.worker.version

    def save_checkpoint(self, path: str, data_state: dict) -> None:
        self.worker.save_checkpoint(path, data_state)

    def load_checkpoint(self, path: str) -> dict:
        return self.worker.load_checkpoint(path)

    def export_hf(self, path: str, dtype: str) -> None:
        self.worker.export_hf(path, dtype=DTYPES[dtype])

    def export_adapter(self, path: str) -> None:
        self.worker.export_adapter(path)

    def shutdown(self) -> None:
        self.close_sync()
        if self.worker is not None:
            self.worker.shutdown()
