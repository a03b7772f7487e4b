"""Fixtures of the trainer tests: the tiny zaya checkpoint (built once) and a 1-rank gloo group."""

import socket

import pytest
import torch.distributed as dist

from zrl.assets import build_tiny_model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("trainer_tiny") / "model")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_rank():
    """A Rendezvous of a 1-rank pool whose group this fixture creates and destroys around the module."""
    from zrl.trainer import Rendezvous
    from zrl.trainer.distributed import init_process_group

    rdzv = Rendezvous("127.0.0.1", free_port(), rank=0, world_size=1, backend="gloo", timeout_s=60)
    created = init_process_group(rdzv)
    yield rdzv
    if created and dist.is_initialized():
        dist.destroy_process_group()
