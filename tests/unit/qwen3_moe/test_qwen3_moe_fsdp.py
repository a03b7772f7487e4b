"""The model wrapped from outside as the trainer does: FSDP2 per decoder layer + root, bf16 mixed
precision, activation checkpointing inside; one process, gloo, world size 1."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from qwen3_moe_testlib import next_token_targets, ours_from_reference, packed_documents, random_reference
from zrl.modeling.params import optimizer_param_groups


@pytest.fixture
def process_group(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised by another test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_bf16_wrapped_equals_unwrapped(process_group):
    ref = random_reference(seed=1, mlp_only_layers=[1])
    wrapped = ours_from_reference(ref)
    wrapped.set_activation_checkpointing(True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    for layer in wrapped.layers:  # the FSDP2 units: decoder layers, then the root
        fully_shard(layer, mp_policy=policy)
    fully_shard(wrapped, mp_policy=policy)
    register_fsdp_forward_method(wrapped, "token_logprobs")
    plain = ours_from_reference(ref).to(torch.bfloat16)

    docs, ids, cu = packed_documents(0, [8, 12])
    targets = next_token_targets(docs)
    out = wrapped.token_logprobs(ids, targets, cu_seqlens=cu, with_entropy=True)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    expected = plain.token_logprobs(ids, targets, cu_seqlens=cu, with_entropy=True,
                                    routing_replay=out.routing.chosen_ids)
    (expected.logprobs.sum() + expected.entropy.sum()).backward()
    # the same bf16 ops in the same order: measured bitwise equal
    assert torch.equal(out.logprobs, expected.logprobs)
    assert torch.equal(out.routing.native_ids, expected.routing.native_ids)
    plain_grads = dict(plain.named_parameters())
    for name, p in wrapped.named_parameters():
        grad = p.grad.full_tensor()
        assert grad.dtype == torch.float32
        assert torch.equal(grad, plain_grads[name].grad.float()), name


def test_optimizer_groups_put_matrices_in_muon():
    model = ours_from_reference(random_reference(seed=0, mlp_only_layers=[1]))
    groups = optimizer_param_groups(model)
    muon, adamw = set(groups["muon"]), set(groups["adamw"])
    assert {"layers.0.mlp.gate.weight", "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
            "layers.1.mlp.up_proj.weight", "layers.2.self_attn.q_proj.weight"} <= muon
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= adamw
    assert muon | adamw == {n for n, _ in model.named_parameters()} and not muon & adamw
