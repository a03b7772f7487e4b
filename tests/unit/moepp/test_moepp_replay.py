"""Router replay (forced expert ids, gate from the model's own probabilities) and activation checkpointing."""

import pytest
import torch

from moepp_testlib import ours_from_reference, random_reference
from zrl.types import NO_ROUTE

E = 4  # experts of the tiny config; class E is the skip expert
T = 24


def model(seed=5, **kw):
    return ours_from_reference(random_reference(seed=seed, skip_bias=0.0, **kw))


def ids_and_targets(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (T,), generator=gen)
    return ids, torch.randint(0, 96, (T,), generator=gen)


CU = torch.tensor([0, 10, T])


@torch.no_grad()
def test_replay_forces_choices_and_counts_disagreement():
    m = model()
    ids, _ = ids_and_targets()
    native = m(ids, cu_seqlens=CU).routing.native_ids.long()  # [T, L]
    replay = native.clone()
    replay[::2] = (native[::2] + 1) % (E + 1)  # every even token recorded differently (skip included)
    replay[5, 1] = NO_ROUTE
    replay[7, :] = NO_ROUTE
    out = m(ids, cu_seqlens=CU, routing_replay=replay.to(torch.uint8))
    routing = out.routing
    recorded = replay != NO_ROUTE
    assert torch.equal(routing.chosen_ids.long()[recorded], replay[recorded])
    # without a record the router's own choice is used
    assert torch.equal(routing.chosen_ids.long()[~recorded], routing.native_ids.long()[~recorded])
    # layer 0 sees the same input, so its native ids are unchanged; it disagrees on the 12 even tokens
    assert torch.equal(routing.native_ids[:, 0].long(), native[:, 0])
    assert routing.replay_disagree[0].item() == T // 2
    assert routing.replay_missing.tolist() == [1, 2, 1]
    assert routing.replay_recorded.tolist() == [T - 1, T - 2, T - 1]
    expected = (recorded & (routing.native_ids.long() != replay)).sum()
    assert routing.replay_mismatch_fraction.item() == pytest.approx(expected.item() / recorded.sum().item())
    assert routing.native_ids.dtype == torch.uint8 and routing.chosen_ids.dtype == torch.uint8


@torch.no_grad()
def test_replaying_native_ids_changes_nothing():
    m = model()
    ids, _ = ids_and_targets()
    plain = m(ids, cu_seqlens=CU)
    replayed = m(ids, cu_seqlens=CU, routing_replay=plain.routing.native_ids)
    assert torch.equal(plain.logits, replayed.logits)
    assert replayed.routing.replay_disagree.sum() == 0 and replayed.routing.replay_mismatch_fraction == 0


@torch.no_grad()
def test_router_gate_is_unbiased_probability_of_recorded_class():
    m = model()
    router = m.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, 64, generator=gen)
    prev = torch.randn(T, 16, generator=gen)
    router.balancing_biases.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0]))  # skip wins every biased argmax
    replay = torch.randint(0, E + 1, (T,), generator=gen)
    out = router(x, prev, replay)
    r = router.down_proj(x) + prev * router.router_states_scale
    probs = torch.softmax(router.router_mlp(r), dim=-1)
    assert torch.equal(out.native, torch.full((T,), E))
    assert torch.equal(out.chosen, replay)
    torch.testing.assert_close(out.gate, probs.gather(1, replay[:, None])[:, 0], rtol=1e-6, atol=0)
    native = router(x, prev)
    torch.testing.assert_close(native.gate, probs[:, E], rtol=1e-6, atol=0)  # bias not added to the gate
    assert (native.gate < 1).all()


def test_replay_gradients_reach_router_and_only_replayed_experts():
    m = model()
    ids, targets = ids_and_targets()
    gen = torch.Generator().manual_seed(9)
    replay = torch.where(torch.rand(T, 3, generator=gen) < 0.5, 1, 3)  # experts 1 and 3 only
    replay[:4, 0] = E  # a few skip tokens
    m.token_logprobs(ids, targets, cu_seqlens=CU, routing_replay=replay).logprobs.sum().backward()
    for layer in m.layers:
        experts = layer.mlp.experts
        for e in range(E):
            used = e in (1, 3)
            for grad in (experts.gate_up_proj.grad[e], experts.down_proj.grad[e]):
                assert (grad.abs().max() > 0) == used, (layer.layer_idx, e)
        gate = layer.mlp.gate
        for p in (gate.down_proj.weight, gate.router_mlp.fc1.weight, gate.router_mlp.fc2.weight,
                  gate.router_mlp.out_proj.weight):
            assert p.grad.abs().max() > 0
        if gate.router_states_scale is not None:
            assert gate.router_states_scale.grad.abs().max() > 0


