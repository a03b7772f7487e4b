"""Routing statistics, the balancing error (ZAYA1-8B report eq. 5) and the AdamW bias-balancing controller."""

import math

import pytest
import torch

from moepp_testlib import ours_from_reference, random_reference
from zrl.modeling.routing import routing_stats
from zrl.moepp.routing import BiasBalancer, balancing_error


def test_routing_stats_hand_values():
    counts = torch.tensor([
        [5, 5, 5, 5, 0],  # balanced, no skip
        [8, 0, 0, 0, 2],  # one expert, 20% skipped
        [2, 2, 0, 0, 4],  # two experts, half skipped
        [0, 0, 0, 0, 3],  # everything skipped
    ])
    stats = routing_stats(counts, skip_class=True)
    torch.testing.assert_close(stats.load[0], torch.full((4,), 0.25))
    torch.testing.assert_close(stats.load[1], torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(stats.load[3], torch.zeros(4))
    torch.testing.assert_close(stats.skip_fraction, torch.tensor([0.0, 0.2, 0.5, 1.0]))
    torch.testing.assert_close(stats.load_entropy, torch.tensor([1.0, 0.0, math.log(2) / math.log(4), 0.0]))


def test_balancing_error_hand_values():
    counts = torch.tensor([[6, 2, 0, 0, 100], [0, 0, 0, 0, 7]])
    error = balancing_error(counts)
    # layer 0: p = (0.75, 0.25, 0, 0) over routed tokens; skip column untouched
    torch.testing.assert_close(error[0], torch.tensor([0.5, 0.0, -0.25, -0.25, 0.0]))
    # nothing routed: every expert is under-used by 1/E
    torch.testing.assert_close(error[1], torch.tensor([-0.25, -0.25, -0.25, -0.25, 0.0]))
    assert torch.allclose(error[:, :-1].sum(1)[0], torch.tensor(0.0))


def test_bias_balancer_steps_against_the_load():
    model = ours_from_reference(random_reference(seed=2, skip_bias=0.3))
    before = [layer.mlp.gate.balancing_biases.clone() for layer in model.layers]
    balancer = BiasBalancer.for_model(model, lr=0.01)
    counts = torch.tensor([[10, 0, 5, 5, 3], [5, 5, 5, 5, 0], [0, 20, 0, 0, 1]])
    error = balancer.step(counts)
    torch.testing.assert_close(error, balancing_error(counts))
    deltas = [layer.mlp.gate.balancing_biases - b for layer, b in zip(model.layers, before)]
    # AdamW's first step is lr * g / (|g| + eps): -lr for over-used experts, +lr for under-used ones
    torch.testing.assert_close(deltas[0], torch.tensor([-0.01, 0.01, 0.0, 0.0, 0.0]), atol=1e-7, rtol=0)
    torch.testing.assert_close(deltas[1], torch.zeros(5))
    torch.testing.assert_close(deltas[2], torch.tensor([0.01, -0.01, 0.01, 0.01, 0.0]), atol=1e-7, rtol=0)
    assert all(layer.mlp.gate.balancing_biases.grad is None for layer in model.layers)
    # repeated over-use keeps pushing the same way
    balancer.step(counts)
    assert model.layers[0].mlp.gate.balancing_biases[0] < before[0][0] - 0.015
    with pytest.raises(ValueError, match="layers"):
        balancer.step(counts[:2])


def test_biases_move_routing_and_counts_are_reported():
    model = ours_from_reference(random_reference(seed=2, skip_bias=-1.0))
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        counts = model(ids).routing.expert_counts
        assert counts.sum(1).tolist() == [40, 40, 40]
        assert counts[:, -1].sum() == 0  # skip bias -1 never wins
        model.layers[0].mlp.gate.balancing_biases[-1] = 2.0  # skip bias 2 always wins
        counts = model(ids).routing.expert_counts
    assert counts[0].tolist() == [0, 0, 0, 0, 40]
