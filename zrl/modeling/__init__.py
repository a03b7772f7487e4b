"""What every model family shares, belonging to no single architecture.

Packing and document layouts (packing), the chunked LM head and per-token log-probs under the engine's
sampling distribution (logprobs), `PackedCausalLM` and `TokenLogprobs` (causal_lm), causal attention on
packed streams (attention), RoPE (rope), RMSNorm (blocks), the fused SwiGLU experts (experts), the FP32
op set (precision), optimizer parameter groups (params), routing records and statistics for any k with
or without a skip class (routing), config errors (config), Hugging Face names and tensor I/O
(hf_names, hf_io), the fused kernels with their PyTorch references (kernels), and low-rank adapters
on any family's model (lora, which imports torch). Shape letters: docs/shapes.md.

A family package (zrl/moepp, zrl/qwen3_moe) imports from here; nothing here imports a family. Importing
this package imports no torch (config and hf_names are torch-free).
"""
