"""Top-k router replay: recorded experts used with the model's own (renormalised) probabilities as
weights, NO_ROUTE entries routed natively, record validation, and checkpointed layers pinned."""

import pytest
import torch
import torch.nn.functional as F

from qwen3_moe_testlib import next_token_targets, ours_from_reference, packed_documents, random_reference
from zrl.types import NO_ROUTE

E, K = 8, 2  # experts and experts per token of the tiny config
LENGTHS = [10, 14]


def model(**overrides):
    return ours_from_reference(random_reference(seed=5, mlp_only_layers=[1], **overrides))


def stream():
    docs, ids, cu = packed_documents(0, LENGTHS)
    return ids, cu


def by_layer(record: torch.Tensor) -> torch.Tensor:
    """[T, L * k] -> [T, L, k] int64."""
    return record.long().view(record.shape[0], -1, K)


@torch.no_grad()
def test_replaying_own_routing_reproduces_the_forward_exactly():
    m = model()
    ids, cu = stream()
    plain = m(ids, cu_seqlens=cu)
    replayed = m(ids, cu_seqlens=cu, routing_replay=plain.routing.chosen_ids)
    assert torch.equal(plain.logits, replayed.logits)
    assert torch.equal(plain.routing.chosen_ids, replayed.routing.chosen_ids)
    assert replayed.routing.replay_disagree.sum() == 0 and replayed.routing.replay_mismatch_fraction == 0
    assert replayed.routing.replay_recorded.tolist() == [ids.numel() * K, 0, ids.numel() * K]


@torch.no_grad()
def test_replaying_other_experts_uses_them():
    m = model()
    ids, cu = stream()
    plain = m(ids, cu_seqlens=cu)
    native = by_layer(plain.routing.native_ids)  # [T, L, k]
    replay = native.clone()
    replay[:, [0, 2]] = (native[:, [0, 2]] + 3) % E  # distinct ids stay distinct
    out = m(ids, cu_seqlens=cu, routing_replay=replay.reshape(ids.numel(), -1).to(torch.uint8))
    chosen = by_layer(out.routing.chosen_ids)
    assert torch.equal(chosen[:, [0, 2]], replay[:, [0, 2]])
    assert (chosen[:, 1] == NO_ROUTE).all()  # the dense layer
    assert not torch.allclose(out.logits, plain.logits)
    # layer 0 sees the same input: its own top-k is unchanged; disagreement = replayed ids outside it
    assert torch.equal(by_layer(out.routing.native_ids)[:, 0], native[:, 0])
    foreign = ~(replay[:, 0, :, None] == native[:, 0, None, :]).any(dim=-1)
    assert out.routing.replay_disagree[0] == foreign.sum() > 0
    for layer_idx in (0, 2):
        expected = torch.bincount(replay[:, layer_idx].reshape(-1), minlength=E)
        assert torch.equal(out.routing.expert_counts[layer_idx], expected)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_weights_are_own_probabilities_renormalised_over_the_replayed_set(norm_topk_prob):
    m = model(norm_topk_prob=norm_topk_prob)
    block = m.layers[0].mlp
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 64, generator=gen)
    replay = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(12)])  # [T, k]
    replay[4] = NO_ROUTE  # no record: native
    routing = block.route(x, replay)
    probs = torch.softmax(x @ block.gate.weight.t(), dim=-1)  # [T, E]
    recorded = torch.ones(12, dtype=torch.bool)
    recorded[4] = False
    assert torch.equal(routing.chosen[recorded], replay[recorded])
    assert torch.equal(routing.chosen[4], probs[4].topk(K).indices)
    expected = probs.gather(1, routing.chosen)
    if norm_topk_prob:
        expected = expected / expected.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(routing.weights.sum(dim=-1), torch.ones(12), rtol=0, atol=1e-6)
    else:
        assert (routing.weights.sum(dim=-1) < 1).all()
    torch.testing.assert_close(routing.weights, expected, rtol=1e-6, atol=0)
    # the block's output is the weighted sum of the replayed experts' SwiGLU outputs
    with torch.no_grad():
        y, _ = block(x, replay)
    experts = block.experts
    manual = torch.zeros(12, 64)
    for t in range(12):
        for j in range(K):
            e = routing.chosen[t, j]
            g, u = F.linear(x[t], experts.gate_up_proj[e]).chunk(2)
            manual[t] += routing.weights[t, j].detach() * F.linear(F.silu(g) * u, experts.down_proj[e])
    torch.testing.assert_close(y, manual, rtol=1e-5, atol=1e-6)
    # the router still gets a gradient through the replayed weights
    (routing.weights * torch.randn(12, K, generator=gen)).sum().backward()
    assert block.gate.weight.grad.abs().max() > 0


@torch.no_grad()
def test_no_route_entries_route_natively_and_are_counted():
    m = model()
    ids, cu = stream()
    t = ids.numel()
    plain = m(ids, cu_seqlens=cu)
    replay = by_layer(plain.routing.native_ids)
    replay[:, [0, 2]] = (replay[:, [0, 2]] + 1) % E
    replay[5] = NO_ROUTE  # every layer of token 5
    replay[7, 0] = NO_ROUTE  # layer 0 of token 7
    replay[:, 1] = 0  # the dense layer's columns are ignored, whatever they hold
    out = m(ids, cu_seqlens=cu, routing_replay=replay.reshape(t, -1).to(torch.uint8))
    chosen, native = by_layer(out.routing.chosen_ids), by_layer(out.routing.native_ids)
    assert torch.equal(chosen[5], native[5]) and torch.equal(chosen[7, 0], native[7, 0])
    assert torch.equal(chosen[6, 0], replay[6, 0])
    assert (chosen[:, 1] == NO_ROUTE).all() and (native[:, 1] == NO_ROUTE).all()
    assert out.routing.replay_missing.tolist() == [2, 0, 1]
    assert out.routing.replay_recorded.tolist() == [(t - 2) * K, 0, (t - 1) * K]


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r[:, :-1], "must be \\[T, L \\* k\\]"),
    (lambda r: r.float(), "integer expert ids"),
    (lambda r: r.index_fill(0, torch.tensor([3]), E), "must be in \\[0, 8\\)"),
    (lambda r: _set(r, (3, 0), NO_ROUTE), "all recorded or all NO_ROUTE"),
    (lambda r: _set(r, (3, 1), int(r[3, 0])), "names an expert twice"),
])
def test_invalid_records_are_rejected(mutate, message):
    m = model()
    ids, cu = stream()
    with torch.no_grad():
        record = m(ids, cu_seqlens=cu).routing.chosen_ids.long()
    with pytest.raises(ValueError, match=message):
        m(ids, cu_seqlens=cu, routing_replay=mutate(record))


def _set(record: torch.Tensor, index: tuple[int, int], value: int) -> torch.Tensor:
    record = record.clone()
    record[index] = value
    return record


def test_checkpointed_layers_give_the_same_gradients():
    ids, cu = stream()
    targets = next_token_targets(packed_documents(0, LENGTHS)[0])
    grads = []
    for checkpointed in (False, True):
        m = model()
        m.set_activation_checkpointing(checkpointed)
        out = m.token_logprobs(ids, targets, cu_seqlens=cu, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


@torch.no_grad()
def test_rows_input_takes_a_rows_record():
    m = model()
    ids, _ = stream()
    rows = ids.view(2, 12)
    flat = m(ids, cu_seqlens=[0, 12, 24])
    out = m(rows, routing_replay=flat.routing.chosen_ids.view(2, 12, -1))
    assert torch.equal(out.logits.reshape(24, -1), flat.logits)
