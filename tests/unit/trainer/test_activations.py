"""Activation checkpointing modes (zrl.trainer.activations): every mode gives the plain model's gradients,
and each mode really changes what is kept for backward and what backward recomputes."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zrl.moepp.config import MoEPPConfig
from zrl.moepp.model import MoEPPForCausalLM
from zrl.trainer.activations import checkpointed_layers, compute_bound_ops, configure_checkpointing

T = 48
CU = torch.tensor([0, 1, 20, 21, T])  # ragged documents with length-1 ones
# mode name -> configure_checkpointing arguments
MODES = {
    "none": dict(enabled=False),
    "every_layer": dict(enabled=True),
    "every_2nd_layer": dict(enabled=True, every_layers=2),
    "selective": dict(enabled=True, selective=True),
    "selective_every_2nd": dict(enabled=True, every_layers=2, selective=True),
}


def tiny_model() -> MoEPPForCausalLM:
    torch.manual_seed(0)
    config = MoEPPConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                         router_hidden_size=16, attention_bias=True)
    model = MoEPPForCausalLM(config)
    with torch.no_grad():  # larger than the 0.02 init, so every layer and expert matters to the gradients
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def ids_and_targets():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (T,), generator=gen)
    return ids, torch.randint(3, 96, (T,), generator=gen)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: all of them, and the compute-bound ones."""

    def __init__(self):
        super().__init__()
        self.total = self.compute_bound = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.compute_bound += func in compute_bound_ops()
        return func(*args, **(kwargs or {}))


def run(mode: str) -> dict:
    """One forward and backward: gradients, bytes autograd keeps outside the checkpoints, ops in backward."""
    model = tiny_model()
    configure_checkpointing(model, **MODES[mode])
    ids, targets = ids_and_targets()
    saved_bytes = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.token_logprobs(ids, targets, cu_seqlens=CU, with_entropy=True)
    loss = out.logprobs.sum() + 0.1 * out.entropy.sum()
    with OpCounter() as backward_ops:
        loss.backward()
    return dict(logprobs=out.logprobs.detach(), grads={n: p.grad for n, p in model.named_parameters()},
                saved_bytes=sum(saved_bytes), backward_ops=backward_ops.total,
                backward_compute_bound=backward_ops.compute_bound)


@pytest.fixture(scope="module")
def runs():
    return {mode: run(mode) for mode in MODES}


def test_checkpointed_layers():
    assert checkpointed_layers(4, enabled=True) == [0, 1, 2, 3]
    assert checkpointed_layers(5, enabled=True, every_layers=2) == [0, 2, 4]
    assert checkpointed_layers(4, enabled=False, every_layers=2) == []
    with pytest.raises(ValueError, match="every_layers must be >= 1"):
        checkpointed_layers(4, enabled=True, every_layers=0)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_every_mode_gives_the_plain_gradients(runs, mode):
    plain, other = runs["none"], runs[mode]
    assert torch.equal(other["logprobs"], plain["logprobs"])
    assert other["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        # recomputation repeats the forward's ops in order; selective reuses its outputs: measured bitwise equal
        assert other["grads"][name] is not None, name
        torch.testing.assert_close(other["grads"][name], grad, rtol=0, atol=0, msg=name)


def test_modes_change_what_is_kept_and_recomputed(runs):
    kept = {m: r["saved_bytes"] for m, r in runs.items()}
    ops = {m: r["backward_ops"] for m, r in runs.items()}
    gemms = {m: r["backward_compute_bound"] for m, r in runs.items()}
    # Checkpointing keeps less for backward (what autograd holds outside the checkpointed layers):
    # measured 2,782,176 B without, 1,439,472 every 2nd layer, 121,344 every layer.
    assert kept["none"] > kept["every_2nd_layer"] > kept["every_layer"]
    # ... and pays for it in backward: measured 2,076 ops without, 2,699 every 2nd layer, 3,308 every layer,
    assert ops["none"] < ops["every_2nd_layer"] < ops["every_layer"]
    # of which matrix multiplies and attention: 102 without, 136 every 2nd layer, 168 every layer.
    assert gemms["none"] < gemms["every_2nd_layer"] < gemms["every_layer"]
    # Selective: autograd outside holds what full checkpointing holds (the compute-bound outputs live in
    # the checkpoint's cache), backward recomputes the elementwise ops (measured 3,242 ops) but no matrix
    # multiply or attention runs twice: exactly as many as without checkpointing.
    assert kept["selective"] == kept["every_layer"] and kept["selective_every_2nd"] == kept["every_2nd_layer"]
    assert ops["none"] < ops["selective"] < ops["every_layer"]
    assert gemms["selective"] == gemms["selective_every_2nd"] == gemms["none"]


def test_selective_under_fsdp2_bf16_gives_the_full_checkpointing_gradients(single_rank):
    """What the trainer runs: layers and root wrapped with fully_shard, bf16 compute, fp32 residual stream
    (the FSDP2 hooks run inside the checkpointed region, and their all-gathers are recomputed, not cached)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def grads(mode):
        model = tiny_model()
        configure_checkpointing(model, **MODES[mode])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        ids, targets = ids_and_targets()
        model(ids, targets=targets, cu_seqlens=CU).logprobs.sum().backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    full, selective = grads("every_layer"), grads("selective")
    for name, grad in full.items():
        # same bf16 ops in the same order: measured bitwise equal
        torch.testing.assert_close(selective[name], grad, rtol=0, atol=0, msg=name)
