"""The FP32 op set of the MoE++ model: the single place that says which operations run in fp32.

ZAYA1-8B report §IV-D: weights and activations are bf16, except a small set of operations that run in fp32
identically in the trainer and in the rollout engine (log-prob agreement between the two depends on
the sets being equal, so the vLLM integration imports `FP32_OPS` from here rather than restating it).

The compute dtype of everything else is the dtype of the weights at forward time (bf16 under FSDP2
mixed precision or after `model.to(torch.bfloat16)`; fp32 for the all-fp32 test mode, where every cast
below is a no-op). Call sites name their op with `to_op_dtype(x, Fp32Op.X)` so they can be found.

| op               | where                                                              |
|------------------|--------------------------------------------------------------------|
| LM_HEAD          | final hidden states x embedding matrix, logits                     |
| LOGPROB          | log-softmax, target gather, entropy (chunked, see logprobs.py)     |
| CCA_STATE        | q/k causal convolutions, value time shift (the decode-time state)  |
| QK_MEAN          | CCA mean skip: (q + repeat_kv(k)) / 2 and its per-group mean        |
| QK_NORM          | L2 normalisation of q and k, key temperature, partial RoPE          |
| RMSNORM          | every RMSNorm (statistics and weight multiply)                     |
| ROUTER_SOFTMAX   | router class probabilities, the biased argmax, the gate weight      |
| RESIDUAL         | embedding scale/bias, residual scaling and additions (fp32 stream)  |

Not in the set (compute dtype): every linear projection, the router MLP, SDPA, the SwiGLU experts.
"""

from __future__ import annotations

import enum

import torch


class Fp32Op(enum.Enum):
    LM_HEAD = "lm_head"
    LOGPROB = "logprob"
    CCA_STATE = "cca_state"
    QK_MEAN = "qk_mean"
    QK_NORM = "qk_norm"
    RMSNORM = "rmsnorm"
    ROUTER_SOFTMAX = "router_softmax"
    RESIDUAL = "residual"


FP32_OPS: frozenset[Fp32Op] = frozenset(Fp32Op)


def fp32_without_tf32() -> None:
    """Keep fp32 math fp32 on CUDA in this process: no TF32 in cuDNN's convolutions (torch's default is on:
    the CCA reference's convolutions, CCA_STATE, would round their inputs to TF32's 10 mantissa bits,
    ~1e-3 relative) nor in cuBLAS's fp32 GEMMs (off by default; the rollout engine's CCA convolutions are
    one, an einsum). Both sides then compute the FP32 op set alike. The trainer and the vLLM model call it
    when they build the model. (torch's legacy flags, which the `allow_tf32` readers expect: setting its
    newer `fp32_precision` API as well makes those readers raise.)"""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def op_dtype(op: Fp32Op, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype `op` runs in when the model computes in `compute_dtype`."""
    return torch.float32 if op in FP32_OPS else compute_dtype


def to_op_dtype(x: torch.Tensor, op: Fp32Op, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast `x` to the dtype of `op` (a no-op when it already has it)."""
    return x.to(op_dtype(op, compute_dtype if compute_dtype is not None else x.dtype))
