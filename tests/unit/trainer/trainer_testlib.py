"""Shared helpers of the trainer tests: the tiny model with a synthetic batch, and the RL objective
computed rollout by rollout, by hand."""

import numpy as np
import torch

from zrl.moepp import load_hf_checkpoint
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch

# Packed vs per-rollout gradients differ only by fp32 summation order. Per tensor the worst case is
# qk_norm.temp (2 elements, each a sum over all tokens with heavy cancellation): measured up to 1.5e-5
# relative, every other tensor <= 3.8e-6; the whole gradient <= 4.3e-7.
TENSOR_RTOL = 1e-4
TOTAL_RTOL = 2e-6


def assert_grads_close(grads: dict, expected: dict) -> None:
    """Per-tensor and whole-gradient relative differences within the measured summation-order noise."""
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        rel = ((g - expected[name]).norm() / expected[name].norm().clamp_min(1e-12)).item()
        assert rel < TENSOR_RTOL, (name, rel)
    diff = sum(((grads[k] - expected[k]) ** 2).sum() for k in grads) ** 0.5
    total = sum((expected[k] ** 2).sum() for k in expected) ** 0.5
    assert (diff / total).item() < TOTAL_RTOL


def reference_token_loss(lp, lq, adv, name, params):
    """Per-token loss of one rollout's response tokens [Tr], formulas of docs/algorithms.md §3."""
    ratio = torch.exp(lp - lq)
    if name == "ppo_clip":
        clipped = ratio.clamp(1 - params["clip_low"], 1 + params["clip_high"])
        return -torch.minimum(ratio * adv, clipped * adv), ((adv > 0) & (ratio > 1 + params["clip_high"])) | (
            (adv < 0) & (ratio < 1 - params["clip_low"]))
    diff = lp.detach().exp() - lq.exp()
    dropped = ((adv > 0) & (diff > params["delta"])) | ((adv < 0) & (diff < -params["delta"]))
    weight = ratio.detach().clamp(max=params["is_cap"])
    return -adv * (~dropped) * weight * lp, dropped


def reference(model, batch, objective):
    """(loss, grads, per-token facts) of the global-batch objective computed rollout by rollout."""
    model.zero_grad(set_to_none=True)
    rollouts, advantages = batch.rollouts(), batch.advantages()
    n_seq, n_tok = batch.num_sequences, batch.num_response_tokens
    total, facts = 0.0, {"dropped": 0, "lp": [], "lq": [], "disagree": 0, "recorded": 0, "entropy": []}
    for r, a in zip(rollouts, advantages):
        p, n = len(r.prompt_ids), len(r.token_ids)
        if n == 0:
            continue
        full = torch.from_numpy(np.concatenate([r.prompt_ids, r.token_ids]).astype(np.int64))
        out = model.token_logprobs(full[:-1], full[1:], routing_replay=torch.from_numpy(r.routing[:p + n - 1]),
                                   with_entropy=True)
        lp = out.logprobs[p - 1:]
        lq = torch.from_numpy(r.logprobs).float()
        adv = torch.full_like(lq, float(a))
        token_loss, dropped = reference_token_loss(lp, lq, adv, objective.trust_region, objective.trust_region_params)
        if objective.aggregation == "seq_mean_token_sum_norm":
            seq_loss = token_loss.sum() / (n_seq * objective.max_response_tokens)
        elif objective.aggregation == "token_mean":
            seq_loss = token_loss.sum() / n_tok
        else:
            seq_loss = token_loss.mean() / n_seq
        seq_loss.backward()
        total += seq_loss.item()
        facts["dropped"] += int(dropped.sum())
        facts["lp"].append(lp.detach())
        facts["lq"].append(lq)
        facts["entropy"].append(out.entropy[p - 1:].detach())
        facts["disagree"] += int(out.routing.replay_disagree.sum())
        facts["recorded"] += int(out.routing.replay_recorded.sum())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return total, grads, facts


def tiny_model_and_batch(checkpoint, **batch_options):
    """The tiny model and a synthetic batch pulled at trainer step 1 whose behaviour logprobs are the
    model's own plus noise (0.2); `batch_options` go to synthetic_train_batch."""
    model = load_hf_checkpoint(checkpoint)
    cfg = model.config
    batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=get_family(cfg.model_type).shape(cfg), trainer_step=1, model=model, logprob_noise=0.2,
                                  **batch_options)
    return model, batch
