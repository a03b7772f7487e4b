"""RL objective library: group advantages, length reward, token-level trust regions, loss aggregation.

Pure functions on numpy (per-group rewards, [G]) and torch (per-token tensors, [T] or [B, S]);
formulas, sources and decisions are in README.md beside this file. Names are exported lazily so that
the numpy half (the buffer's scoring) does not import torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "ADVANTAGE_NAMES": "advantages", "AdvantageName": "advantages", "DynamicSamplingResult": "advantages",
    "compute_advantages": "advantages", "drgrpo_advantages": "advantages",
    "filter_zero_variance_groups": "advantages", "grpo_advantages": "advantages", "maxrl_advantages": "advantages",
    "AGGREGATION_NAMES": "aggregation", "AggregationName": "aggregation", "aggregate_loss": "aggregation",
    "local_counts": "aggregation", "seq_mean_token_mean": "aggregation", "seq_mean_token_sum_norm": "aggregation",
    "token_mean": "aggregation", "token_weights": "aggregation",
    "SolveRateFrontier": "length_reward", "length_coef": "length_reward", "length_gate": "length_reward",
    "length_lambdas": "length_reward", "length_rewards": "length_reward", "tolerant_lambdas": "length_reward",
    "GroupScore": "scoring", "score_group": "scoring",
    "TRUST_REGION_NAMES": "trust_region", "PolicyLoss": "trust_region", "TrustRegionName": "trust_region",
    "TrustRegionStats": "trust_region", "binary_kl": "trust_region", "binary_kl_keep_mask": "trust_region",
    "binary_tv_keep_mask": "trust_region", "dppo_binary_kl_loss": "trust_region",
    "dppo_binary_tv_loss": "trust_region", "policy_loss": "trust_region", "policy_loss_grad": "trust_region",
    "ppo_clip_loss": "trust_region", "token_separable": "trust_region", "truncated_is_weight": "trust_region",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
