"""The RL loss through the fused LM head (rl_token_grad + head_loss) == the unfused path (token_logprobs,
then policy_loss and aggregate_loss through autograd), for every trust region and loss aggregation.

In float64 (both sides' head products in float64, so only the formulation differs): the loss value, dh
and dW. Then on the tiny model through `rl_microbatch_loss` (fp32, reference head): loss, every
parameter's gradient and the step statistics, fused against `fused_head=False`.
"""

import itertools
import math

import pytest
import torch

from zrl.algorithms import AGGREGATION_NAMES, TRUST_REGION_NAMES, aggregate_loss, policy_loss
from zrl.modeling.kernels.lm_logprobs.fused import fused_head_loss
from zrl.modeling.kernels.lm_logprobs.reference import Fp32Products, _ChunkedTokenLogprobs
from zrl.trainer.batch import pack_rollouts
from zrl.trainer.loss import RLObjective, StepStats, rl_microbatch_loss, rl_token_grad, uses_fused_head
from zrl.trainer.packing import input_length, plan_rank

from trainer_testlib import tiny_model_and_batch

T_NORM = 30
# Options that make every trust region act on this data: masks on both advantage signs, the IS cap hit,
# PPO clipped on both sides (asserted below, so the equality covers the masked branches).
PARAMS = {"dppo_binary_tv": dict(delta=0.005, is_cap=1.5), "dppo_binary_kl": dict(delta=1e-3, is_cap=1.5),
          "ppo_clip": dict(clip_low=0.1, clip_high=0.1)}


class Float64Products(Fp32Products):
    def __init__(self, hidden, weight, **_):
        self.hidden, self.weight = hidden, weight

    def logits(self, sl):
        return self.hidden[sl] @ self.weight.t()

    def new_grad_weight(self):
        return torch.zeros_like(self.weight)

    def add_grad_weight(self, grad_weight, grad_logits, sl):
        grad_weight = self.new_grad_weight() if grad_weight is None else grad_weight
        grad_weight.addmm_(grad_logits.t(), self.hidden[sl])
        return grad_weight

    def grad_operand(self, grad_logits):
        return grad_logits


