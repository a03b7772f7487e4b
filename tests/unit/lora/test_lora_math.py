"""The math of LoRA on every registered family (issue 45's checks), fp32 unless stated:
B = 0 gives bitwise the base's log-probs; a merged checkpoint reproduces the adapted model's log-probs
to 1e-6 (measured 2026-11-28, CPU, torch 2.13: at most 9.5e-7, i.e. 2 ulps of log-probs near -4.9,
over 6 seeds and 3 families); gradients reach only the adapters; under router replay the recorded
experts are used and their adapters compute them."""

import pytest
import torch

from lora_testlib import FAMILIES, adapted, shifted_record, spec, stream, tiny_config, tiny_model
from zrl.models import get_family
from zrl.modeling.lora import (LoRALinear, LoRASwiGLUExperts, adapted_modules, adapter_parameters, apply_lora,
                               is_adapter, merged_state_dict)


def logprobs(model, replay=None, seed=0):
    ids, targets, cu = stream(seed)
    return model.token_logprobs(ids, targets, cu_seqlens=cu, routing_replay=replay)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", ["per_expert", "shared_a"])
@pytest.mark.parametrize("model_type", FAMILIES)
@torch.no_grad()
def test_zero_b_gives_the_base_log_probs_bitwise(model_type, experts, dtype):
    model = tiny_model(model_type, dtype=dtype)
    base = logprobs(model)
    names = apply_lora(model, spec(model_type, targets={"experts": experts}), seed=3)
    kinds = {type(m) for _, m in adapted_modules(model)}
    assert kinds == {LoRALinear, LoRASwiGLUExperts} and len(names) > 4
    a = [p for n, p in adapter_parameters(model).items() if n.endswith("lora_A")]
    assert all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in a)  # A random, B = 0
    assert all(p.dtype == dtype for n, p in model.named_parameters() if not is_adapter(n))
    out = logprobs(model)
    assert torch.equal(out.logprobs, base.logprobs)
    assert torch.equal(out.routing.chosen_ids, base.routing.chosen_ids)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_merged_checkpoint_reproduces_the_adapted_log_probs(model_type, tmp_path):
    family = get_family(model_type)
    config = tiny_config(model_type)
    base = tiny_model(model_type)
    family.save_hf_checkpoint(base.state_dict(), tmp_path / "base", config=config, dtype=torch.float32)
    model = adapted(model_type, b_std=0.02)
    with torch.no_grad():
        out = logprobs(model)
        moved = (out.logprobs - logprobs(base).logprobs).abs().max()
    assert moved > 1e-3  # the adapters change the model
    family.save_hf_checkpoint(merged_state_dict(model), tmp_path / "merged", config=config, dtype=torch.float32)
    merged = family.load_model(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():  # the merged model replays the adapted model's routing, as the trainer the engine's
        again = logprobs(merged, replay=out.routing.chosen_ids)
    assert (again.logprobs - out.logprobs).abs().max() <= 1e-6
    assert _layout(tmp_path / "merged") == _layout(tmp_path / "base")


def _layout(path):
    from safetensors import safe_open

    layout = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                layout[key] = (tuple(t.get_shape()), t.get_dtype())
    return layout


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradients_reach_only_the_adapters(model_type):
    model = adapted(model_type, b_std=0.02, dropout=0.1)
    model.train()
    out = logprobs(model)
    out.logprobs.sum().backward()
    adapters = adapter_parameters(model)
    for name, param in model.named_parameters():
        if name in adapters:
            assert param.requires_grad and param.grad is not None, name
            assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name


@pytest.mark.parametrize("model_type", FAMILIES)
@torch.no_grad()
def test_replay_uses_the_recorded_experts_and_their_adapters_compute_them(model_type):
    base = tiny_model(model_type)
    model = adapted(model_type, b_std=0.02, targets={"attention": False, "dense_mlp": False, "router": False})
    record = shifted_record(model_type, logprobs(model).routing.chosen_ids)
    out = logprobs(model, replay=record)
    assert torch.equal(out.routing.chosen_ids, record)
    # only the experts are adapted: under the same replay the base differs, the merged model agrees
    assert (out.logprobs - logprobs(base, replay=record).logprobs).abs().max() > 1e-3
    merged = tiny_model(model_type)
    merged.load_state_dict(merged_state_dict(model))
    again = logprobs(merged, replay=record)
    assert torch.equal(again.routing.chosen_ids, record)
    assert (again.logprobs - out.logprobs).abs().max() <= 1e-6


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpointed_layers_replay_with_adapters_as_without(model_type):
    """Activation checkpointing recomputes the adapted layers with the same experts: gradients agree."""
    grads = []
    for checkpointed in (False, True):
        model = adapted(model_type, b_std=0.02)
        model.set_activation_checkpointing(checkpointed)
        logprobs(model).logprobs.sum().backward()
        grads.append({n: p.grad for n, p in adapter_parameters(model).items()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_router_adapters_are_refused_where_the_family_has_no_router_module():
    for model_type in FAMILIES:
        if get_family(model_type).lora_modules.router:
            continue
        with pytest.raises(ValueError, match=rf"model.lora.targets.router: {model_type} declares no router"):
            apply_lora(tiny_model(model_type), spec(model_type, targets={"router": True}))


def test_adapting_twice_is_refused():
    model = adapted(FAMILIES[0])
    with pytest.raises(ValueError, match="already has adapters"):
        apply_lora(model, spec(FAMILIES[0]))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_meta_models_are_adapted_and_initialised_later(model_type):
    from zrl.modeling.lora import reset_adapters

    with torch.device("meta"):
        model = get_family(model_type).build(tiny_config(model_type))
    apply_lora(model, spec(model_type))
    assert all(p.is_meta for p in adapter_parameters(model).values())
    model.to_empty(device="cpu")
    reset_adapters(model, seed=3)
    reference = adapted(model_type, adapter_seed=3)
    for name, param in adapter_parameters(reference).items():
        assert torch.equal(adapter_parameters(model)[name], param), name
