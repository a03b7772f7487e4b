"""Parameters a rank leaves unused still get a (zero) gradient under FSDP2, with torch's
`set_reduce_scatter_unused_params` (newer torch) and with the fallback used where it is missing
(torch 2.11), so every rank reduce-scatters the same tensors (zrl/trainer/distributed.py)."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from zrl.moepp import load_hf_checkpoint
from zrl.trainer import TrainerSettings, TrainerWorker

pytestmark = pytest.mark.filterwarnings("ignore:.*returned a view tensor")

T = 12


def all_skip_step(model):
    """Forward/backward with every token of every layer replayed to the skip class: the reference
    experts op never touches the expert weights, and the gates (hence the routers) multiply nothing."""
    cfg = model.config
    ids = torch.arange(3, 3 + T)
    replay = torch.full((T, cfg.num_hidden_layers), cfg.num_experts, dtype=torch.uint8)
    model.token_logprobs(ids, ids.roll(-1), cu_seqlens=(0, T), routing_replay=replay).logprobs.sum().backward()


def unused_parameters(checkpoint) -> list[str]:
    model = load_hf_checkpoint(checkpoint)
    all_skip_step(model)
    return sorted(n for n, p in model.named_parameters() if p.grad is None)


def test_all_skip_step_leaves_moe_parameters_without_gradient(tiny_checkpoint):
    """The situation the FSDP setting exists for (if this changes, the test below proves nothing)."""
    unused = unused_parameters(tiny_checkpoint)
    # the experts, routers and the norm that feeds only them: measured 23 of the tiny model's tensors
    assert "layers.0.mlp.experts.gate_up_proj" in unused and "layers.0.mlp.gate.down_proj.weight" in unused


@pytest.mark.parametrize("torch_api", [True, False], ids=["set_reduce_scatter_unused_params", "fallback"])
def test_unused_parameters_get_zero_gradients(tiny_checkpoint, single_rank, monkeypatch, torch_api):
    if not torch_api:
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params", raising=False)
    elif not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        pytest.skip("this torch has no set_reduce_scatter_unused_params")
    unused = unused_parameters(tiny_checkpoint)
    worker = TrainerWorker(single_rank, tiny_checkpoint, TrainerSettings(param_dtype="float32", kernels="reference"))
    all_skip_step(worker.model)
    grads = {n: p.grad for n, p in worker.model.named_parameters()}
    assert [n for n, g in grads.items() if g is None] == []
    assert all(torch.count_nonzero(grads[n].full_tensor()) == 0 for n in unused)
    assert all(torch.count_nonzero(g.full_tensor()) > 0 for n, g in grads.items() if n.startswith("embed"))
    worker.shutdown()
