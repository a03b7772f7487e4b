"""Loss aggregation: hand values, and the sum over any microbatch/rank split equals the global formula."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zrl.algorithms.aggregation import (
    AGGREGATION_NAMES,
    aggregate_loss,
    local_counts,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)

D = torch.float64

# Packed microbatch: rollout 7 has losses 1, 2, 3; rollout 2 has 4; rollout 5 has no loss token
# (an empty response: its one token is a masked prompt token with a huge loss). T_norm = 4.
LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 1e30], dtype=D)
MASK = torch.tensor([True, True, True, True, False])
SEQ = torch.tensor([7, 7, 7, 2, 5])


def test_hand_values_single_microbatch():
    assert local_counts(MASK, SEQ) == (3, 4)
    # (1/3) · (6/4 + 4/4 + 0) = 5/6
    assert seq_mean_token_sum_norm(LOSS, MASK, global_num_seqs=3, max_response_tokens=4).item() == pytest.approx(5 / 6)
    # (1 + 2 + 3 + 4) / 4
    assert token_mean(LOSS, MASK, global_num_tokens=4).item() == pytest.approx(2.5)
    # (1/3) · (mean(1,2,3) + 4 + 0) = 2
    assert seq_mean_token_mean(LOSS, MASK, SEQ, global_num_seqs=3).item() == pytest.approx(2.0)


def test_two_microbatches_sum_to_the_global_value():
    kw = dict(global_num_seqs=3, global_num_tokens=4, max_response_tokens=4)
    parts = [(slice(0, 3)), (slice(3, 5))]
    for name in AGGREGATION_NAMES:
        whole = aggregate_loss(name, LOSS, MASK, SEQ, **kw)
        split = sum(aggregate_loss(name, LOSS[s], MASK[s], SEQ[s], **kw) for s in parts)
        assert split.item() == pytest.approx(whole.item()), name


def test_padded_layout_rows_are_rollouts():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert local_counts(mask) == (3, 4)
    assert seq_mean_token_mean(loss, mask, None, global_num_seqs=3).item() == pytest.approx(2.0)
    assert seq_mean_token_sum_norm(loss, mask, global_num_seqs=3, max_response_tokens=4).item() == pytest.approx(5 / 6)


def test_gradient_matches_formula():
    loss = LOSS.clone()
    loss[4] = 0.0
    loss.requires_grad_(True)
    out = seq_mean_token_mean(loss, MASK, SEQ, global_num_seqs=3)
    (g,) = torch.autograd.grad(out, loss)
    torch.testing.assert_close(g, torch.tensor([1 / 9, 1 / 9, 1 / 9, 1 / 3, 0.0], dtype=D))
    out = seq_mean_token_sum_norm(loss, MASK, global_num_seqs=3, max_response_tokens=4)
    (g,) = torch.autograd.grad(out, loss)
    torch.testing.assert_close(g, torch.tensor([1 / 12] * 4 + [0.0], dtype=D))


def test_non_finite_masked_losses_do_not_leak():
    loss = torch.tensor([1.0, float("inf"), float("nan")], dtype=D, requires_grad=True)
    mask = torch.tensor([True, False, False])
    seq = torch.tensor([0, 0, 1])
    for name in AGGREGATION_NAMES:
        out = aggregate_loss(name, loss, mask, seq, global_num_seqs=2, global_num_tokens=1, max_response_tokens=2)
        (g,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(out) and torch.isfinite(g).all() and g[1:].eq(0).all()


def test_zero_global_counts_give_a_connected_zero():
    loss = torch.tensor([1.0, 2.0], dtype=D, requires_grad=True)
    mask = torch.zeros(2, dtype=torch.bool)
    seq = torch.tensor([0, 1])
    for name in AGGREGATION_NAMES:
        out = aggregate_loss(name, loss, mask, seq, global_num_seqs=0, global_num_tokens=0, max_response_tokens=8)
        assert out.item() == 0.0 and out.requires_grad
        (g,) = torch.autograd.grad(out, loss)
        assert g.eq(0).all()
    empty = torch.empty(0, dtype=D)
    assert seq_mean_token_mean(empty, torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.long),
                               global_num_seqs=5).item() == 0.0


def test_input_errors():
    with pytest.raises(ValueError, match="valid"):
        aggregate_loss("sum", LOSS, MASK, SEQ, global_num_seqs=1, global_num_tokens=1, max_response_tokens=1)
    with pytest.raises(ValueError, match="seq_idx"):
        seq_mean_token_mean(LOSS, MASK, None, global_num_seqs=3)
    with pytest.raises(ValueError, match="max_response_tokens"):
        seq_mean_token_sum_norm(LOSS, MASK, global_num_seqs=3, max_response_tokens=0)
    with pytest.raises(ValueError, match=">= 0"):
        token_mean(LOSS, MASK, global_num_tokens=-1)
    with pytest.raises(ValueError, match="shape"):
        token_mean(LOSS, MASK[:2], global_num_tokens=4)


def _reference(name, seqs, t_norm):
    # seqs: list of (losses, mask) per rollout; the formulas of docs/algorithms.md §4 written directly
    n_seq = len(seqs)
    n_tok = sum(sum(m) for _, m in seqs)
    if name == "token_mean":
        return sum(l for ls, ms in seqs for l, m in zip(ls, ms) if m) / n_tok if n_tok else 0.0
    if n_seq == 0:
        return 0.0
    if name == "seq_mean_token_sum_norm":
        return sum(sum(l for l, m in zip(ls, ms) if m) / t_norm for ls, ms in seqs) / n_seq
    return sum((sum(l for l, m in zip(ls, ms) if m) / sum(ms)) if sum(ms) else 0.0 for ls, ms in seqs) / n_seq


token = st.tuples(st.floats(-10.0, 10.0, allow_nan=False), st.booleans())
rollout = st.lists(token, min_size=0, max_size=6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(rollout, st.integers(0, 1), st.integers(0, 2)), min_size=1, max_size=10),
       st.sampled_from(AGGREGATION_NAMES))
def test_property_any_split_over_ranks_and_microbatches_equals_global(rollouts, name):
    # each rollout goes to (rank, microbatch); packed streams per bucket; counts summed like an all-reduce
    t_norm = 8
    seqs = [([t[0] for t in toks], [t[1] for t in toks]) for toks, _, _ in rollouts]
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, (_, rank, mb) in enumerate(rollouts):
        buckets.setdefault((rank, mb), []).append(i)
    packed = {}
    for key, members in buckets.items():
        losses, masks, ids = [], [], []
        for i in members:
            ls, ms = seqs[i]
            # an empty rollout still has one (masked) prompt token in the packed stream
            losses += ls or [0.0]
            masks += ms or [False]
            ids += [1000 + i] * max(len(ls), 1)
        packed[key] = (torch.tensor(losses, dtype=D), torch.tensor(masks), torch.tensor(ids))
    counts = [local_counts(m, s) for _, m, s in packed.values()]
    n_seq, n_tok = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert n_seq == len(seqs)
    total = sum(aggregate_loss(name, l, m, s, global_num_seqs=n_seq, global_num_tokens=n_tok,
                               max_response_tokens=t_norm).item() for l, m, s in packed.values())
    assert total == pytest.approx(_reference(name, seqs, t_norm), rel=1e-9, abs=1e-9)
