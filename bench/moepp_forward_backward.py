"""Forward + backward throughput of zrl's MoE++ model vs transformers' ZayaForCausalLM (same weights).

Both run the trainer's computation on the same tokens: per-token log-probabilities of the next token,
summed, then backward. transformers materialises the [B, S, V] logits and takes log_softmax; zrl uses
its chunked fp32 LM head (`token_logprobs`). A third row runs zrl on a packed stream of documents
of random lengths with the same token count (no padding; per-document attention).

Usage: .venv/bin/python bench/moepp_forward_backward.py [--iters 7] [--threads 2]
Prints tokens/s per model (fastest step) and the zrl/transformers speed ratio for each config.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from transformers import ZayaConfig, ZayaForCausalLM

from zrl.moepp.config import MoEPPConfig
from zrl.moepp.family import MoEPPFamily
from zrl.moepp.model import MoEPPForCausalLM

# name -> (transformers config, (B, S), iteration multiplier: tiny steps are short and noisier)
CONFIGS = {
    "tiny": (dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=16), (4, 128), 6),
    "small": (dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, moe_intermediate_size=256, num_experts=8,
                   router_hidden_size=64), (4, 512), 1),
}


def build(hf_kwargs: dict) -> tuple[ZayaForCausalLM, MoEPPForCausalLM]:
    torch.manual_seed(0)
    ref = ZayaForCausalLM(ZayaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **hf_kwargs)).train()
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.qk_norm.temp.fill_(1.0)  # the default 0 makes attention uniform
    ours = MoEPPForCausalLM(MoEPPConfig.from_hf_dict(ref.config.to_diff_dict())).train()
    state = ours.state_dict()
    with torch.no_grad():
        for key, tensor in ref.state_dict().items():
            if "rotary_emb" in key or (key == "lm_head.weight" and ours.lm_head is None):
                continue
            state[MoEPPFamily.hf_names.param_name(key)].copy_(tensor)
    return ref, ours


def time_interleaved(steps, iters: int) -> list[float]:
    """Fastest step of each callable (seconds), run round-robin. The minimum, not the median: on a
    shared machine other processes only ever add time, and in bursts."""
    for step in steps:  # warm-up (allocator, lazy inits)
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(iters):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - start)
    return [min(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"fastest of interleaved forward+backward steps ({args.iters} x config multiplier); "
          f"load average {os.getloadavg()[0]:.2f} (other processes share the cores)")
    print(f"{'config':<8} {'tokens':>7} {'transformers tok/s':>19} {'zrl tok/s':>10} {'ratio':>6} "
          f"{'zrl packed tok/s':>17}")
    for name, (hf_kwargs, (batch, seq), iters_scale) in CONFIGS.items():
        ref, ours = build(hf_kwargs)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, hf_kwargs["vocab_size"], (batch, seq), generator=gen)
        targets = torch.roll(ids, -1, dims=1)
        lens = torch.randint(seq // 8, seq, (4 * batch,), generator=gen)
        lens = lens[lens.cumsum(0) < ids.numel()]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0), torch.tensor([ids.numel()])])

        def step_ref():
            ref.zero_grad(set_to_none=True)
            logp = torch.log_softmax(ref(ids).logits.float(), dim=-1)
            logp.gather(-1, targets[..., None]).sum().backward()

        def step_ours():
            ours.zero_grad(set_to_none=True)
            ours.token_logprobs(ids, targets).logprobs.sum().backward()

        def step_packed():
            ours.zero_grad(set_to_none=True)
            ours.token_logprobs(ids.reshape(-1), targets.reshape(-1), cu_seqlens=cu).logprobs.sum().backward()

        tokens = ids.numel()
        t_ref, t_ours, t_packed = time_interleaved([step_ref, step_ours, step_packed], args.iters * iters_scale)
        print(f"{name:<8} {tokens:>7} {tokens / t_ref:>19.0f} {tokens / t_ours:>10.0f} {t_ref / t_ours:>6.2f} "
              f"{tokens / t_packed:>17.0f}  ({len(cu) - 1} docs)")


if __name__ == "__main__":
    main()
