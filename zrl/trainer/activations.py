"""Host offload of the activations autograd keeps for backward (ZAYA1-8B report §IV-C, "memory and recompute").

With activation checkpointing on every decoder layer, what autograd still holds between forward and
backward is, per layer, the layer's input [T, D] (kept by the checkpoint to recompute the layer),
plus the few tensors outside the layers (embedding output, final hidden states for the LM head).
`OffloadSavedTensors` moves those to host memory as they are saved and brings them back when
backward unpacks them, so the accelerator holds one layer's activations at a time.

Invariants:
- Parameters are never copied (FSDP2's unsharded parameters are `nn.Parameter`s and are re-gathered
  for backward anyway), nor tensors under `min_bytes` (index tensors, scalars) — copying them costs
  more than it saves.
- Unpacking returns a tensor equal to the one saved, on its original device: gradients are
  bit-identical with and without offload.
- Like `torch.autograd.graph.save_on_cpu`, host tensors are copied too; the trainer enables offload
  only when it computes on an accelerator.
"""

from __future__ import annotations

import torch
from torch import nn


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