@torch.no_grad()
def test_replayed_skip_gives_zero_moe_output():
    m = model()
    ids, _ = ids_and_targets()
    all_skip = torch.full((T, 3), E, dtype=torch.uint8)
    before = m(ids, cu_seqlens=CU, routing_replay=all_skip).logits
    for layer in m.layers:
        layer.mlp.experts.gate_up_proj.mul_(3.0)
        layer.mlp.experts.down_proj.add_(1.0)
    assert torch.equal(m(ids, cu_seqlens=CU, routing_replay=all_skip).logits, before)


@pytest.mark.parametrize("replay, match", [
    (torch.full((T, 3), E + 1), "ids must be in"),
    (torch.full((T, 3), -1), "ids must be in"),
    (torch.zeros(T, 2, dtype=torch.long), r"\[T, L\]"),
    (torch.zeros(T, 3), "integer"),
])
def test_bad_replay_rejected(replay, match):
    ids, _ = ids_and_targets()
    with pytest.raises(ValueError, match=match):
        model()(ids, routing_replay=replay)


# ---------------------------------------------------------------- activation checkpointing

def grads_of(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def run_step(m, ids, targets, replay=None, perturb_between=None):
    out = m.token_logprobs(ids, targets, cu_seqlens=CU, routing_replay=replay, with_entropy=True)
    loss = out.logprobs.sum() + 0.1 * out.entropy.sum()
    if perturb_between is not None:
        perturb_between(m)
    loss.backward()
    return out


def push_biases(m):
    """Move the balancing biases so native routing changes (recomputation must not follow it)."""
    with torch.no_grad():
        for layer in m.layers:
            layer.mlp.gate.balancing_biases.add_(torch.tensor([0.3, -0.3, 0.2, -0.2, 0.4]))


@pytest.mark.parametrize("with_replay", [False, True])
def test_checkpointed_equals_plain_with_routing_pinned(with_replay):
    ids, targets = ids_and_targets(1)
    plain, ckpt = model(), model()
    ckpt.set_activation_checkpointing(True)
    replay = None
    if with_replay:
        with torch.no_grad():
            replay = plain(ids, cu_seqlens=CU).routing.native_ids.clone()
        replay[::3, 1] = (replay[::3, 1] + 2) % (E + 1)
        replay[2, 2] = NO_ROUTE
    with torch.no_grad():  # the perturbation really changes native routing
        shifted = model()
        push_biases(shifted)
        assert not torch.equal(shifted(ids, cu_seqlens=CU).routing.native_ids,
                               plain(ids, cu_seqlens=CU).routing.native_ids)

    calls = []
    ckpt.layers[1].register_forward_pre_hook(lambda mod, args: calls.append(1))
    out_plain = run_step(plain, ids, targets, replay)
    out_ckpt = run_step(ckpt, ids, targets, replay, perturb_between=push_biases)
    assert len(calls) == 2  # forward + recomputation: checkpointing is really on
    assert torch.equal(out_plain.logprobs, out_ckpt.logprobs)
    assert torch.equal(out_plain.routing.chosen_ids, out_ckpt.routing.chosen_ids)
    g_plain, g_ckpt = grads_of(plain), grads_of(ckpt)
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        # identical ops in the same order: measured bitwise equal
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=0, atol=0, msg=name)


def test_checkpointing_subset_and_validation():
    m = model()
    m.set_activation_checkpointing([0, 2])
    calls = {i: 0 for i in range(3)}
    for i, layer in enumerate(m.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: calls.__setitem__(i, calls[i] + 1))
    ids, targets = ids_and_targets()
    m.token_logprobs(ids, targets).logprobs.sum().backward()
    assert calls == {0: 2, 1: 1, 2: 2}
    with torch.no_grad():  # no recomputation without autograd
        m(ids)
    assert calls == {0: 3, 1: 2, 2: 3}
    with pytest.raises(ValueError, match="outside"):
        m.set_activation_checkpointing([3])
