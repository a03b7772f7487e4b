"""Step statistics and the loss on the tiny model: `mismatch/onpolicy_*` is reported only on steps that
have on-policy tokens; environment tokens of a multi-turn response stay out of the loss.

Between two weight syncs the rollout workers sample with an older version than the one being trained,
so a step trains on no token of its own version. Its on-policy mismatch statistics are then undefined:
the step reports `mismatch/onpolicy_num_tokens` = 0 and leaves the statistics out instead of NaN.
"""

import math

import pytest
import torch

from zrl.trainer.batch import pack_rollouts
from zrl.trainer.packing import input_length, plan_rank
from zrl.trainer.loss import RLObjective, StepStats, rl_microbatch_loss

from trainer_testlib import tiny_model_and_batch

CPU = torch.device("cpu")
OBJECTIVE = RLObjective("dppo_binary_tv", {"delta": 0.1, "is_cap": 1e4}, "seq_mean_token_sum_norm", 40)
STATS = ("kl_k1", "kl_k3", "pearson_prob", "pearson_logprob", "mean_abs_prob_diff", "max_abs_prob_diff")


@pytest.fixture(scope="module")
def model_and_batch(tiny_checkpoint):
    # Pulled at trainer step 1; version segments put the tokens at versions 0 and 1.
    return tiny_model_and_batch(tiny_checkpoint, num_groups=2, group_size=4, seed=5)


def step_metrics(model, batch, trainer_step: int) -> dict[str, float]:
    cfg = model.config
    rollouts, advantages = batch.rollouts(), batch.advantages()
    lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
    stats = StepStats("rl", num_layers=cfg.num_hidden_layers, num_classes=cfg.num_router_classes, device=CPU,
                      with_entropy=False, replay=True)
    with torch.no_grad():
        for indices in plan_rank(lengths, 0, 1, 10_000).microbatches:
            mb = pack_rollouts(rollouts, advantages, indices, num_layers=cfg.num_hidden_layers, replay=True,
                               device=CPU)
            rl_microbatch_loss(model, mb, OBJECTIVE, global_num_seqs=batch.num_sequences,
                               global_num_tokens=batch.num_response_tokens, trainer_step=trainer_step, stats=stats,
                               with_entropy=False)
    return stats.metrics()


def test_a_step_after_a_sync_reports_on_policy_mismatch(model_and_batch):
    m = step_metrics(*model_and_batch, trainer_step=1)
    assert 0 < m["mismatch/onpolicy_num_tokens"] < m["mismatch/num_tokens"]
    assert all(math.isfinite(m[f"mismatch/onpolicy_{k}"]) for k in STATS)


def test_a_step_between_syncs_has_no_on_policy_statistics(model_and_batch):
    # Trainer step 2 with every token sampled by versions 0 and 1: none is on-policy.
    m = step_metrics(*model_and_batch, trainer_step=2)
    assert m["mismatch/onpolicy_num_tokens"] == 0
    assert [k for k in m if k.startswith("mismatch/onpolicy_")] == ["mismatch/onpolicy_num_tokens"]
    assert m["mismatch/num_tokens"] > 0 and all(math.isfinite(m[f"mismatch/{k}"]) for k in STATS)
    assert not [k for k, v in m.items() if k.startswith("mismatch/") and math.isnan(v)]


def test_the_loss_ignores_environment_tokens(model_and_batch):
    """Marking response tokens as an environment's (policy_mask) takes them out of the loss: what their
    behaviour logprobs are then changes neither the loss nor its gradient, while the same tokens as policy
    tokens change both, and the loss's token count is the policy's tokens."""
    from dataclasses import replace

    import numpy as np

    from zrl.types import TrainBatch

    model, batch = model_and_batch
    cfg = model.config

    def with_tokens(policy: bool, behaviour_shift: float) -> TrainBatch:
        groups = []
        for g in batch.groups:
            rollouts = []
            for r in g.rollouts:
                env = np.zeros(len(r.token_ids), bool)
                env[1::3] = True  # every third token from the second on: an environment's reply
                rollouts.append(replace(r, logprobs=np.where(env, r.logprobs + behaviour_shift, r.logprobs),
                                        policy_mask=None if policy else ~env))
            groups.append(replace(g, rollouts=tuple(rollouts)))
        return TrainBatch(tuple(groups), batch.trainer_step)

    def loss_and_grad(b: TrainBatch) -> tuple[float, torch.Tensor]:
        model.zero_grad()
        rollouts, advantages = b.rollouts(), b.advantages()
        lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
        total = 0.0
        for indices in plan_rank(lengths, 0, 1, 10_000).microbatches:
            mb = pack_rollouts(rollouts, advantages, indices, num_layers=cfg.num_hidden_layers, replay=True, device=CPU)
            loss = rl_microbatch_loss(model, mb, OBJECTIVE, global_num_seqs=b.num_sequences,
                                      global_num_tokens=b.num_response_tokens, trainer_step=1, with_entropy=False).loss
            loss.backward()
            total += float(loss.detach())
        return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    masked = with_tokens(policy=False, behaviour_shift=0.0)
    assert masked.num_response_tokens < batch.num_response_tokens
    loss, grad = loss_and_grad(masked)
    loss_shifted, grad_shifted = loss_and_grad(with_tokens(policy=False, behaviour_shift=-3.0))
    assert loss_shifted == loss and torch.equal(grad_shifted, grad)
    leaked, leaked_grad = loss_and_grad(with_tokens(policy=True, behaviour_shift=-3.0))
    assert leaked != pytest.approx(loss, rel=1e-3) and not torch.allclose(leaked_grad, grad)