def rl_case(t=48, d=12, v=40):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.7
    targets = torch.randint(0, v, (t,), generator=gen)
    targets[5] = -1
    seq_idx = torch.arange(t) // 7  # 7 rollouts, the last one short
    loss_mask = torch.rand(t, generator=gen) > 0.2
    loss_mask[5] = False
    loss_mask[seq_idx == 3] = False  # a rollout without loss tokens still counts in N_seq
    advantages = torch.randn(t, generator=gen, dtype=torch.float64)
    advantages[3] = 0.0
    with torch.no_grad():
        lp, _ = _ChunkedTokenLogprobs.apply(hidden, weight, targets, None, 16, False, Float64Products)
    behaviour = (lp + 0.3 * torch.randn(t, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    return hidden, weight, targets, seq_idx, loss_mask, advantages, behaviour


@pytest.mark.parametrize("trust_region, aggregation", list(itertools.product(TRUST_REGION_NAMES, AGGREGATION_NAMES)))
def test_fused_rl_loss_equals_unfused_in_float64(trust_region, aggregation):
    hidden, weight, targets, seq_idx, loss_mask, advantages, behaviour = rl_case()
    objective = RLObjective(trust_region, PARAMS[trust_region], aggregation, T_NORM)
    counts = dict(global_num_seqs=9, global_num_tokens=50)  # global: more than this microbatch's
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, _ = _ChunkedTokenLogprobs.apply(h, w, targets, None, 16, True, Float64Products)
    pl = policy_loss(trust_region, lp, behaviour, advantages, loss_mask, **PARAMS[trust_region])
    want = aggregate_loss(aggregation, pl.token_loss, loss_mask, seq_idx, max_response_tokens=T_NORM, **counts)
    want_dh, want_dw = torch.autograd.grad(want, [h, w])
    s = pl.stats.sums
    assert s[3] > 0 and s[4] > 0, "masked (or clipped) tokens of both advantage signs"
    if trust_region != "ppo_clip":
        assert s[7] > 0, "IS weights at the cap"

    token_grad = rl_token_grad(objective, behaviour, advantages, loss_mask, seq_idx, dtype=torch.float64, **counts)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, lp_fused, _ = fused_head_loss(h, w, targets, token_grad, products=Float64Products, chunk_tokens=16,
                                        with_entropy=True)
    dh, dw = torch.autograd.grad(loss, [h, w])
    # measured max |difference| over the 9 cases: logprob 0, loss 4.4e-16 (values ~1), dh 2.8e-17, dW
    # 2.8e-17 (values up to 0.12): float64 sums in another order
    torch.testing.assert_close(lp_fused, lp.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(dh, want_dh, rtol=0, atol=1e-14)
    torch.testing.assert_close(dw, want_dw, rtol=0, atol=1e-14)


def test_ppo_clip_gradient_at_the_clip_boundaries():
    """The tie conventions of autograd (minimum splits, clamp passes on its closed interval) at ratios
    exactly 1 - clip_low, 1 and 1 + clip_high."""
    lq = torch.full((6,), -1.0, dtype=torch.float64)
    ratios = torch.tensor([0.75, 0.75, 1.0, 1.25, 1.25, 2.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0, -1.0, -0.5], dtype=torch.float64)
    mask = torch.ones(6, dtype=torch.bool)
    objective = RLObjective("ppo_clip", dict(clip_low=0.25, clip_high=0.25), "token_mean", T_NORM)
    lp = (lq + ratios.log()).requires_grad_()
    pl = policy_loss("ppo_clip", lp, lq, adv, mask, clip_low=0.25, clip_high=0.25)
    want = aggregate_loss("token_mean", pl.token_loss, mask, torch.arange(6), global_num_seqs=6,
                          global_num_tokens=6, max_response_tokens=T_NORM)
    (want_grad,) = torch.autograd.grad(want, [lp])
    token_grad = rl_token_grad(objective, lq, adv, mask, torch.arange(6), global_num_seqs=6, global_num_tokens=6,
                               dtype=torch.float64)
    loss_terms, grad, _ = token_grad(slice(0, 6), lp.detach(), None)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(loss_terms.sum(), want.detach(), rtol=0, atol=1e-15)


OBJECTIVES = [RLObjective("dppo_binary_tv", {"delta": 2e-4, "is_cap": 1.05}, "seq_mean_token_sum_norm", 40),
              RLObjective("ppo_clip", {"clip_low": 0.05, "clip_high": 0.05}, "seq_mean_token_mean", 40)]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: f"{o.trust_region}-{o.aggregation}")
def test_trainer_fused_head_equals_unfused(tiny_checkpoint, objective, monkeypatch):
    """rl_microbatch_loss on the tiny model: the fused head (taken: counted) against fused_head=False."""
    model, batch = tiny_model_and_batch(tiny_checkpoint, num_groups=2, group_size=3, seed=3)
    cfg = model.config
    rollouts, advantages = batch.rollouts(), batch.advantages()
    lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
    calls = []
    token_loss = type(model).token_loss
    monkeypatch.setattr(type(model), "token_loss", lambda self, *a, **k: calls.append(1) or token_loss(self, *a, **k))
    results = {}
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        stats = StepStats("rl", num_layers=cfg.num_hidden_layers, num_classes=cfg.num_router_classes,
                          device=torch.device("cpu"), with_entropy=True, replay=True)
        losses = []
        for indices in plan_rank(lengths, 0, 1, 40).microbatches:
            mb = pack_rollouts(rollouts, advantages, indices, num_layers=cfg.num_hidden_layers, replay=True,
                               device=torch.device("cpu"))
            assert uses_fused_head(model, mb, objective)
            out = rl_microbatch_loss(model, mb, objective, global_num_seqs=batch.num_sequences,
                                     global_num_tokens=batch.num_response_tokens, trainer_step=batch.trainer_step,
                                     stats=stats, fused_head=fused)
            out.loss.backward()
            losses.append(out.loss.detach())
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results[fused] = torch.stack(losses), grads, stats.metrics()
    assert len(calls) == len(results[True][0])  # every microbatch of the fused run, none of the other
    (loss_f, grads_f, metrics_f), (loss_u, grads_u, metrics_u) = results[True], results[False]
    # fp32: the same products, the loss summed per chunk rather than per microbatch (measured <= 3e-8)
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=1e-7)
    assert grads_f.keys() == grads_u.keys()
    for name, g in grads_f.items():
        torch.testing.assert_close(g, grads_u[name], rtol=1e-4, atol=1e-6, msg=name)
    assert metrics_f.keys() == metrics_u.keys()
    for key, value in metrics_f.items():
        assert value == pytest.approx(metrics_u[key], rel=1e-5, abs=1e-7, nan_ok=True) or (
            math.isnan(value) and math.isnan(metrics_u[key])), key
