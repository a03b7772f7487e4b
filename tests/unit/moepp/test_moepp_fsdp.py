"""The model wrapped from outside as the trainer does: FSDP2 per layer + root, bf16 mixed precision.

One process, gloo, world size 1: checks that the model code composes with `fully_shard`
(entry point through `forward`, fp32 residual stream kept with cast_forward_inputs=False, activation
checkpointing inside, buffers untouched) and gives what the unwrapped bf16 model gives.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from moepp_testlib import ours_from_reference, random_reference


@pytest.fixture
def process_group(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised by another test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("entry", ["registered_method", "forward"])
def test_fsdp2_bf16_wrapped_equals_unwrapped(process_group, entry):
    ref = random_reference(seed=1, skip_bias=0.0)
    wrapped = ours_from_reference(ref)
    wrapped.set_activation_checkpointing(True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    for layer in wrapped.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(wrapped, mp_policy=policy)
    if entry == "registered_method":  # what the trainer does
        register_fsdp_forward_method(wrapped, "token_logprobs")
        call = wrapped.token_logprobs
    else:
        def call(ids, targets, **kw):
            return wrapped(ids, targets=targets, **kw)
    plain = ours_from_reference(ref).to(torch.bfloat16)

    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 96, (20,), generator=gen), torch.randint(0, 96, (20,), generator=gen)
    cu = torch.tensor([0, 8, 20])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call(ids, targets, cu_seqlens=cu, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
    expected = plain.token_logprobs(ids, targets, cu_seqlens=cu, with_entropy=True,
                                    routing_replay=out.routing.chosen_ids)
    (expected.logprobs.sum() + expected.entropy.sum()).backward()
    # same bf16 ops in the same order: measured bitwise equal
    assert torch.equal(out.logprobs, expected.logprobs)
    assert torch.equal(out.routing.native_ids, expected.routing.native_ids)
    assert wrapped.layers[0].mlp.gate.balancing_biases.dtype == torch.float32
    plain_grads = dict(plain.named_parameters())
    for name, p in wrapped.named_parameters():
        grad = p.grad.full_tensor()  # fp32 (sharded parameters keep fp32 master values)
        assert grad.dtype == torch.float32
        assert torch.equal(grad, plain_grads[name].grad.float()), name
