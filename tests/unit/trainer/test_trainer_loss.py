"""Packed microbatch losses == an unpacked, hand-written reference of the same objective (single process).

The reference runs every rollout alone (no packing, no cu_seqlens), computes the per-token loss from
the trust-region formulas written out here, aggregates with the global counts by hand, and
back-propagates once; the trainer path packs the rollouts into several token-budget microbatches and
accumulates their loss terms. Gradients, loss and step statistics must agree.
"""

import math

import numpy as np
import pytest
import torch

from zrl.canaries import mismatch_stats
from zrl.trainer.batch import pack_rollouts, pack_sft
from zrl.trainer.packing import input_length, plan_rank
from zrl.trainer.loss import RLObjective, StepStats, rl_microbatch_loss, sft_microbatch_loss
from zrl.trainer.synthetic import synthetic_sft_examples

from trainer_testlib import assert_grads_close, reference, tiny_model_and_batch

T_NORM = 40
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    return tiny_model_and_batch(tiny_checkpoint, num_groups=3, group_size=4, seed=3, empty_responses=1)


def packed(model, batch, objective, token_budget=40):
    model.zero_grad(set_to_none=True)
    rollouts, advantages = batch.rollouts(), batch.advantages()
    lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
    share = plan_rank(lengths, 0, 1, token_budget)
    cfg = model.config
    stats = StepStats("rl", num_layers=cfg.num_hidden_layers, num_classes=cfg.num_router_classes, device=CPU,
                      with_entropy=True, replay=True)
    for indices in share.microbatches:
        mb = pack_rollouts(rollouts, advantages, indices, num_layers=cfg.num_hidden_layers, replay=True, device=CPU)
        assert mb.num_tokens <= token_budget
        out = rl_microbatch_loss(model, mb, objective, global_num_seqs=batch.num_sequences,
                                 global_num_tokens=batch.num_response_tokens, trainer_step=batch.trainer_step,
                                 stats=stats)
        out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return stats, grads, share


OBJECTIVES = [
    RLObjective("dppo_binary_tv", {"delta": 2e-4, "is_cap": 1e4}, "seq_mean_token_sum_norm", T_NORM),
    RLObjective("dppo_binary_tv", {"delta": 2e-4, "is_cap": 1.05}, "token_mean", T_NORM),
    RLObjective("ppo_clip", {"clip_low": 0.05, "clip_high": 0.05}, "seq_mean_token_mean", T_NORM),
]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.trust_region}-{o.aggregation}")
def test_packed_step_equals_unpacked_reference(setup, objective):
    model, batch = setup
    ref_loss, ref_grads, facts = reference(model, batch, objective)
    stats, grads, share = packed(model, batch, objective)
    assert len(share.microbatches) >= 3 and max(len(mb) for mb in share.microbatches) >= 2  # real packing
    assert_grads_close(grads, ref_grads)
    m = stats.metrics()
    assert m["loss/policy"] == pytest.approx(ref_loss, rel=1e-6)  # measured <= 1.1e-7
    n_tok = batch.num_response_tokens
    assert m["trust_region/num_tokens"] == n_tok == m["batch/loss_tokens"]
    assert 0 < facts["dropped"] < n_tok  # the trust region is active but not everywhere: not vacuous
    assert m["trust_region/masked_frac"] == pytest.approx(facts["dropped"] / n_tok)
    assert m["routing/replay_disagree_frac"] == pytest.approx(facts["disagree"] / facts["recorded"])
    expected = mismatch_stats(torch.cat(facts["lp"]), torch.cat(facts["lq"]))
    assert m["mismatch/kl_k3"] == pytest.approx(expected.kl_k3, rel=1e-5)
    assert m["mismatch/pearson_prob"] == pytest.approx(expected.pearson_prob, rel=1e-6)
    assert m["mismatch/max_abs_prob_diff"] == pytest.approx(expected.max_abs_prob_diff, rel=1e-5)
    assert m["policy/entropy_mean"] == pytest.approx(torch.cat(facts["entropy"]).mean().item(), rel=1e-5)
    # tokens sampled by the current version (trainer_step 1): segments put some at version 0
    assert 0 < m["mismatch/onpolicy_num_tokens"] < n_tok


def test_sft_loss_is_token_mean_nll(setup):
    model, _ = setup
    examples = synthetic_sft_examples(vocab_size=model.config.vocab_size, num_examples=6, seed=2)
    n_tok = sum(len(e.token_ids) for e in examples)
    model.zero_grad(set_to_none=True)
    ref = 0.0
    for e in examples:
        full = torch.from_numpy(np.concatenate([e.prompt_ids, e.token_ids]).astype(np.int64))
        nll = -model.token_logprobs(full[:-1], full[1:]).logprobs[len(e.prompt_ids) - 1:].sum() / n_tok
        nll.backward()
        ref += nll.item()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lengths = [input_length(len(e.prompt_ids), len(e.token_ids)) for e in examples]
    cfg = model.config
    stats = StepStats("sft", num_layers=cfg.num_hidden_layers, num_classes=cfg.num_router_classes, device=CPU,
                      with_entropy=False, replay=False)
    for indices in plan_rank(lengths, 0, 1, 40).microbatches:
        sft_microbatch_loss(model, pack_sft(examples, indices, device=CPU), global_num_tokens=n_tok,
                            stats=stats).loss.backward()
    assert stats.metrics()["loss/sft"] == pytest.approx(ref, rel=1e-6)  # measured <= 4.3e-8
    assert abs(ref - math.log(cfg.vocab_size)) < 0.5  # near-uniform initial model: NLL ~ ln V
    # measured <= 1.2e-6 relative per tensor
    assert_grads_close({k: model.get_parameter(k).grad for k in ref_grads}, ref_grads)


def test_dummy_microbatch_has_zero_loss_and_same_stats_layout(setup):
    model, batch = setup
    cfg = model.config
    kwargs = dict(num_layers=cfg.num_hidden_layers, num_classes=cfg.num_router_classes, device=CPU,
                  with_entropy=True, replay=True)
    busy, idle = StepStats("rl", **kwargs), StepStats("rl", **kwargs)
    rollouts, adv = batch.rollouts(), batch.advantages()
    objective = OBJECTIVES[0]
    common = dict(global_num_seqs=batch.num_sequences, global_num_tokens=batch.num_response_tokens, trainer_step=1)
    mb = pack_rollouts(rollouts, adv, [1, 2], num_layers=cfg.num_hidden_layers, replay=True, device=CPU)
    rl_microbatch_loss(model, mb, objective, stats=busy, **common)
    dummy = pack_rollouts(rollouts, adv, [], num_layers=cfg.num_hidden_layers, replay=True, device=CPU)
    model.zero_grad(set_to_none=True)
    out = rl_microbatch_loss(model, dummy, objective, stats=idle, **common)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # runs, changes nothing
    # every rank reduces vectors of the same layout, whatever it ran
    def layout(stats):
        return [(k, v.numel()) for store in (stats.sums, stats.maxes) for k, v in sorted(store.items())]

    assert layout(busy) == layout(idle)
    assert idle.metrics()["batch/input_tokens"] == 0 and math.isnan(idle.metrics()["trust_region/masked_frac"])
