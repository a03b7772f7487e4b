"""The adapters as a PEFT adapter directory: written, read back into a fresh adapted model (the same
log-probs, bitwise), and read by PEFT itself onto transformers' model of the base checkpoint (the same
logits: measured 2026-11-28, fp32, max |difference| 2.4e-7 for Qwen3-MoE's experts, 0 for attention)."""

import json

import pytest
import torch

from lora_testlib import FAMILIES, adapted, stream, tiny_config, tiny_model
from zrl.models import get_family
from zrl.modeling.lora import adapter_parameters, load_peft_adapter, save_peft_adapter
from zrl.modeling.lora.experts import ExpertAdapters, lora_experts_grouped_mm, lora_experts_reference
from zrl.modeling.kernels.experts.grouped_mm import moe_experts_grouped_mm
from zrl.modeling.kernels.experts.reference import moe_experts_reference


def logprobs(model):
    ids, targets, cu = stream()
    return model.token_logprobs(ids, targets, cu_seqlens=cu).logprobs


@pytest.mark.parametrize("experts", ["per_expert", "shared_a"])
@pytest.mark.parametrize("model_type", FAMILIES)
@torch.no_grad()
def test_adapter_directory_round_trips(model_type, experts, tmp_path):
    model = adapted(model_type, b_std=0.02, targets={"experts": experts})
    save_peft_adapter(model, tmp_path / "adapter", base_model="base-dir")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == \
        ("LORA", 4, 8.0, "base-dir")
    fresh = adapted(model_type, adapter_seed=7, targets={"experts": experts})  # other A, B = 0
    load_peft_adapter(fresh, tmp_path / "adapter")
    for name, param in adapter_parameters(model).items():
        assert torch.equal(adapter_parameters(fresh)[name], param), name
    assert torch.equal(logprobs(fresh), logprobs(model))


@torch.no_grad()
def test_reading_checks_rank_and_completeness(tmp_path):
    model_type = FAMILIES[0]
    save_peft_adapter(adapted(model_type, targets={"experts": None}), tmp_path / "attention_only")
    with pytest.raises(ValueError, match="no base_model.model.*lora_A.weight"):
        load_peft_adapter(adapted(model_type), tmp_path / "attention_only")
    with pytest.raises(ValueError, match="r=4, lora_alpha=8.0; the model's adapters have r=8"):
        load_peft_adapter(adapted(model_type, rank=8, targets={"experts": None}), tmp_path / "attention_only")
    with pytest.raises(ValueError, match="match no adapter of the model"):
        load_peft_adapter(adapted(model_type, targets={"experts": None, "dense_mlp": False}),
                          tmp_path / "attention_only")


@pytest.mark.parametrize("experts", ["per_expert", "shared_a"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])
def test_peft_reads_the_directory_onto_transformers_model(model_type, experts, tmp_path):
    """Attention and experts (PEFT 0.21 on transformers 5 remaps every `gate_proj`/`up_proj`/`down_proj`
    target to the fused experts, so a dense MLP's adapters are not read by PEFT; vLLM reads them by key)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    family = get_family(model_type)
    base = tiny_model(model_type)
    family.save_hf_checkpoint(base.state_dict(), tmp_path / "base", config=tiny_config(model_type),
                              dtype=torch.float32)
    model = adapted(model_type, b_std=0.05, targets={"experts": experts, "dense_mlp": False, "router": False})
    save_peft_adapter(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = stream()[0][None, :16]
    with torch.no_grad():
        theirs, ours = peft_model(ids).logits[0], model(ids[0]).logits
        assert (ours - base(ids[0]).logits).abs().max() > 1e-2
    assert (theirs - ours).abs().max() <= 1e-5


@pytest.mark.parametrize("shared", [False, True])
def test_grouped_mm_path_matches_the_reference_loop(shared):
    """The grouped-GEMM path (CUDA's, run here on torch's CPU kernel) against the reference loop, forward
    and backward, fp32; with B = 0 both are bitwise the base op's own path."""
    e, d, f, r, t = 4, 64, 32, 4, 40
    gen = torch.Generator().manual_seed(0)
    w_gu, w_d = torch.randn(e, 2 * f, d, generator=gen) / 8, torch.randn(e, d, f, generator=gen) / 6
    x = torch.randn(t, d, generator=gen, requires_grad=True)
    ids = torch.randint(0, e + 1, (t,), generator=gen)  # the skip class e included
    gate = torch.rand(t, generator=gen, requires_grad=True)
    ea = 1 if shared else e
    tensors = [torch.randn(*shape, generator=gen).div(8).requires_grad_()
               for shape in ((ea, r, d), (e, 2 * f, r), (ea, r, f), (e, d, r))]
    adapters = ExpertAdapters(*tensors, scale=2.0, dropout=0.0)
    results = []
    for op in (lora_experts_reference, lora_experts_grouped_mm):
        y = op(x, ids, gate, w_gu, w_d, adapters)
        results.append((y, torch.autograd.grad(y.square().sum(), [x, gate, *tensors])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-6)
    for ours, ref in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    zero_b = ExpertAdapters(tensors[0], torch.zeros_like(tensors[1]), tensors[2], torch.zeros_like(tensors[3]),
                            scale=2.0, dropout=0.0)
    with torch.no_grad():
        assert torch.equal(lora_experts_grouped_mm(x, ids, gate, w_gu, w_d, zero_b),
                           moe_experts_grouped_mm(x, ids, gate, w_gu, w_d))
        assert torch.equal(lora_experts_reference(x, ids, gate, w_gu, w_d, zero_b),
                           moe_experts_reference(x, ids, gate, w_gu, w_d))
