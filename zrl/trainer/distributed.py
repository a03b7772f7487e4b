"""Process group, device mesh and FSDP2 sharding of the MoE++ policy for one trainer rank.

Responsibility: join the trainer pool's torch.distributed group from the rendezvous the controller
hands out (gloo on CPU, NCCL on GPU), build a 1-D (FSDP) or 2-D (HSDP: replicate x shard) device
mesh, and apply `fully_shard` per decoder layer and to the root (the model itself holds no
distributed code, docs/design.md style rule 4).

Invariants:
- Gradient reduction SUMS over data-parallel ranks (no division by the world size): every loss term
  the trainer back-propagates is already normalised by GLOBAL counts (docs/algorithms.md §4), so the sum
  over microbatches and ranks is the global-batch gradient itself. The default FSDP2 average would
  shrink it by the data-parallel size.
- Parameters that get no gradient on a rank (in a layer where every local token took the skip class,
  the reference experts op never touches the experts, and the router and the norm feeding them
  contribute nothing) are reduce-scattered as zeros, so every rank joins the same collectives
  whatever its tokens routed to. FSDP2 reduce-scatters only the parameters that have a gradient:
  ranks that differ there would run collectives of different sizes (a hang, or a mismatch error).
  Newer torch does it with `set_reduce_scatter_unused_params`; where that is missing (torch 2.11),
  `_ZeroUnusedGrads` gives every parameter of a layer a gradient (zeros where autograd left none)
  just before the layer's reduce-scatter.
- Mixed precision: parameters are kept (sharded) in fp32 and all-gathered in `param_dtype`;
  gradients are reduced in fp32; forward inputs are not cast (the residual stream entering each
  layer stays fp32, zrl/modeling/precision.py).
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a trainer rank joins the pool's process group (chosen by the controller)."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: str | None = None  # None: "nccl" when CUDA is available, else "gloo"
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in (0, 65536), got {self.master_port}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {self.backend!r}")

    @property
    def resolved_backend(self) -> str:
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(rendezvous: Rendezvous) -> bool:
    """Join the default process group; returns True if this call created it (and so should destroy it).

    An already initialised group is reused when its rank and size match the rendezvous (several
    workers built one after another in one process, e.g. in tests).
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rendezvous.rank, rendezvous.world_size):
            raise RuntimeError(f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already "
                               f"exists; the rendezvous asks for rank {rendezvous.rank} of {rendezvous.world_size}")
        return False
    backend = rendezvous.resolved_backend
    if backend == "nccl":
        torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group(backend, store=_rendezvous_store(rendezvous), rank=rendezvous.rank,
                            world_size=rendezvous.world_size, timeout=datetime.timedelta(seconds=rendezvous.timeout_s))
    logger.info("joined %s process group as rank %d of %d", backend, rendezvous.rank, rendezvous.world_size)
    return True


def _rendezvous_store(rendezvous: Rendezvous) -> dist.TCPStore:
    """The group's key-value store. Rank 0 serves it on `master_addr` only (a socket bound there and
    handed to the store: torch's own TCPStore server would listen on every interface), so a run on
    one machine, which meets at 127.0.0.1, opens no port to the network."""
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    if rendezvous.rank != 0:
        return dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size, False,
                             timeout=timeout)
    family = socket.AF_INET6 if ":" in rendezvous.master_addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((rendezvous.master_addr, rendezvous.master_port))
    sock.listen()
    return dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size, True,
                         timeout=timeout, master_listen_fd=sock.detach())


def device_of_backend(backend: str) -> torch.device:
    """The device this rank computes on: its current CUDA device under NCCL, the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def build_mesh(device_type: str, world_size: int, hsdp_replicas: int = 1) -> DeviceMesh:
    """1-D mesh ("shard",) for FSDP, or 2-D ("replicate", "shard") for HSDP across `hsdp_replicas` groups.

    HSDP shards each parameter within a group of world_size / hsdp_replicas ranks (e.g. one node) and
    replicates across groups, so all-gathers stay inside a node and only the gradient all-reduce
    crosses nodes.
    """
    if hsdp_replicas < 1 or world_size % hsdp_replicas:
        raise ValueError(f"hsdp_replicas ({hsdp_replicas}) must divide world_size ({world_size})")
    if hsdp_replicas == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (hsdp_replicas, world_size // hsdp_replicas),
                            mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype,
                units: Sequence[nn.Module] | None = None) -> None:
    """`fully_shard` every unit (the model family's `fsdp_units`; default: every decoder layer
    `model.layers`), then the root (embedding, final norm, tied LM head).

    `token_logprobs` (and `token_loss`) is registered as a forward method so the root's parameters are gathered when the
    trainer calls it instead of `forward` (not `hidden_states`: both call it, and the root's hooks must
    run once per pass).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    units = list(model.layers if units is None else units)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "token_logprobs")
    if hasattr(model, "token_loss"):  # the LM head fused with the loss (zrl.trainer.loss)
        register_fsdp_forward_method(model, "token_loss")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average, over ranks (see the module docstring); pure SUM also works on gloo.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # Unused parameters are reduce-scattered as zeros (module docstring): without that, two ranks whose
    # tokens used different parameters reduce-scatter different tensors (measured on 2 gloo ranks: a
    # "Received data size doesn't match expected size" abort). Only the decoder layers can leave a
    # parameter unused (their MoE block); the root's embedding, norm and LM head are always used.
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        model.set_reduce_scatter_unused_params(True)
    else:
        for unit in units:
            unit.register_forward_pre_hook(_zero_unused_grads_in_backward)


def _zero_unused_grads_in_backward(layer: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a sharded layer: route its input through `_ZeroUnusedGrads`.

    Registered after `fully_shard`, it runs after FSDP's own pre-forward hook, which routed the
    input through the function whose backward reduce-scatters the layer's gradients; so in backward
    `_ZeroUnusedGrads` runs first, once the layer's own backward is done.
    """
    x, *rest = args
    if not (torch.is_grad_enabled() and x.requires_grad):
        return args
    return (_ZeroUnusedGrads.apply(x, layer), *rest)


class _ZeroUnusedGrads(torch.autograd.Function):
    """Identity on the layer input x [T, D]; its backward gives every parameter of the layer that
    autograd left without a gradient a zero one, so FSDP2 reduce-scatters all of them. (A gradient
    autograd delivered later anyway would be added to those zeros: the result is the same.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for param in ctx.layer.parameters():  # the unsharded parameters, gathered for backward
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        return grad, None
