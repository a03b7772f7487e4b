"""TrainerRank: hosts one `TrainerWorker` in a Ray actor (style rule 1: plain class, no ray import).

Two-phase start: the controller first asks rank 0 where the pool's process group can meet
(`address`), then starts every rank with the same rendezvous. `export_state` turns the trainer's
bucketed export into one state dict on rank 0 (None elsewhere): the controller passes rank 0's result
by object reference to every rollout worker, so the weights cross the object store once.
"""

import os
import socket
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class TrainerRank:
    def __init__(self):
        self.worker = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, rendezvous, model_path: str | Path, settings) -> int:
        from zrl.trainer import TrainerWorker

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.worker = TrainerWorker(rendezvous, model_path, settings)
        return self.worker.version

    def set_settings(self, settings, keep_optimizer_state: bool) -> None:
        self.worker.start_stage(settings, keep_optimizer_state=keep_optimizer_state)

    def train_step(self, batch) -> dict[str, float]:
        return self.worker.train_step(batch)

    def sft_step(self, examples) -> dict[str, float]:
        return self.worker.sft_step(examples)

    def export_state(self, dtype: str) -> dict[str, torch.Tensor] | None:
        state = {}
        keep = self.worker.rank == 0
        for bucket in self.worker.export_weights(dtype=_DTYPES[dtype]):  # collective: every rank iterates
            if keep:
                state.update(bucket.tensors)
        return state if keep else None

    def version(self) -> int:
        return self.worker.version

    def save_checkpoint(self, path: str, data_state: dict) -> None:
        self.worker.save_checkpoint(path, data_state)

    def load_checkpoint(self, path: str) -> dict:
        return self.worker.load_checkpoint(path)

    def export_hf(self, path: str, dtype: str) -> None:
        self.worker.export_hf(path, dtype=_DTYPES[dtype])

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
