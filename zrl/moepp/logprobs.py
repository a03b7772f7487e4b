"""The model's entry point for per-token log-probabilities (and entropy) through the LM head.

`chunked_token_logprobs` is the LM head + log-softmax gather op of zrl.moepp.kernels.lm_logprobs:
hidden [T, D] x weight [V, D] -> logprob [T] (and entropy [T]) in fp32 (LM_HEAD, LOGPROB of the FP32
op set), targets < 0 ignored, [T, V] logits never materialised in fp32. It dispatches to the fused
Triton kernels (CUDA) or to the chunked PyTorch reference that defines the result (switch:
zrl.moepp.kernels, ZRL_KERNELS). This module only names the op for the model and the package exports.
"""

from zrl.moepp.kernels.lm_logprobs import default_chunk_tokens
from zrl.moepp.kernels.lm_logprobs import token_logprobs as chunked_token_logprobs

__all__ = ["chunked_token_logprobs", "default_chunk_tokens"]
