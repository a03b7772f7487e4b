"""Activation memory of the trainer: what autograd keeps between forward and backward.

Three knobs (zrl.config `resources.activation_checkpointing*`, applied by `configure_checkpointing`):
- which decoder layers are checkpointed: none, every layer, or every k-th (layers 0, k, 2k, ...);
  a checkpointed layer keeps only its input [T, D] and is recomputed in backward.
- selective: a checkpointed layer also keeps the outputs of its compute-bound ops (matrix multiplies,
  grouped expert GEMMs, attention) through torch's selective checkpointing
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, torch >= 2.4), so backward
  recomputes only the elementwise and reduction ops between them: no GEMM runs twice, for the memory of
  those outputs (still less than an unchecked layer, which also keeps its norms, casts, convolutions
  and activation functions).
- host offload (`OffloadSavedTensors`): what autograd still holds (with full checkpointing, per layer
  the layer's input plus the few tensors outside the layers: embedding output, final hidden states for
  the LM head) lives in host memory until backward needs it, so the accelerator holds one layer's
  activations at a time. The outputs selective checkpointing keeps are held by the checkpoint, not
  by autograd's saved tensors, and stay on the accelerator.

Invariants:
- Every mode computes the same gradients: recomputation repeats the forward's ops in the same order
  (the model pins the recomputed layer's expert choices, and both passes dispatch the same ops, which
  selective checkpointing checks), and the selective policy hands back the very tensors the forward
  computed.
- Offload never copies parameters (FSDP2's unsharded parameters are `nn.Parameter`s and are
  re-gathered for backward anyway), nor tensors under `min_bytes` (index tensors, scalars) — copying
  them costs more than it saves.
- Offload unpacking returns a tensor equal to the one saved, on its original device: gradients are
  bit-identical with and without offload.
- Like `torch.autograd.graph.save_on_cpu`, host tensors are copied too; the trainer enables offload
  only when it computes on an accelerator.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def checkpointed_layers(num_layers: int, *, enabled: bool, every_layers: int = 1) -> list[int]:
    """Indices of the decoder layers to checkpoint: every `every_layers`-th from layer 0, or none."""
    if every_layers < 1:
        raise ValueError(f"every_layers must be >= 1, got {every_layers}")
    return list(range(0, num_layers, every_layers)) if enabled else []


def configure_checkpointing(model: nn.Module, *, enabled: bool, every_layers: int = 1,
                            selective: bool = False) -> list[int]:
    """Set the model's activation checkpointing (zrl.modeling.causal_lm `set_activation_checkpointing`); returns the
    checkpointed layer indices."""
    layers = checkpointed_layers(len(model.layers), enabled=enabled, every_layers=every_layers)
    model.set_activation_checkpointing(layers, context_fn=selective_checkpoint_contexts if selective else None)
    return layers


def selective_checkpoint_contexts():
    """`context_fn` for `torch.utils.checkpoint.checkpoint`: keep compute-bound outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_keep_compute_bound)


def _keep_compute_bound(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in compute_bound_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def compute_bound_ops() -> frozenset:
    """The ops whose outputs a selectively checkpointed layer keeps: the matrix multiplies (nn.Linear
    lowers to mm / addmm), grouped expert GEMMs and the attention kernels of every SDPA backend and
    varlen FlashAttention, as far as this torch has them. The CCA reference's convolutions (depthwise/
    grouped, a few taps) are memory-bound: recomputed; its library path runs the grouped one as a `baddbmm`,
    and its Triton path with fp32 weights as a `bmm`, whose fp32 output (4 bytes per channel per token) is
    kept like any GEMM's. With bf16 weights the Triton path's GEMM is bf16 with an fp32 result (`bmm`'s
    out_dtype overload, not the default one in the set): recomputed, a few tenths of a millisecond at 64k
    tokens on the tensor cores, rather than kept at 4 bytes per channel per token. Ops inside
    Triton kernels are invisible to the policy, so a layer's Triton kernels are recomputed whatever they
    compute."""
    names = [("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm"), ("aten", "_grouped_mm"),
             ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_efficient_attention"),
             ("aten", "_scaled_dot_product_cudnn_attention"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
             ("aten", "_flash_attention_forward"), ("aten", "_efficient_attention_forward"),
             ("torch_attn", "_varlen_attn")]
    # torch_attn::_varlen_attn is registered by importing torch.nn.attention.varlen, which
    # zrl.modeling.attention does: by the time a model exists to checkpoint, it is there.
    packets = (getattr(getattr(torch.ops, namespace), name, None) for namespace, name in names)
    return frozenset(packet.default for packet in packets if packet is not None)


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it live in (pinned) host memory until used."""

    def __init__(self, *, min_bytes: int = 1 << 16, pin_memory: bool | None = None) -> None:
        self.min_bytes = min_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if isinstance(tensor, nn.Parameter) or nbytes < self.min_bytes or tensor.layout != torch.strided:
            return tensor
        # empty_like keeps the strides of dense tensors (a transposed view stays transposed), so backward
        # kernels see the same memory layout and give bit-identical results.
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory and tensor.device.type != "cpu")
        host.copy_(tensor, non_blocking=True)
        self.offloaded_tensors += 1
        self.offloaded_bytes += nbytes
        return tensor.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)
