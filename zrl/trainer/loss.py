"""One microbatch's share of the RL (or SFT) objective, and the statistics the step reports.

RL (docs/algorithms.md §3-4, ZAYA1-8B report §IV-B1): the trainer recomputes log p of every response token with
the recorded experts (router replay), applies the recipe's trust region against the behaviour
logprob log q, and aggregates with the recipe's mode normalised by GLOBAL counts (N_seq, N_tok of the
whole TrainBatch, T_norm = max_response_tokens). Each microbatch returns its share; the sum over
microbatches and ranks (gradient accumulation plus FSDP2 SUM reduction) is the global objective.

The LM head is fused with the RL loss (`uses_fused_head`): every trust region and aggregation of
zrl.algorithms is token-separable (a token's dL/dlog p depends on its own log p and constants), so the
model's `token_loss` forms the head's gradients in the forward pass (zrl.modeling.kernels.lm_logprobs,
fused.py) from `policy_loss_grad` x `token_weights`. The unfused path (`token_logprobs`, then
`policy_loss` and `aggregate_loss` through autograd) is the fallback: for a model without `token_loss`,
the Triton head backend (no fused variant), with gradients off, or `fused_head=False`. Either way the
trust-region statistics come from `policy_loss` on the detached log-probs. With the fused head the
head's backward GEMMs run (and are timed) in the forward phase.

SFT: masked next-token NLL on response tokens, token mean over the global batch:
  L = -(1/N_tok) Σ_{response tokens} log p.

`StepStats` holds float64 sufficient statistics that add over microbatches (SUM) or combine by MAX,
so two all-reduces per step make every rank's metrics those of the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zrl.algorithms import (TrustRegionStats, aggregate_loss, policy_loss, policy_loss_grad, token_separable,
                            token_weights)
from zrl.canaries import MismatchStats, mismatch_sums
from zrl.canaries.mismatch import NUM_SUMS
from zrl.modeling.kernels.lm_logprobs import TokenGrad, head_loss_available
from zrl.modeling.logprobs import SamplingDistribution
from zrl.trainer.batch import Microbatch

_MISMATCH_MAX = NUM_SUMS - 1  # the max |p - q| entry of a mismatch sums vector


@dataclass(frozen=True)
class RLObjective:
    """What the recipe fixes about the RL loss (from `Algorithm` and `Sampling`)."""

    trust_region: str  # zrl.algorithms.TRUST_REGION_NAMES
    trust_region_params: dict  # keyword options of that trust region (delta, is_cap, clip_low, ...)
    aggregation: str  # zrl.algorithms.AGGREGATION_NAMES
    max_response_tokens: int  # T_norm of seq_mean_token_sum_norm
    # the rollout engine's sampling distribution: log p is computed under it, as the behaviour log q was
    sampling: SamplingDistribution = SamplingDistribution()


@dataclass
class MicrobatchOutput:
    loss: torch.Tensor  # [] with grad: this microbatch's share of the global loss
    logprobs: torch.Tensor  # [T] detached trainer log p of the targets


def forward_logprobs(model, mb: Microbatch, *, with_entropy: bool, chunk_tokens: int | None = None,
                     sampling: SamplingDistribution | None = None):
    """log p of every target of the packed stream with router replay, under `sampling` (None: the plain
    softmax); returns the model's TokenLogprobs (zrl.modeling's type, shared by every model family)."""
    return model.token_logprobs(mb.input_ids, mb.targets, cu_seqlens=mb.cu_seqlens, routing_replay=mb.routing,
                                with_entropy=with_entropy, chunk_tokens=chunk_tokens, sampling=sampling)


def uses_fused_head(model, mb: Microbatch, objective: RLObjective) -> bool:
    """Whether `rl_microbatch_loss` fuses the LM head with the loss (see the module docstring)."""
    return (torch.is_grad_enabled() and token_separable(objective.trust_region) and hasattr(model, "token_loss")
            and head_loss_available(mb.input_ids))


def rl_microbatch_loss(model, mb: Microbatch, objective: RLObjective, *, global_num_seqs: int,
                       global_num_tokens: int, trainer_step: int, stats: StepStats | None = None,
                       with_entropy: bool = True, chunk_tokens: int | None = None,
                       fused_head: bool = True) -> MicrobatchOutput:
    """Forward one microbatch and return its loss term; adds its statistics to `stats` (not the dummy's).
    `fused_head`: allow the fused LM head (`uses_fused_head` decides); False forces the unfused path."""
    if fused_head and uses_fused_head(model, mb, objective):
        loss, out = _fused_rl_loss(model, mb, objective, global_num_seqs=global_num_seqs,
                                   global_num_tokens=global_num_tokens, with_entropy=with_entropy,
                                   chunk_tokens=chunk_tokens)
        pl = None
        if stats is not None and not mb.is_dummy:  # the trust region's statistics, from the detached log p
            pl = policy_loss(objective.trust_region, out.logprobs, mb.behaviour_logprobs, mb.advantages,
                             mb.loss_mask, **objective.trust_region_params)
    else:
        out = forward_logprobs(model, mb, with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                               sampling=objective.sampling)
        pl = policy_loss(objective.trust_region, out.logprobs, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                         **objective.trust_region_params)
        loss = aggregate_loss(objective.aggregation, pl.token_loss, mb.loss_mask, mb.seq_idx,
                              global_num_seqs=global_num_seqs, global_num_tokens=global_num_tokens,
                              max_response_tokens=objective.max_response_tokens)
    if stats is not None and not mb.is_dummy:
        stats.add_rl(mb, out, pl.stats, loss, trainer_step)
    return MicrobatchOutput(loss=loss, logprobs=out.logprobs.detach())


def _fused_rl_loss(model, mb: Microbatch, objective: RLObjective, *, global_num_seqs: int, global_num_tokens: int,
                   with_entropy: bool, chunk_tokens: int | None):
    """(loss [], detached TokenLogprobs) through the model's fused head (`rl_token_grad`)."""
    token_grad = rl_token_grad(objective, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, mb.seq_idx,
                               global_num_seqs=global_num_seqs, global_num_tokens=global_num_tokens)
    return model.token_loss(mb.input_ids, mb.targets, token_grad, cu_seqlens=mb.cu_seqlens, routing_replay=mb.routing,
                            with_entropy=with_entropy, chunk_tokens=chunk_tokens, sampling=objective.sampling)


def rl_token_grad(objective: RLObjective, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, seq_idx: torch.Tensor, *, global_num_seqs: int, global_num_tokens: int,
                  dtype: torch.dtype = torch.float32) -> TokenGrad:
    """The RL loss as the fused head's per-token function: L = sum_t w_t l_t with w the aggregation's
    token weights (`token_weights`), l_t and dl_t/dlog p the trust region's (`policy_loss_grad`); the
    same loss as `policy_loss` then `aggregate_loss`. Tensors [T] (flattened when [B, S])."""
    weights = token_weights(objective.aggregation, loss_mask, seq_idx, global_num_seqs=global_num_seqs,
                            global_num_tokens=global_num_tokens, max_response_tokens=objective.max_response_tokens,
                            dtype=dtype).reshape(-1)
    behaviour, advantages, loss_mask = behaviour_logprobs.reshape(-1), advantages.reshape(-1), loss_mask.reshape(-1)

    def token_grad(rows: slice, logprob: torch.Tensor, entropy: torch.Tensor | None):
        token_loss, grad = policy_loss_grad(objective.trust_region, logprob, behaviour[rows], advantages[rows],
                                            loss_mask[rows], **objective.trust_region_params)
        w = weights[rows].to(token_loss.dtype)
        return token_loss * w, grad * w, None

    return token_grad


def sft_microbatch_loss(model, mb: Microbatch, *, global_num_tokens: int, stats: StepStats | None = None,
                        with_entropy: bool = False, chunk_tokens: int | None = None) -> MicrobatchOutput:
    """Masked NLL of the response tokens over the global token count."""
    out = forward_logprobs(model, mb, with_entropy=with_entropy, chunk_tokens=chunk_tokens)
    nll = -out.logprobs
    loss = aggregate_loss("token_mean", nll, mb.loss_mask, mb.seq_idx, global_num_seqs=0,
                          global_num_tokens=global_num_tokens, max_response_tokens=1)
    if stats is not None and not mb.is_dummy:
        stats.add_common(mb, out, loss)
    return MicrobatchOutput(loss=loss, logprobs=out.logprobs.detach())


class StepStats:
    """Per-step accumulators; `all_reduce` then `metrics` give the global batch's values.

    Every key exists from the start with its reduction's identity (0 for SUM, -inf for MAX), so all
    ranks reduce vectors of the same layout even when a rank ran only dummy microbatches.

    `mismatch/*` compares the engine's and the trainer's logprobs over every loss token;
    `mismatch/onpolicy_*` over tokens scored by the trainer under the weights that sampled them, where
    any difference is numerical mismatch alone, not policy change: the loss pass's tokens of the version
    being trained (`add_rl`) and the tokens of the previous synced version scored under a copy of its
    weights (`add_onpolicy`, zrl.trainer.onpolicy); `onpolicy_version_lag` is how many steps older than
    the weights being trained the scoring weights were (the largest, 0 when only the loss pass scored).
    A step without such tokens reports `onpolicy_num_tokens` = 0 and leaves the statistics out (not
    NaN), so dashboards and the stage plots show no point there.

    Expert counts are [L, C] (C = the model family's `count_classes`: E, plus a skip class for MoE++);
    `routing_metrics` (the family's) turns the global counts into the `routing/*` load metrics.
    """

    def __init__(self, kind: str, *, num_layers: int, num_classes: int, device: torch.device,
                 with_entropy: bool, replay: bool,
                 routing_metrics: Callable[[torch.Tensor], dict[str, float]] | None = None) -> None:
        if kind not in ("rl", "sft"):
            raise ValueError(f"kind must be 'rl' or 'sft', got {kind!r}")
        self.kind, self.num_layers, self.num_classes, self.device = kind, num_layers, num_classes, device
        self.routing_metrics = routing_metrics
        sizes = {"loss": 1, "tokens": 3, "logprob_sum": 1, "expert_counts": num_layers * num_classes}
        if with_entropy:
            sizes["entropy_sum"] = 1
        if replay:
            sizes["replay"] = 3
        maxes = {}
        if kind == "rl":
            sizes.update(trust_region=8, mismatch=NUM_SUMS, mismatch_onpolicy=NUM_SUMS)
            maxes.update(is_weight_extremes=2, mismatch_max=1, mismatch_onpolicy_max=1, onpolicy_version_lag=1)
        zeros = dict(dtype=torch.float64, device=device)
        self.sums = {k: torch.zeros(n, **zeros) for k, n in sizes.items()}  # reduced with SUM
        self.maxes = {k: torch.full((n,), -math.inf, **zeros) for k, n in maxes.items()}  # reduced with MAX

    def _add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] += value.detach().to(device=self.device, dtype=torch.float64).reshape(-1)

    def _max(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().to(device=self.device, dtype=torch.float64).reshape(-1)
        self.maxes[key] = torch.maximum(self.maxes[key], value)

    def add_common(self, mb: Microbatch, out, loss: torch.Tensor) -> None:
        mask = mb.loss_mask
        routing = out.routing
        self._add("loss", loss)
        # [input tokens, loss tokens, sequences]. Host ints are added as kernel arguments (a host tensor
        # would need a copy) and the loss-token count stays on the device (no host read).
        tokens = self.sums["tokens"]
        tokens[0] += mb.num_tokens
        tokens[1] += mask.sum()
        tokens[2] += mb.num_sequences
        self._add("logprob_sum", torch.where(mask, out.logprobs.detach(), 0.0).sum())
        if "entropy_sum" in self.sums:
            self._add("entropy_sum", torch.where(mask, out.entropy.detach(), 0.0).sum())
        self._add("expert_counts", routing.expert_counts)  # [L, C] flattened
        if "replay" in self.sums and routing.replay_disagree is not None:
            self._add("replay", torch.stack([routing.replay_disagree.sum(), routing.replay_recorded.sum(),
                                             routing.replay_missing.sum()]))

    def add_rl(self, mb: Microbatch, out, tr_stats: TrustRegionStats, loss: torch.Tensor, trainer_step: int) -> None:
        self.add_common(mb, out, loss)
        self._add("trust_region", tr_stats.sums)
        # max of the IS weight and max of its negation (= -min), so one MAX all-reduce serves both
        self._max("is_weight_extremes", torch.stack([tr_stats.max_is_weight, -tr_stats.min_is_weight]))
        onpolicy = mb.loss_mask & (mb.versions == trainer_step)  # sampled by the weights being trained
        for key, mask in (("mismatch", mb.loss_mask), ("mismatch_onpolicy", onpolicy)):
            self._add_mismatch(key, out.logprobs, mb.behaviour_logprobs, mask)

    def add_onpolicy(self, mb: Microbatch, logprobs: torch.Tensor, version: int, lag: int) -> None:
        """The tokens of `mb` sampled by `version`, whose trainer `logprobs` [T] were taken under that
        version's weights, `lag` steps older than the weights being trained."""
        mask = mb.loss_mask & (mb.versions == version)
        self._add_mismatch("mismatch_onpolicy", logprobs, mb.behaviour_logprobs, mask)
        self._max("onpolicy_version_lag", torch.where(mask.any(), float(lag), -math.inf))  # -inf: no token

    def _add_mismatch(self, key: str, trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> None:
        sums = mismatch_sums(trainer_logprobs, behaviour_logprobs, mask)
        self._max(key + "_max", sums[_MISMATCH_MAX:])
        sums = sums.clone()
        sums[_MISMATCH_MAX] = 0.0
        self._add(key, sums)

    def all_reduce(self, group=None) -> None:
        """Sum (and max) every accumulator over the ranks of `group` (one collective each kind)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        for store, op in ((self.sums, dist.ReduceOp.SUM), (self.maxes, dist.ReduceOp.MAX)):
            keys = sorted(store)  # same keys and sizes on every rank (see the class docstring)
            if not keys:
                continue
            flat = torch.cat([store[k] for k in keys])
            dist.all_reduce(flat, op=op, group=group)
            offset = 0
            for k in keys:
                n = store[k].numel()
                store[k] = flat[offset:offset + n]
                offset += n

    def expert_counts(self) -> torch.Tensor:
        """[L, C] int64 tokens per chosen class over the accumulated microbatches."""
        return self.sums["expert_counts"].reshape(self.num_layers, self.num_classes).round().long()

    def metrics(self) -> dict[str, float]:
        """Flat `panel/name` metrics of the accumulated (and, after `all_reduce`, global) microbatches."""
        s = self.sums
        tokens, loss_tokens, seqs = s["tokens"].tolist()
        out = {"loss/policy" if self.kind == "rl" else "loss/sft": float(s["loss"]),
               "batch/input_tokens": tokens, "batch/loss_tokens": loss_tokens, "batch/packed_sequences": seqs,
               "policy/logprob_mean": _div(s["logprob_sum"], loss_tokens)}
        if "entropy_sum" in s:
            out["policy/entropy_mean"] = _div(s["entropy_sum"], loss_tokens)
        if self.kind == "rl":
            high, neg_low = self.maxes["is_weight_extremes"].tolist()
            tr = TrustRegionStats(sums=s["trust_region"].cpu(), max_is_weight=torch.tensor(high),
                                  min_is_weight=torch.tensor(-neg_low))
            out.update({f"trust_region/{k}": v for k, v in tr.as_metrics().items()})
            for key, prefix in (("mismatch", "mismatch/"), ("mismatch_onpolicy", "mismatch/onpolicy_")):
                sums = s[key].clone()
                sums[_MISMATCH_MAX] = self.maxes[key + "_max"][0]
                stats = MismatchStats.from_sums(sums.cpu())
                values = stats.as_metrics() if stats.num_tokens else {"num_tokens": 0.0}  # no tokens: count only
                out.update({prefix + k: v for k, v in values.items()})
            if out["mismatch/onpolicy_num_tokens"]:
                out["mismatch/onpolicy_version_lag"] = max(float(self.maxes["onpolicy_version_lag"][0]), 0.0)
        if "replay" in s:
            disagree, recorded, missing = s["replay"].tolist()
            out["routing/replay_disagree_frac"] = disagree / recorded if recorded else math.nan
            out["routing/replay_missing_frac"] = missing / (missing + recorded) if missing + recorded else math.nan
        counts = self.expert_counts()
        if self.routing_metrics is not None and counts.sum() > 0:
            out.update(self.routing_metrics(counts))
        return out


def _div(num: torch.Tensor | None, den: float) -> float:
    return float(num) / den if num is not None and den > 0 else math.nan
