"""Shared helpers of the MoE++ tests: tiny random reference models and weight transfer.

`random_reference(...)` builds transformers' `ZayaForCausalLM` on a tiny config and randomises every
parameter and buffer (scales around 1, non-zero biases and key temperatures, balancing biases chosen
so that some tokens go to the skip class); `ours_from_reference` copies the weights into this
package's model by checkpoint key.
"""

from __future__ import annotations

import math

import torch
from transformers import ZayaConfig, ZayaForCausalLM

from zrl.moepp.config import MoEPPConfig
from zrl.moepp.family import MoEPPFamily
from zrl.moepp.model import MoEPPForCausalLM

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=4, router_hidden_size=16, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def zaya_config(**overrides) -> ZayaConfig:
    kwargs = dict(TINY)
    kwargs.update(overrides)
    return ZayaConfig(**kwargs)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int, skip_bias: float = 0.0) -> None:
    """Random values for every parameter and buffer, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("temp",):
            p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))
        elif "scale" in leaf or (leaf == "weight" and p.dim() == 1):
            p.copy_(1.0 + 0.3 * randn(p.shape))
        elif leaf == "bias" or "bias" in leaf:
            p.copy_(0.1 * randn(p.shape))
        elif "conv" in name:
            p.copy_(randn(p.shape) / math.sqrt(p.shape[1] * p.shape[2]))
        else:
            p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("balancing_biases"):
            b.copy_(0.05 * randn(b.shape))
            b[-1] = skip_bias


def random_reference(seed: int = 0, skip_bias: float = 0.0, **overrides) -> ZayaForCausalLM:
    """A randomised fp32 reference model in eval mode, SDPA attention (the transformers default)."""
    torch.manual_seed(seed)
    ref = ZayaForCausalLM(zaya_config(**overrides)).eval()
    randomise(ref, seed, skip_bias)
    return ref


def config_of(ref: ZayaForCausalLM) -> MoEPPConfig:
    return MoEPPConfig.from_hf_dict(ref.config.to_diff_dict())


@torch.no_grad()
def ours_from_reference(ref: ZayaForCausalLM) -> MoEPPForCausalLM:
    """Our model with the reference's weights, copied by checkpoint key (tied head skipped)."""
    model = MoEPPForCausalLM(config_of(ref))
    ours = model.state_dict()
    seen = set()
    for key, tensor in ref.state_dict().items():
        if key == "lm_head.weight" and model.lm_head is None:
            continue
        if "rotary_emb" in key:
            continue  # recomputed from the config, not a checkpoint tensor
        name = MoEPPFamily.hf_names.param_name(key)
        ours[name].copy_(tensor)
        seen.add(name)
    assert seen == set(ours), f"not copied: {sorted(set(ours) - seen)}"
    return model.eval()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (a scale-aware error that does not blow up on near-zero entries)."""
    return float((actual - expected).abs().max() / expected.abs().max())
