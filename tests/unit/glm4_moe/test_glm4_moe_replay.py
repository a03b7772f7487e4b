"""Top-k router replay of GLM-4.5: recorded experts used with the model's own sigmoid scores as weights
(normalised and scaled as the family does, the correction bias never in them), NO_ROUTE entries routed
natively, the router's gradient kept; and DeepSeek-V3's correction-bias update."""

import pytest
import torch

from glm4_moe_testlib import ours_from_reference, packed_documents, random_reference
from zrl.glm4_moe.routing import SignBiasUpdate, load_sign
from zrl.models import get_family
from zrl.types import NO_ROUTE

E, K = 8, 2  # experts and experts per token of the tiny config
LENGTHS = [10, 14]
GROUPED = dict(seed=5, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def model(**overrides):
    return ours_from_reference(random_reference(**{**GROUPED, **overrides}))


def by_layer(record: torch.Tensor) -> torch.Tensor:
    """[T, L * k] -> [T, L, k] int64."""
    return record.long().view(record.shape[0], -1, K)


@torch.no_grad()
def test_replaying_own_routing_reproduces_the_forward_exactly():
    m = model()
    _, ids, cu = packed_documents(0, LENGTHS)
    plain = m(ids, cu_seqlens=cu)
    replayed = m(ids, cu_seqlens=cu, routing_replay=plain.routing.chosen_ids)
    assert torch.equal(plain.logits, replayed.logits)
    assert replayed.routing.replay_disagree.sum() == 0
    assert replayed.routing.replay_recorded.tolist() == [0, ids.numel() * K, ids.numel() * K]  # layer 0 dense


@torch.no_grad()
def test_replaying_other_experts_uses_them_outside_the_kept_groups_too():
    m = model()
    _, ids, cu = packed_documents(0, LENGTHS)
    plain = m(ids, cu_seqlens=cu)
    native = by_layer(plain.routing.native_ids)
    replay = native.clone()
    replay[:, 1:] = (native[:, 1:] + 3) % E
    out = m(ids, cu_seqlens=cu, routing_replay=replay.reshape(ids.numel(), -1).to(torch.uint8))
    assert torch.equal(by_layer(out.routing.chosen_ids)[:, 1:], replay[:, 1:])
    assert (by_layer(out.routing.chosen_ids)[:, 0] == NO_ROUTE).all()
    assert torch.equal(by_layer(out.routing.native_ids)[:, 1], native[:, 1])  # layer 1 sees the same input
    assert out.routing.replay_disagree[1] > 0


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_weights_are_own_scores_normalised_and_scaled(norm_topk_prob):
    m = model(norm_topk_prob=norm_topk_prob)
    router = m.layers[1].mlp.gate
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 64, generator=gen)
    replay = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(12)])  # [T, k]
    replay[4] = NO_ROUTE  # no record: native
    routing = router(x, replay)
    scores = torch.sigmoid(x @ router.weight.t())  # [T, E], no correction bias
    assert torch.equal(routing.chosen[torch.arange(12) != 4], replay[torch.arange(12) != 4])
    assert torch.equal(routing.chosen[4], routing.native[4])
    expected = scores.gather(1, routing.chosen)
    if norm_topk_prob:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(routing.weights, 2.5 * expected, rtol=0, atol=1e-6)


def test_router_keeps_its_gradient_under_replay():
    m = model()
    _, ids, cu = packed_documents(0, LENGTHS)
    record = m(ids, cu_seqlens=cu).routing.chosen_ids
    m(ids, cu_seqlens=cu, routing_replay=record).logits.square().sum().backward()
    for layer in m.layers[1:]:
        assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().max() > 0
    assert all(b.grad is None for b in m.buffers())  # the correction bias is no gradient's business


def test_replay_rejects_a_malformed_record():
    m = model()
    _, ids, cu = packed_documents(0, LENGTHS)
    record = m(ids, cu_seqlens=cu).routing.chosen_ids.clone()
    record[0, K] = E  # an id outside [0, E) in a sparse layer
    with pytest.raises(ValueError, match="routing_replay ids must be in"):
        m(ids, cu_seqlens=cu, routing_replay=record)


def test_sign_update_moves_biases_towards_the_mean_load():
    m = model()
    update = get_family("glm4_moe").bias_balancer(m, lr=1e-3)
    assert isinstance(update, SignBiasUpdate) and update.moe_layers == [1, 2]
    before = [b.clone() for b in update.biases]
    counts = torch.zeros(3, E, dtype=torch.int64)
    counts[1] = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])  # mean 5: expert 0 over, expert 1 under, rest even
    counts[2] = 5
    sign = update.step(counts)
    assert torch.equal(sign, load_sign(counts[[1, 2]]))
    delta = update.biases[0] - before[0]
    torch.testing.assert_close(delta, torch.tensor([-1e-3, 1e-3, 0, 0, 0, 0, 0, 0]), rtol=0, atol=1e-7)
    assert torch.equal(update.biases[1], before[1])  # evenly loaded: unchanged
    assert update.biases[0] is m.layers[1].mlp.gate.e_score_correction_bias  # in place, the model's own buffer
