"""Shared helpers of the GLM-4.5 tests: tiny randomised transformers reference models and weight transfer.

`random_reference(...)` builds transformers' `Glm4MoeForCausalLM` on a tiny config and randomises every
parameter and the routers' correction biases (norm weights around 1, non-zero attention biases,
matrices scaled by 1/sqrt(fan-in), router rows spread so the top-k is decisive, biases of the size of
the sigmoid scores so they move the choice); `ours_from_reference` copies the weights into this
package's model by key through the family's HF names.
"""

from __future__ import annotations

import math

import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from zrl.glm4_moe.config import Glm4MoEConfig
from zrl.glm4_moe.family import Glm4MoEFamily
from zrl.glm4_moe.model import Glm4MoEForCausalLM

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, num_nextn_predict_layers=0,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and name.endswith("weight"):  # RMSNorm weights
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):  # router: logits O(3) so the top-k has clear margins
            p.copy_(3.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def reference_config(**overrides) -> Glm4MoeConfig:
    return Glm4MoeConfig(**{**TINY, **overrides})


def random_reference(seed: int = 0, **overrides) -> Glm4MoeForCausalLM:
    """A randomised fp32 reference model in eval mode, SDPA attention (the transformers default)."""
    torch.manual_seed(seed)
    ref = Glm4MoeForCausalLM(reference_config(**overrides)).eval()
    randomise(ref, seed)
    return ref


def our_config(ref: Glm4MoeForCausalLM) -> Glm4MoEConfig:
    return Glm4MoEConfig.from_hf_dict(ref.config.to_dict(), strict=False)


@torch.no_grad()
def ours_from_reference(ref: Glm4MoeForCausalLM) -> Glm4MoEForCausalLM:
    model = Glm4MoEForCausalLM(our_config(ref))
    ours = model.state_dict()
    seen = set()
    for key, tensor in ref.state_dict().items():
        if key == "lm_head.weight" and model.lm_head is None:
            continue
        name = Glm4MoEFamily.hf_names.param_name(key)
        ours[name].copy_(tensor)
        seen.add(name)
    assert seen == set(ours), f"not copied: {sorted(set(ours) - seen)}"
    return model.eval()


def packed_documents(seed: int, lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Random documents, their packed stream [T] and cu_seqlens [N + 1]."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return docs, torch.cat(docs), cu


def next_token_targets(docs: list[torch.Tensor]) -> torch.Tensor:
    """[T]: each document's next token, -1 at its last position (no target)."""
    return torch.cat([torch.cat([d[1:], d.new_tensor([-1])]) for d in docs])
