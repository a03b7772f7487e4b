"""Weight sync over a collective group: trainer rank 0 streams the policy to every rollout worker.

Members: group rank 0 is trainer rank 0 (the sender), group ranks 1..N are the rollout workers. The
group is a process group of its own (vLLM's stateless process group: gloo on CPU, NCCL on GPU), never
a default group: FSDP2 owns that one in a trainer rank, vLLM in a rollout worker.

One sync (collective: every member calls `send` or `receive` once, in the same order):
1. the sender broadcasts a `SyncHeader`, the typed message of the sync: the policy version and the
   layout of every bucket (name, shape and dtype of its tensors, in order), pickled into bytes (an
   adapter-only sync of a LoRA run also carries the adapter's PEFT config: its tensors are the adapters);
2. per bucket, one broadcast of a flat byte buffer holding its tensors back to back (each at a
   16-byte aligned offset, so any dtype can be viewed in place).
The sender fills a bucket one gathered parameter at a time (and drops the parameter once copied); a
receiver hands a copy of each tensor of the bucket it just received to the engine's in-place loader
before it receives the next one (a copy, so a tensor the loader keeps does not keep its whole bucket
alive). Extra memory per sync, beyond the model: sender <= one bucket + the parameter being gathered;
receiver <= one bucket + the tensor being handed over + what the engine's loader holds (vLLM's
layer-wise reload materialises one decoder layer at a time, and on CPU the MoE kernels repack its
experts: about two layers). Both return freed heap memory to the OS between buckets, the receiver's
engine also between decoder layers (zrl.host_memory), so what a process holds is what is live.
A tensor larger than the bucket size travels in a bucket of its own.

Rendezvous: the sender listens on the host it is given (loopback when the whole run is one machine,
so nothing listens on other interfaces; the node's address on a cluster) on a port the OS picks.
"""

from __future__ import annotations

import logging
import pickle
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

from zrl.host_memory import release_host_memory

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # Hugging Face checkpoint key
    shape: tuple[int, ...]
    dtype: str                # torch dtype name, e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def num_bytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class SyncHeader:
    """What one sync carries: the version of the weights and the layout of their buckets."""

    version: int
    buckets: tuple[tuple[TensorSpec, ...], ...]
    # An adapter-only sync (serving/lora_sync.py): the tensors are a PEFT adapter's (its keys) and this is its
    # adapter_config.json; None: the tensors are the full weights in HF keys.
    adapter_config: dict | None = None

    @property
    def num_bytes(self) -> int:
        return sum(spec.num_bytes for bucket in self.buckets for spec in bucket)

    def names(self) -> set[str]:
        return {spec.name for bucket in self.buckets for spec in bucket}


@dataclass(frozen=True)
class AdapterState:
    """An adapter-only sync through the object store: a PEFT adapter's tensors and adapter_config.json."""

    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def bucket_layout(specs: Iterable[TensorSpec], bucket_bytes: int) -> tuple[tuple[TensorSpec, ...], ...]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (aligned) bytes each."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, current, size = [], [], 0
    for spec in specs:
        nbytes = _aligned(spec.num_bytes)
        if current and size + nbytes > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


@dataclass(frozen=True)
class SyncAddress:
    """Where the members of one weight-sync group meet, handed out by the sender."""

    host: str
    port: int
    world_size: int           # 1 sender + the rollout workers
    backend: str              # "gloo" | "nccl"
    timeout_s: float


class SyncGroup:
    """One member's end of a weight-sync group. Build the sender's with `listen`, then `join` on
    every member (the sender too) concurrently: joining blocks until all members have joined."""

    def __init__(self, address: SyncAddress, rank: int, listen_socket: socket.socket | None = None):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        if not 0 <= rank < address.world_size:
            raise ValueError(f"group rank {rank} outside a group of {address.world_size}")
        self.address, self.rank = address, rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if address.backend == "nccl" else torch.device("cpu")
        self._pg = stateless_init_torch_distributed_process_group(
            address.host, address.port, rank, address.world_size, address.backend, listen_socket=listen_socket,
            timeout=timedelta(seconds=address.timeout_s))

    @staticmethod
    def listen(host: str, world_size: int, backend: str, timeout_s: float) -> tuple[SyncAddress, socket.socket]:
        """The sender's listening socket, bound to `host` only, and the address members join at."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen()
        return SyncAddress(host, sock.getsockname()[1], world_size, backend, timeout_s), sock

    def close(self) -> None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self._pg is not None:
            stateless_destroy_torch_distributed_process_group(self._pg)
            self._pg = None

    # ------------------------------------------------------------------ sync

    def send(self, header: SyncHeader, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: broadcast `header`, then the tensors in its layout order; returns bytes sent."""
        if self.rank != 0:
            raise RuntimeError("only group rank 0 sends weights")
        self._broadcast_header(header)
        sent = 0
        for bucket in header.buckets:
            flat = torch.empty(sum(_aligned(s.num_bytes) for s in bucket), dtype=torch.uint8, device=self.device)
            offset = 0
            for spec in bucket:
                name, tensor = next(tensors)
                if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.torch_dtype:
                    raise RuntimeError(f"weight {name} {tuple(tensor.shape)} {tensor.dtype} does not match the "
                                       f"announced {spec}")
                flat[offset: offset + spec.num_bytes].copy_(tensor.reshape(-1).view(torch.uint8))
                offset += _aligned(spec.num_bytes)
                del tensor
            self._broadcast(flat)
            sent += flat.numel()
            del flat
            release_host_memory()
        return sent

    def receive(self) -> tuple[SyncHeader, Iterator[tuple[str, torch.Tensor]]]:
        """Ranks 1..N: the header, and an iterator of (name, tensor) views bucket by bucket. The
        iterator must be consumed to the end (each bucket is a collective); `drain` finishes it."""
        if self.rank == 0:
            raise RuntimeError("group rank 0 sends, it does not receive")
        header = self._broadcast_header(None)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in header.buckets:
                release_host_memory()  # what the loader freed of the previous buckets
                flat = torch.empty(sum(_aligned(s.num_bytes) for s in bucket), dtype=torch.uint8, device=self.device)
                self._broadcast(flat)
                offset = 0
                for spec in bucket:
                    view = flat[offset: offset + spec.num_bytes].view(spec.torch_dtype).view(spec.shape)
                    offset += _aligned(spec.num_bytes)
                    # A copy, not the view: the engine's loader keeps some loaded tensors past their layer,
                    # and a view would keep its whole bucket alive (measured: the receiver then grew with
                    # the model's depth, 14.7 -> 43.6 MiB from 8 to 32 layers; with copies it stays flat).
                    yield spec.name, view.clone()
                del flat

        return header, tensors()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._pg.broadcast([tensor], options).wait()

    def _broadcast_header(self, header: SyncHeader | None) -> SyncHeader:
        payload = pickle.dumps(header) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if self.rank == 0
                else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        self._broadcast(data)
        return header if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())


def drain(tensors: Iterator) -> None:
    """Finish a receive whose consumer stopped early, so the sender's broadcasts all complete."""
    for _ in tensors:
        pass
