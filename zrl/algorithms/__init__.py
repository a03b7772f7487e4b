"""RL objective library: group advantages, length reward, token-level trust regions, loss aggregation.

Pure functions on numpy (per-group rewards, [G]) and torch (per-token tensors, [T] or [B, S]);
formulas, sources and decisions are in README.md beside this file.
"""

from zrl.algorithms.advantages import (
    ADVANTAGE_NAMES,
    AdvantageName,
    DynamicSamplingResult,
    compute_advantages,
    drgrpo_advantages,
    filter_zero_variance_groups,
    grpo_advantages,
    maxrl_advantages,
)
from zrl.algorithms.aggregation import (
    AGGREGATION_NAMES,
    AggregationName,
    aggregate_loss,
    local_counts,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
    token_weights,
)
from zrl.algorithms.length_reward import (
    SolveRateFrontier,
    length_coef,
    length_gate,
    length_lambdas,
    length_rewards,
    tolerant_lambdas,
)
from zrl.algorithms.scoring import GroupScore, score_group
from zrl.algorithms.trust_region import (
    TRUST_REGION_NAMES,
    PolicyLoss,
    TrustRegionName,
    TrustRegionStats,
    binary_kl,
    binary_kl_keep_mask,
    binary_tv_keep_mask,
    dppo_binary_kl_loss,
    dppo_binary_tv_loss,
    policy_loss,
    policy_loss_grad,
    ppo_clip_loss,
    token_separable,
    truncated_is_weight,
)

__all__ = [
    "ADVANTAGE_NAMES", "AGGREGATION_NAMES", "TRUST_REGION_NAMES",
    "AdvantageName", "AggregationName", "TrustRegionName",
    "DynamicSamplingResult", "GroupScore", "PolicyLoss", "SolveRateFrontier", "TrustRegionStats",
    "aggregate_loss", "binary_kl", "binary_kl_keep_mask", "binary_tv_keep_mask", "compute_advantages",
    "dppo_binary_kl_loss", "dppo_binary_tv_loss", "drgrpo_advantages", "filter_zero_variance_groups",
    "grpo_advantages", "length_coef", "length_gate", "length_lambdas", "length_rewards", "local_counts",
    "maxrl_advantages", "policy_loss", "policy_loss_grad", "ppo_clip_loss", "score_group", "seq_mean_token_mean", "seq_mean_token_sum_norm",
    "token_mean", "token_separable", "token_weights", "tolerant_lambdas", "truncated_is_weight",
]
